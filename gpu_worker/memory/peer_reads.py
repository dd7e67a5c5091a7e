"""Transport shm of a sharded CP pool: attention's reads of every owner's rows.

`ShardedDeviceKVPool` (`memory/sharded_pool.py`, whose module doc says why each read is
sound) delegates here when its rows are regions of one shared-memory file
(`memory/shm_rows.py`): a pass's first `before_attention` opens its reads of peers' rows (a
barrier), `get_kv` reads any logical slots from their owners' rows in one `index_select`
over `SharedRows.flat` and puts this pass's new K/V (staged by `set_kv`) over them, and
`after_layers` closes the reads (a barrier).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.memory.shm_rows import SharedRows
from gpu_worker.parallel.cp_layout import CPLayout


class CPGatherPlan(Protocol):
    """What the reads take of `sharded_pool.CPGatherPlan` (no import of it: that module
    imports this one)."""

    @property
    def gather_page_ids(self) -> torch.Tensor: ...  # (n,) int64: prefix pages

    @property
    def chunk_pages(self) -> int: ...  # M: the most prefix pages one rank owns

    @property
    def page_to_scratch(self) -> torch.Tensor: ...  # (num_pages,) int64, -1 off the plan


class ShardedDeviceKVPool(Protocol):
    """What the reads take of `sharded_pool.ShardedDeviceKVPool`."""

    spec: KVSpec
    device: torch.device
    num_pages: int
    layout: CPLayout
    cp_size: int
    group: dist.ProcessGroup | None
    kv: torch.Tensor
    check_reads: bool
    wait_layer: Callable[[int, torch.Tensor], None] | None


class PeerReads:
    """Transport shm: the pool's reads of every owner's rows, pass by pass, between two
    barriers (the module doc's conditions), with this pass's new K/V put over them."""

    def __init__(self, pool: ShardedDeviceKVPool, peers: SharedRows) -> None:
        self.pool, self.peers = pool, peers
        self.plan: CPGatherPlan | None = None  # the pass being run
        self.reading: CPGatherPlan | None = None  # the plan whose peer reads are open
        # this pass's new K/V as `set_kv` gave them: (layer, slots, (K, V) or (latent,))
        self.staged: tuple[int, torch.Tensor, tuple[torch.Tensor, ...]] | None = None
        # per slot_ids read this pass (keyed by the ids of it and of the staged slots, both
        # kept alive in the entry): their rows in `flat` less the layer's offset, the
        # positions holding this pass's new slots, and those slots' rows in `staged`
        self.index: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def begin(self, plan: CPGatherPlan) -> None:
        """A layer of `plan`'s pass starts: the pass's first opens its reads of peers'
        rows (a plan with prefix pages), closing a pass that stopped early."""
        if self.plan is not plan:
            if self.reading is not None:
                self.close()  # a pass that stopped before its last layer
            self.plan, self.staged = plan, None
            self.index.clear()
        if self.reading is None and plan.chunk_pages > 0:
            self.open(plan)

    def stage(self, layer: int, slot_ids: torch.Tensor, kv: tuple[torch.Tensor, ...]) -> None:
        """Keep `layer`'s new K/V of this pass (the rows `read` takes for their slots)."""
        if self.staged is not None and self.staged[0] == layer:
            raise RuntimeError(f"layer {layer}: a second set_kv in one pass of a sharded pool")
        if self.staged is not None and not torch.equal(self.staged[1], slot_ids):
            self.index.clear()  # other new slots than the last layer's (not the model's way)
        self.staged = (layer, slot_ids, kv)

    def read(self, layer: int, slot_ids: torch.Tensor, count: int) -> list[torch.Tensor]:
        """`layer`'s first `count` of K/V (or the latent) at logical `slot_ids`, each
        (n, num_kv_heads, head_dim): one read of their owners' rows, then this pass's new
        slots from the staged K/V."""
        pool = self.pool
        if self.plan is None:
            raise RuntimeError(f"layer {layer} was read before before_attention")
        base, dst, src = self._rows_of(slot_ids)
        staged = self.staged
        if dst.numel() and (staged is None or staged[0] != layer):
            raise RuntimeError(f"layer {layer}: new slots read before their set_kv")
        rows = pool.kv.shape[2]
        out = []
        for c in range(count):
            t = self.peers.flat.index_select(0, base + (layer * pool.spec.num_kv + c) * rows)
            if dst.numel():
                assert staged is not None
                t.index_copy_(0, dst, staged[2][c].index_select(0, src).to(t.dtype))
            out.append(t)
        return out

    def _rows_of(self, slot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`read`'s index of `slot_ids`, built once per pass and slot tensor."""
        staged = None if self.staged is None else self.staged[1]
        key = (id(slot_ids), id(staged))
        found = self.index.get(key)
        if found is not None:
            return found[0], found[1], found[2]
        pool, plan = self.pool, self.plan
        assert plan is not None
        p, n = pool.spec.page_size, pool.cp_size
        pages = torch.div(slot_ids, p, rounding_mode="floor")
        if pool.check_reads and bool((plan.page_to_scratch[pages] < 0).any()):
            raise RuntimeError("a slot outside the gathered pages was read")
        base = (pages % n) * self.peers.region_rows + pool.layout.local_rows(slot_ids)
        if staged is None or staged.numel() == 0:
            dst = src = torch.empty(0, dtype=torch.int64, device=slot_ids.device)
        else:
            order = torch.argsort(staged)  # where each slot is among the staged ones
            ordered = staged[order]
            at = torch.searchsorted(ordered, slot_ids).clamp_(max=len(staged) - 1)
            dst = torch.nonzero(ordered[at] == slot_ids).flatten()
            src = order[at[dst]]
        self.index[key] = (base, dst, src, slot_ids, *([] if staged is None else [staged]))
        return base, dst, src

    def open(self, plan: CPGatherPlan) -> None:
        """Before a plan's first read of a peer's rows: this rank's loads into the plan's
        pages land (every layer), then a barrier, so every owner's have landed and every
        owner finished the passes that wrote the pages."""
        pool = self.pool
        if pool.wait_layer is not None:
            for layer in range(pool.spec.num_layers):
                pool.wait_layer(layer, plan.gather_page_ids)
        dist.barrier(group=pool.group)
        self.reading = plan

    def close(self) -> None:
        """After a plan's last read of a peer's rows: a barrier, so no owner writes the
        pages (a load into a reused page, the next pass) while a peer still reads them."""
        dist.barrier(group=self.pool.group)
        self.reading = None
