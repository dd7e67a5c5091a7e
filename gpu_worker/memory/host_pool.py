"""The host KV pool (HiCache's second tier) in one of two layouts."""

from __future__ import annotations

from typing import Literal

import torch

from gpu_worker.kernels.page_transfer import PageView
from gpu_worker.kernels.relayout import RunView
from gpu_worker.memory.allocator import PageAllocator
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.parallel.cp_layout import CPLayout

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

    Context parallelism: host page ids come in `num_owners` owner classes like device pages
    (host page `h` belongs to CP rank `h % num_owners`, `PageAllocator`), so a path's host
    pages keep the owner cycle its device pages have (path page k on rank k % N). With
    `owned_by` (a CP rank of a sharded engine) the pool holds only that rank's pages: its
    `num_pages` logical pages are handed out by every rank's allocator alike, and the
    tensors hold `ceil(num_pages / N)` local pages, logical page `h` at local page `h // N`
    (`CPLayout`), as the sharded device pool holds its rows. `page_view` sees local pages.
    """

    def __init__(
        self,
        spec: KVSpec,
        num_pages: int,
        layout: HostLayout,
        device: torch.device,
        group_heads: int | None = None,
        num_owners: int = 1,
        owned_by: int | None = None,
    ) -> None:
        """`group_heads`: KV heads per group of the `page_unified` layout (default: all);
        `num_owners`: the owner classes (CP ranks) of its page ids; `owned_by`: hold only
        that rank's pages (see the class docstring)."""
        if layout not in ALL_LAYOUTS:
            raise ValueError(f"unknown host layout {layout!r}; choose one of {ALL_LAYOUTS}")
        if owned_by is not None and not 0 <= owned_by < num_owners:
            raise ValueError(f"host pool of CP rank {owned_by} of {num_owners}")
        self.spec = spec
        self.layout = layout
        self.num_pages = num_pages  # logical: what the allocator hands out
        self.allocator = PageAllocator(num_pages, "host", num_owners)
        self.owned_by = owned_by
        # pages the tensors hold: every logical page, or this rank's share of them
        shares = CPLayout(spec.page_size, num_owners)
        self.num_local_pages = num_pages if owned_by is None else shares.num_local_pages(num_pages)
        num_rows = self.num_local_pages
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
            shape = (nl, kv, num_rows * ps, h, d)
        elif layout == "page_first":
            shape = (num_rows, nl, kv, ps, h, d)
        else:
            shape = (num_rows, h // self.group_heads, nl, kv, ps, self.group_heads, d)
        pin = device.type == "cuda"
        self.kv = torch.zeros(shape, dtype=spec.dtype, pin_memory=pin)
        # a pool of another shape whose pages are this pool's page ids, moved with them (a
        # sidecar draft's, `PoolGroup.attach_host`): storage reads and writes it beside
        # this one (`StorageLayout.codec`); its own allocator is unused
        self.sidecar: HostKVPool | None = None

    @property
    def sharded(self) -> bool:
        """Whether the pool holds only its CP rank's pages."""
        return self.owned_by is not None

    def page_view(self) -> PageView | RunView:
        """The pool's local pages for page copies: a `RunView` for `page_unified` (pair it
        with the device pool's `run_view`), a `PageView` otherwise."""
        if self.layout == "layer_first":
            return PageView.layer_first(self.kv, self.spec.page_size)
        if self.layout == "page_first":
            return PageView.page_first(self.kv)
        return RunView.unified(self.kv)
