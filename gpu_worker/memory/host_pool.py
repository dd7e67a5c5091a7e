"""The host KV pool (HiCache's second tier) in one of two layouts."""

from __future__ import annotations

from typing import Literal

import torch

from gpu_worker.kernels.page_transfer import PageView
from gpu_worker.kernels.relayout import RunView
from gpu_worker.memory.allocator import PageAllocator
from gpu_worker.memory.kv_spec import KVSpec

HostLayout = Literal["layer_first", "page_first", "page_unified"]
# what --hicache-mem-layout offers; page_unified comes with the unified storage key scheme
HOST_LAYOUTS: tuple[HostLayout, ...] = ("layer_first", "page_first")
ALL_LAYOUTS: tuple[HostLayout, ...] = (*HOST_LAYOUTS, "page_unified")


class HostKVPool:
    """KV pages in host memory (pinned when the device is CUDA).

    Layouts (`num_kv` is the spec's: 2 for K and V, 1 for MLA's latent, whose one head and
    one head group make `page_unified` the MLA object order (layer, token_in_page, dim)):
    - `layer_first`: (num_layers, num_kv, num_pages * page_size, num_kv_heads, head_dim),
      the device pool's own order, so one layer's pages are close together.
    - `page_first`: (num_pages, num_layers, num_kv, page_size, num_kv_heads, head_dim): a
      page is one contiguous span across all layers, the shape storage backends and P/D want.
    - `page_unified`: (num_pages, num_groups, num_layers, num_kv, page_size, group_heads,
      head_dim), the unified storage key scheme's byte order (DESIGN.md 5): every stored
      object (a range of layers of one head group) is one contiguous span of a page, read
      and written in place; device pages move in and out of it through the relayout kernel.
    """

    def __init__(
        self,
        spec: KVSpec,
        num_pages: int,
        layout: HostLayout,
        device: torch.device,
        group_heads: int | None = None,
    ) -> None:
        """`group_heads`: KV heads per group of the `page_unified` layout (default: all)."""
        if layout not in ALL_LAYOUTS:
            raise ValueError(f"unknown host layout {layout!r}; choose one of {ALL_LAYOUTS}")
        self.spec = spec
        self.layout = layout
        self.num_pages = num_pages
        self.allocator = PageAllocator(num_pages, "host")
        h, d, ps, nl, kv = (
            spec.num_kv_heads,
            spec.head_dim,
            spec.page_size,
            spec.num_layers,
            spec.num_kv,
        )
        self.group_heads = group_heads or h
        if h % self.group_heads:
            raise ValueError(f"{self.group_heads} heads per group do not divide {h} KV heads")
        shape: tuple[int, ...]
        if layout == "layer_first":
            shape = (nl, kv, num_pages * ps, h, d)
        elif layout == "page_first":
            shape = (num_pages, nl, kv, ps, h, d)
        else:
            shape = (num_pages, h // self.group_heads, nl, kv, ps, self.group_heads, d)
        pin = device.type == "cuda"
        self.kv = torch.zeros(shape, dtype=spec.dtype, pin_memory=pin)

    def page_view(self) -> PageView | RunView:
        """The pool for page copies: a `RunView` for `page_unified` (pair it with the device
        pool's `run_view`), a `PageView` otherwise."""
        if self.layout == "layer_first":
            return PageView.layer_first(self.kv, self.spec.page_size)
        if self.layout == "page_first":
            return PageView.page_first(self.kv)
        return RunView.unified(self.kv)
