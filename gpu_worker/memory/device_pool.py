"""The device KV pool: per-layer K and V rows (or MLA's latent rows) addressed by token slot."""

from __future__ import annotations

import torch

from gpu_worker.kernels.page_transfer import PageView
from gpu_worker.kernels.relayout import RunView
from gpu_worker.memory.allocator import PageAllocator, PageId
from gpu_worker.memory.kv_spec import KVSpec


class DeviceKVPool:
    """KV of `num_pages` pages on `device`, with the page allocator that owns them.

    Storage is `kv` of shape (num_layers, num_kv, num_pages * page_size, num_kv_heads,
    head_dim): num_kv 2 (K, V) for MHA, 1 for MLA (one head: the latent row, head_dim its
    width). Page `p` is slots `[p * page_size, (p + 1) * page_size)` of every layer.

    With `check_reads`, pages written by an in-flight load are marked pending and `get_kv`
    raises if attention would read one before its completion was consumed (invariant 3).

    `num_owners`: the owner classes of its page ids (the CP ranks pages go round-robin over,
    `PageAllocator`); the pool still holds every page's rows.
    """

    def __init__(
        self,
        spec: KVSpec,
        num_pages: int,
        device: torch.device,
        check_reads: bool = False,
        num_owners: int = 1,
    ) -> None:
        self.spec = spec
        self.device = device
        self.num_pages = num_pages
        self.allocator = PageAllocator(num_pages, "device", num_owners)
        num_slots = num_pages * spec.page_size
        self.kv = torch.zeros(
            (spec.num_layers, spec.num_kv, num_slots, spec.num_kv_heads, spec.head_dim),
            dtype=spec.dtype,
            device=device,
        )
        self.check_reads = check_reads
        self._pending = torch.zeros(num_pages, dtype=torch.bool, device=device)

    # -- KVCache protocol (the model's view)

    contiguous_slices = True  # a slot is a row of `kv`: runs of slots read in place

    def before_attention(self, layer: int, batch: object) -> None:
        """Every page of this pool is local and written in place: nothing to prepare."""

    def after_layers(self, batch: object) -> None:
        """Nothing read from elsewhere: nothing to end."""

    def set_kv(self, layer: int, slot_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv[layer, 0, slot_ids] = k
        self.kv[layer, 1, slot_ids] = v

    def get_kv(self, layer: int, slot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_loaded(slot_ids)
        k, v = self.kv[layer, 0], self.kv[layer, 1]  # (num_slots, n_kv_heads, head_dim)
        # the rows k[slot_ids] gives, in half its time on the CPU (a plain row gather)
        return k.index_select(0, slot_ids), v.index_select(0, slot_ids)

    def kv_slice(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the consecutive slots `start..end-1` in place: views of the pool, no copy
        ((n, num_kv_heads, head_dim) each). Decode attention reads a request's runs of
        consecutive slots this way instead of gathering them (`attention_plan.DecodeGroup.runs`)."""
        if self.check_reads:
            ps = self.spec.page_size
            if bool(self._pending[start // ps : (end - 1) // ps + 1].any()):
                raise RuntimeError("attention read a page whose load has not completed")
        return self.kv[layer, 0, start:end], self.kv[layer, 1, start:end]

    def set_latent(self, layer: int, slot_ids: torch.Tensor, latent: torch.Tensor) -> None:
        self.kv[layer, 0, slot_ids] = latent

    def get_latent(self, layer: int, slot_ids: torch.Tensor) -> torch.Tensor:
        self._check_loaded(slot_ids)
        return self.kv[layer, 0].index_select(0, slot_ids)  # (n, 1, latent_dim)

    def _check_loaded(self, slot_ids: torch.Tensor) -> None:
        if self.check_reads and bool(self._pending[slot_ids // self.spec.page_size].any()):
            raise RuntimeError("attention read a page whose load has not completed")

    # -- pages

    def page_view(self) -> PageView:
        return PageView.layer_first(self.kv, self.spec.page_size)

    def run_view(self, group_heads: int) -> RunView:
        """The pool as runs of `group_heads` heads (what a `page_unified` host pool and the
        relayout kernel pair it with)."""
        return RunView.pool(self.kv, self.spec.page_size, group_heads)

    def slot_ids(self, page_ids: list[PageId], num_tokens: int) -> torch.Tensor:
        """Slots of token positions `[0, num_tokens)` laid over `page_ids`: (num_tokens,) int64."""
        ps = self.spec.page_size
        pages = torch.tensor(page_ids, dtype=torch.int64, device=self.device)
        offsets = torch.arange(ps, dtype=torch.int64, device=self.device)
        return (pages[:, None] * ps + offsets).flatten()[:num_tokens]  # (num_tokens,)

    def mark_pending(self, page_ids: list[PageId], pending: bool) -> None:
        if self.check_reads and page_ids:
            self._pending[torch.tensor(page_ids, dtype=torch.int64, device=self.device)] = pending
