"""One entry point for page copies between pools: the page-transfer kernel when both sides
are `PageView`s (whole (layer, K/V) blocks), the relayout kernel when either is a `RunView`
(a `page_unified` host pool: blocks cut into head groups)."""

from __future__ import annotations

import dataclasses

import torch

from gpu_worker.kernels.page_transfer import PageView, transfer_pages
from gpu_worker.kernels.relayout import RunView, relayout_pages

PoolView = PageView | RunView


def move_pages(
    src: PoolView,
    dst: PoolView,
    src_page_ids: torch.Tensor,
    dst_page_ids: torch.Tensor,
    backend: str = "auto",
) -> None:
    """Copy page `src_page_ids[i]` of `src` to page `dst_page_ids[i]` of `dst`; both views
    must be of one kind (the caller pairs a `page_unified` host pool with the device pool's
    `run_view`)."""
    if isinstance(src, PageView) and isinstance(dst, PageView):
        transfer_pages(src, dst, src_page_ids, dst_page_ids, backend)
    elif isinstance(src, RunView) and isinstance(dst, RunView):
        relayout_pages(src, dst, src_page_ids, dst_page_ids, backend)
    else:
        raise TypeError(f"cannot move pages from a {type(src).__name__} to a {type(dst).__name__}")


def layer_range(view: PoolView, start: int, stop: int) -> PoolView:
    """Layers `[start, stop)` of `view` as a view of their own, over the same memory.

    What a `packed` host pool (DESIGN section 4, speculative decoding) is made of: the
    target's layers and then the draft's in each host row, each model's copies walking its
    own range with its own device pool's geometry. The strides stay the whole row's; the
    view's tensor starts at layer `start` (a flat, contiguous tail of the row's memory, so
    both kernels address it from its `data_ptr` like any other)."""
    if not 0 <= start < stop <= view.num_layers:
        raise ValueError(f"layers [{start}, {stop}) of a view of {view.num_layers} layers")
    flat = view.tensor.reshape(-1)[start * view.layer_stride :]
    return dataclasses.replace(view, tensor=flat, num_layers=stop - start)
