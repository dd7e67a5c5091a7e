"""One entry point for page copies between pools: the page-transfer kernel when both sides
are `PageView`s (whole (layer, K/V) blocks), the relayout kernel when either is a `RunView`
(a `page_unified` host pool: blocks cut into head groups)."""

from __future__ import annotations

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
