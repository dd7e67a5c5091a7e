"""The host KV pool (HiCache's second tier) in one of two layouts."""

from __future__ import annotations

from typing import Literal

import torch

from gpu_worker.kernels.page_transfer import PageView
from gpu_worker.memory.allocator import PageAllocator
from gpu_worker.memory.kv_spec import KVSpec

HostLayout = Literal["layer_first", "page_first"]
HOST_LAYOUTS: tuple[HostLayout, ...] = ("layer_first", "page_first")


class HostKVPool:
    """KV pages in host memory (pinned when the device is CUDA).

    Layouts:
    - `layer_first`: (num_layers, 2, num_pages * page_size, num_kv_heads, head_dim), the
      device pool's own order, so one layer's pages are close together.
    - `page_first`: (num_pages, num_layers, 2, page_size, num_kv_heads, head_dim): a page is
      one contiguous span across all layers, the shape storage backends and P/D want.
    """

    def __init__(
        self, spec: KVSpec, num_pages: int, layout: HostLayout, device: torch.device
    ) -> None:
        if layout not in HOST_LAYOUTS:
            raise ValueError(f"unknown host layout {layout!r}; choose one of {HOST_LAYOUTS}")
        self.spec = spec
        self.layout = layout
        self.num_pages = num_pages
        self.allocator = PageAllocator(num_pages, "host")
        h, d, ps, nl = spec.num_kv_heads, spec.head_dim, spec.page_size, spec.num_layers
        shape = (
            (nl, 2, num_pages * ps, h, d)
            if layout == "layer_first"
            else (num_pages, nl, 2, ps, h, d)
        )
        pin = device.type == "cuda"
        self.kv = torch.zeros(shape, dtype=spec.dtype, pin_memory=pin)

    def page_view(self) -> PageView:
        if self.layout == "layer_first":
            return PageView.layer_first(self.kv, self.spec.page_size)
        return PageView.page_first(self.kv)
