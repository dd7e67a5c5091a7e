"""The device KV pool of one CP rank under page sharding: owned rows only, a per-layer gather.

Every CP rank sees the same logical pages and slots (the tree, the allocator, the request
table and `ForwardBatch.slot_ids` are logical, identical on every rank). This pool keeps
only the rows its rank owns (`parallel/cp_layout.py`: page `q` on rank `q % N`, local page
`q // N`), so the same per-rank memory holds `N` times the logical pages. Attention still
reads logical slots: `before_attention(layer, batch)` all-gathers the layer's pages of the
batch into a scratch buffer, and `get_kv` reads through the gather's page table.

What the batch must give (`AttendedBatch`: three of `ForwardBatch`'s fields, nothing new):
per request, `slot_ids[i]` (its `seq_lens[i]` logical slots) laid page-aligned over its
pages, position `j` at offset `j % page_size` of its `j // page_size`-th page, as
`DeviceKVPool.slot_ids` lays them; and `seq_lens` / `extend_lens`. From them `plan`
derives the pages to gather (every page holding a prefix token, in logical order of first
appearance over the batch) and the pages that hold only this pass's new tokens (staged,
never gathered).

New tokens. The model writes a layer's new K/V (`set_kv`) after `before_attention`, and
reads them back in the same layer. `set_kv` writes the owned slots to the pool and stages
every slot of the batch into the scratch buffer, so attention reads the new tokens on every
rank. It therefore expects the same `set_kv` calls on every CP rank (every rank has the
chunk's K/V, as with replicated compute); a split prefill must all-gather the chunk's K/V
before writing them.

Double buffer. The scratch is `num_buffers` alternating buffers, layer `l` in buffer
`l % num_buffers`. With two, `before_attention(l)` waits for layer `l`'s gather and then
starts layer `l + 1`'s (an asynchronous all-gather, `async_op=True`, which gloo and nccl
both run off the caller's thread/stream) into the other buffer, so it runs while layer
`l` attends; by then that buffer's previous layer (`l - 1`) has been read. With one buffer
each gather runs when its layer starts (the no-overlap baseline). `prefetch(layer, batch)`
starts a gather early (e.g. layer 0 of the next batch once the current pass has finished
with that buffer). Every gather is consumed by exactly one `before_attention`.

Transport (`--cp-gather-transport`). `collective` is the all-gather above. `shm` (what
`auto` picks on CPU when every CP rank is a process on this host, as `engine/rank.py`
spawns them; GPUs keep the collective) is the CPU analogue of peer-to-peer reads over
NVLink: every rank's rows live in one shared-memory file (`memory/shm_rows.py`, each rank's
region writable by it alone, the whole file mapped read-only by every rank), and `get_kv`
reads a layer's K/V of any logical slots straight from their owners' rows: one
`index_select` over every rank's rows (`SharedRows.flat`), the one copy a replicated pool's
read makes. Nothing is packed and no scratch buffer is used; `set_kv` keeps the pass's new
K/V of the layer (`PeerReads.stage`), which `get_kv` puts over the rows it read for this
pass's new slots (an owner may be writing those rows now). Instead of a collective per
layer, two barriers per pass that reads a peer's pages (a plan with `chunk_pages > 0`; none
for a cold prefill), taken on every rank at the same calls (they depend only on the batch,
like the all-gathers): one in the pass's first `before_attention`, one in `after_layers`.
Why a read of a peer's rows is sound:
- the owner wrote the page before: a prefix page's rows were written by passes (or loads)
  that came before this pass on its owner. `PeerReads.open`, before the pass's first read,
  waits for this rank's loads into the plan's pages (every layer: `wait_layer`) and then
  holds a barrier: past it, every owner has finished its earlier passes and its loads into
  those pages. The step's own agreement does not order it (a steady decode step has no
  collective: rank 0 sends its commands without waiting). New tokens of this pass are
  taken from the rank's own staged K/V, never from a peer's rows; an owner writing this
  pass's new slots of a page a peer reads (the page of a prefix's last, partial page)
  changes rows whose values the peer replaces with its staged ones.
- host loads: a load in flight is waited for by its owner before the barrier (the host
  tier's `wait_layer` waits for its copy), so restore -> read -> attend holds for every
  owner's loads, even for a read started before the load's ACK is consumed (the
  scheduler today consumes a batch's loads before it runs it, and the agreement that
  consumes them is after every rank's copy ended).
- eviction and reuse: a page of a running batch's prefix is locked by its request (the
  tree and the request table are identical on every rank), so its owner cannot evict it
  during the pass; `PeerReads.close`, in `after_layers` (after the pass's last read, the
  last layer's attention), holds a barrier, so no owner goes on to the next step (frees the
  page, reuses it, loads into it) while a peer still reads it. A pass that stopped before
  its last layer is closed by the next plan's first `before_attention`.

Memory: `device_bytes()` is the owned rows plus one scratch page for the writes a rank
drops; `scratch_bytes()` is every buffer's current size (buffers grow to the largest plan
and stay), `scratch_bytes_for(plan)` what a plan needs: the scheduler counts both buffers
before it admits a batch. The engine uses it with `--enable-kv-cache-sharding` (each CP
rank of each TP rank and stage holds its share of its own heads and layers); the host tier
(`PoolGroup.local_pairs`) and P/D (`scheduler/pd_pages.py`) move its local pages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from gpu_worker.kernels.cp_gather import gather_map, pack_owned
from gpu_worker.kernels.page_transfer import PageView
from gpu_worker.memory.allocator import PageAllocator, PageId
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.memory.peer_reads import PeerReads
from gpu_worker.memory.shm_rows import SharedRows, share_rows
from gpu_worker.parallel.config import CP_GATHER_TRANSPORTS
from gpu_worker.parallel.cp_layout import CPLayout


class AttendedBatch(Protocol):
    """What the gather reads of a batch: `model.forward_batch.ForwardBatch` has it (the
    pools sit below the model, so they name the fields rather than import it)."""

    @property
    def seq_lens(self) -> list[int]: ...  # per request: prefix + new tokens

    @property
    def extend_lens(self) -> list[int]: ...  # per request: new tokens of this pass

    @property
    def slot_ids(self) -> list[torch.Tensor]: ...  # per request: (seq_len,) int64, page-aligned


@dataclass(frozen=True, slots=True, eq=False)
class CPGatherPlan:
    """Where each logical page of one batch sits in a layer's scratch buffer.

    A scratch buffer is `num_scratch_pages` pages of `(num_kv, page_size, num_kv_heads,
    head_dim)`: the gathered pages (`cp_size` chunks of `chunk_pages`, rank 0's first),
    then the staged pages, then one trash page that takes the writes of slots outside the
    plan. The same on every rank for the same batch.
    """

    gather_page_ids: torch.Tensor  # (n,) int64: prefix pages, logical order
    gathered: torch.Tensor  # (n,) int64: their scratch pages (`cp_gather.gather_map`)
    chunk_pages: int  # M: the most prefix pages one rank owns
    cp_size: int
    num_staged: int  # pages holding only new tokens, scratch pages N*M .. N*M+num_staged-1
    page_to_scratch: torch.Tensor  # (num_pages,) int64: scratch page of each logical page, or -1

    @property
    def num_gathered_pages(self) -> int:
        return self.cp_size * self.chunk_pages

    @property
    def trash_page(self) -> int:
        return self.num_gathered_pages + self.num_staged

    @property
    def num_scratch_pages(self) -> int:
        return self.trash_page + 1


@dataclass(slots=True)
class _Buffer:
    """One scratch buffer and the gather it holds."""

    data: torch.Tensor  # (capacity elements,): pages of the plan at the front
    layer: int = -1  # the layer gathered into it, -1 for none
    plan: CPGatherPlan | None = None
    work: dist.Work | None = None  # the all-gather still in flight
    consumed: bool = True  # a before_attention has taken this gather


class ShardedDeviceKVPool:
    """One CP rank's share of a `num_pages`-page logical device pool (the `KVCache`
    protocol of `model/forward_batch.py`, like `DeviceKVPool`).

    `kv` is (num_layers, num_kv, (ceil(num_pages / N) + 1) * page_size, num_kv_heads,
    head_dim): the owned rows at `CPLayout.local_rows`, then one trash page. `group` is the
    CP group (None only at cp_size 1); `allocator` hands out logical pages by owner class.
    `wait_layer(layer, page_ids)`, if given, runs before a layer's pages are packed, with
    the plan's (n,) int64 logical pages: where a host load of them must land first
    (restore -> gather -> attend; with shm, for every layer before the pass's first read).
    `transport`: `--cp-gather-transport`, resolved (a collective once) to `self.transport`,
    "collective" or "shm" (see the module doc). `poison` (tests): the
    rows start as NaN and each gather's buffer is NaN before it fills, so a read of a row
    no rank wrote, or of a stale gather, shows in the logits.
    """

    contiguous_slices = False  # logical slots are not rows of `kv`: no in-place runs

    def __init__(
        self,
        spec: KVSpec,
        num_pages: int,
        device: torch.device,
        cp_rank: int,
        cp_size: int,
        group: dist.ProcessGroup | None,
        num_buffers: int = 2,
        *,
        backend: str = "auto",
        check_reads: bool = False,
        wait_layer: Callable[[int, torch.Tensor], None] | None = None,
        poison: bool = False,
        transport: str = "auto",
    ) -> None:
        if not 0 <= cp_rank < cp_size or (group is None and cp_size > 1) or num_buffers < 1:
            raise ValueError(f"bad CP rank {cp_rank} of {cp_size}, group {group}, buffers")
        if transport not in CP_GATHER_TRANSPORTS:
            raise ValueError(
                f"--cp-gather-transport must be one of {', '.join(CP_GATHER_TRANSPORTS)}, "
                f"not {transport!r}"
            )
        if transport == "shm" and device.type != "cpu":
            raise ValueError(
                f"--cp-gather-transport shm maps CPU ranks' rows; {device} ranks gather "
                "with the collective"
            )
        self.spec = spec
        self.device = device
        self.num_pages = num_pages
        self.layout = CPLayout(spec.page_size, cp_size)
        self.cp_rank, self.cp_size, self.group = cp_rank, cp_size, group
        self.allocator = PageAllocator(num_pages, "device", num_owners=cp_size)
        self.num_local_pages = self.layout.num_local_pages(num_pages)
        num_rows = (self.num_local_pages + 1) * spec.page_size
        self.poison = poison and spec.dtype.is_floating_point
        shape = (spec.num_layers, spec.num_kv, num_rows, spec.num_kv_heads, spec.head_dim)
        self._peers: SharedRows | None = None  # transport shm: every rank's rows, mapped
        if cp_size > 1 and transport != "collective" and device.type == "cpu":
            assert group is not None
            self._peers = share_rows(shape, spec.dtype, cp_rank, cp_size, group, transport == "shm")
        self.transport = "collective" if self._peers is None else "shm"
        if self._peers is None:
            self.kv = torch.empty(shape, dtype=spec.dtype, device=device)
        else:
            self.kv = self._peers.rows[cp_rank]
        self.kv.fill_(float("nan") if self.poison else 0)
        self.backend = backend
        self.check_reads = check_reads
        self.wait_layer = wait_layer
        empty = torch.empty(0, dtype=spec.dtype, device=device)
        self._buffers = [_Buffer(empty) for _ in range(num_buffers)]
        self._batch: AttendedBatch | None = None
        self._plan: CPGatherPlan | None = None
        self._peer_reads = None if self._peers is None else PeerReads(self, self._peers)

    # -- KVCache protocol (the model's view)

    def before_attention(self, layer: int, batch: AttendedBatch) -> None:
        """Gather `layer`'s pages of `batch` (or finish its prefetched gather), then start
        the next layer's gather into the other buffer."""
        plan = self.plan(batch)
        if self._peer_reads is not None:
            self._peer_reads.begin(plan)
            return
        buf = self._buffers[layer % len(self._buffers)]
        if buf.consumed or buf.layer != layer or buf.plan is not plan:
            self._start(layer, plan)
        _finish(buf)
        buf.consumed = True
        if len(self._buffers) > 1 and layer + 1 < self.spec.num_layers:
            self.prefetch(layer + 1, batch)

    def prefetch(self, layer: int, batch: AttendedBatch) -> None:
        """Start `layer`'s gather of `batch` into its buffer unless it is already there
        unconsumed. The buffer's previous layer must be done with (read by its attention).
        Nothing to start with transport shm (attention reads the owners' rows)."""
        if self._peer_reads is not None:
            return
        plan = self.plan(batch)
        buf = self._buffers[layer % len(self._buffers)]
        if buf.consumed or buf.layer != layer or buf.plan is not plan:
            self._start(layer, plan)

    def set_kv(self, layer: int, slot_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the owned slots' K/V to the pool and stage every slot of the layer's plan."""
        rows = self._local_rows(slot_ids)
        self.kv[layer, 0, rows] = k
        self.kv[layer, 1, rows] = v
        if self._peer_reads is not None:
            self._peer_reads.stage(layer, slot_ids, (k, v))
            return
        staged = self._scratch_rows(layer, slot_ids, for_write=True)
        if staged is not None:
            rows, flat = staged
            flat[rows] = k
            flat[rows + self.spec.page_size] = v

    def get_kv(self, layer: int, slot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of logical slots from `layer`'s gathered buffer (transport shm: from their
        owners' rows): (n, num_kv_heads, head_dim)."""
        if self._peer_reads is not None:
            k, v = self._peer_reads.read(layer, slot_ids, 2)
            return k, v
        rows, flat = _gathered(self._scratch_rows(layer, slot_ids, for_write=False), layer)
        return flat.index_select(0, rows), flat.index_select(0, rows + self.spec.page_size)

    def kv_slice(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("a sharded pool has no in-place slices (contiguous_slices is False)")

    def set_latent(self, layer: int, slot_ids: torch.Tensor, latent: torch.Tensor) -> None:
        self.kv[layer, 0, self._local_rows(slot_ids)] = latent
        if self._peer_reads is not None:
            self._peer_reads.stage(layer, slot_ids, (latent,))
            return
        staged = self._scratch_rows(layer, slot_ids, for_write=True)
        if staged is not None:
            rows, flat = staged
            flat[rows] = latent

    def get_latent(self, layer: int, slot_ids: torch.Tensor) -> torch.Tensor:
        if self._peer_reads is not None:
            return self._peer_reads.read(layer, slot_ids, 1)[0]
        rows, flat = _gathered(self._scratch_rows(layer, slot_ids, for_write=False), layer)
        return flat.index_select(0, rows)  # (n, 1, latent_dim)

    def after_layers(self, batch: AttendedBatch) -> None:
        """The pass's last layer has attended: transport shm ends its reads of peers' rows
        (a barrier, see the module doc); nothing to do for the all-gather."""
        if self._peer_reads is not None and self._peer_reads.reading is not None:
            self._peer_reads.close()

    # -- the plan and memory

    def plan(self, batch: AttendedBatch) -> CPGatherPlan:
        """The gather plan of `batch`, built once per batch object (the same on every rank:
        it depends only on the batch). One host sync per batch on CUDA."""
        if batch is self._batch and self._plan is not None:
            return self._plan
        self._plan = build_plan(batch, self.layout, self.num_pages, self.device, self.backend)
        self._batch = batch
        return self._plan

    def scratch_bytes_for(self, plan: CPGatherPlan) -> int:
        """Bytes of every scratch buffer sized for `plan` (what admitting its batch needs)."""
        return len(self._buffers) * plan.num_scratch_pages * self._page_block_bytes()

    def scratch_bytes(self) -> int:
        """Bytes the scratch buffers hold now (each grows to the largest plan it served)."""
        return sum(b.data.numel() * b.data.element_size() for b in self._buffers)

    def device_bytes(self) -> int:
        """Bytes of this rank's KV rows (owned rows plus the trash page), scratch excluded."""
        return self.kv.numel() * self.kv.element_size()

    def local_page_view(self) -> PageView:
        """The pool's local pages (trash page included) for page copies: local page `j` is
        logical page `CPLayout.logical_page(j, cp_rank)`."""
        return PageView.layer_first(self.kv, self.spec.page_size)

    def slot_ids(self, page_ids: list[PageId], num_tokens: int) -> torch.Tensor:
        """Logical slots of positions `[0, num_tokens)` over `page_ids` (as `DeviceKVPool`)."""
        ps = self.spec.page_size
        pages = torch.tensor(page_ids, dtype=torch.int64, device=self.device)
        offsets = torch.arange(ps, dtype=torch.int64, device=self.device)
        return (pages[:, None] * ps + offsets).flatten()[:num_tokens]  # (num_tokens,)

    # -- internals

    def _page_block_bytes(self) -> int:
        s = self.spec
        return s.num_kv * s.page_numel * self.kv.element_size()

    def _start(self, layer: int, plan: CPGatherPlan) -> None:
        """Pack this rank's pages of `layer` into its chunk of the layer's buffer and start
        the all-gather of the chunks (asynchronous; `_finish` waits)."""
        buf = self._buffers[layer % len(self._buffers)]
        _finish(buf)  # a gather still in flight into this buffer lands before it is reused
        s = self.spec
        page_shape = (s.num_kv, s.page_size, s.num_kv_heads, s.head_dim)
        numel = plan.num_scratch_pages * s.num_kv * s.page_numel
        if buf.data.numel() < numel:  # grow; NaN so that a stray read shows in the logits
            fill = float("nan") if s.dtype.is_floating_point else 0
            buf.data = torch.full((numel,), fill, dtype=s.dtype, device=self.device)
        pages = buf.data[:numel].view(plan.num_scratch_pages, *page_shape)
        if self.poison:
            pages.fill_(float("nan"))
        m, rank = plan.chunk_pages, self.cp_rank
        buf.work = None
        buf.layer, buf.plan, buf.consumed = layer, plan, False
        send = pages[rank * m : (rank + 1) * m]  # (M, num_kv, p, H, D): this rank's chunk
        if self.wait_layer is not None:
            self.wait_layer(layer, plan.gather_page_ids)
        pack_owned(
            self.kv,
            layer,
            s.page_size,
            plan.gather_page_ids,
            plan.gathered,
            rank,
            self.cp_size,
            send,
            self.backend,
            validate=False,  # checked by build_plan against this pool's size
        )
        if self.cp_size > 1 and m > 0:
            # bytes, bit-exact and a dtype every backend moves (gloo has no int16)
            out = pages[: plan.num_gathered_pages].view(-1).view(torch.uint8)
            buf.work = dist.all_gather_single(
                out, send.reshape(-1).view(torch.uint8), group=self.group, async_op=True
            )

    def _local_rows(self, slot_ids: torch.Tensor) -> torch.Tensor:
        """Pool rows of `slot_ids`: owned slots at their local rows, the rest in the trash
        page (a write a rank drops, without a data-dependent mask)."""
        owned = self.layout.owned_mask(slot_ids, self.cp_rank)
        trash = self.num_local_pages * self.spec.page_size + slot_ids % self.spec.page_size
        return torch.where(owned, self.layout.local_rows(slot_ids), trash)

    def _scratch_rows(
        self, layer: int, slot_ids: torch.Tensor, for_write: bool
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K rows (V is `page_size` rows further) of `slot_ids` in `layer`'s buffer, and the
        buffer as (rows, num_kv_heads, head_dim); None when the buffer does not hold the
        layer. A slot outside the plan goes to the trash page when writing."""
        buf = self._buffers[layer % len(self._buffers)]
        plan = buf.plan
        if buf.layer != layer or plan is None:
            return None
        _finish(buf)
        p, s = self.spec.page_size, self.spec
        page = plan.page_to_scratch[torch.div(slot_ids, p, rounding_mode="floor")]
        if for_write:
            page = torch.where(page >= 0, page, plan.trash_page)
        elif self.check_reads and bool((page < 0).any()):
            raise RuntimeError(f"layer {layer}: a slot outside the gathered pages was read")
        numel = plan.num_scratch_pages * s.num_kv * s.page_numel
        flat = buf.data[:numel].view(-1, s.num_kv_heads, s.head_dim)
        return page * (s.num_kv * p) + slot_ids % p, flat

    def scratch_pages_within(self, budget_bytes: int) -> int:
        """The most scratch pages (`CPGatherPlan.num_scratch_pages`) a plan may have for
        every buffer sized for it to fit `budget_bytes`: what admission holds a batch to
        (`scheduler/gather_budget.py`). The same on every rank of a world: a page block is
        one layer's K/V of a page, and every TP rank holds as many heads, every stage
        layers of one shape."""
        return budget_bytes // (len(self._buffers) * self._page_block_bytes())


def _gathered(
    rows: tuple[torch.Tensor, torch.Tensor] | None, layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_scratch_rows` of a read: the layer must have been gathered."""
    if rows is None:
        raise RuntimeError(f"layer {layer} was read before before_attention gathered it")
    return rows


def _finish(buf: _Buffer) -> None:
    """Wait for the buffer's all-gather, if one is in flight."""
    if buf.work is not None:
        buf.work.wait()
        buf.work = None


def build_plan(
    batch: AttendedBatch, layout: CPLayout, num_pages: int, device: torch.device, backend: str
) -> CPGatherPlan:
    """The gather plan of `batch` (see `CPGatherPlan` and the module doc)."""
    p = layout.page_size
    # the slot of each page's first position, for every request: one host copy
    firsts = torch.cat([s[::p] for s in batch.slot_ids]).tolist() if batch.slot_ids else []
    if any(x % p for x in firsts):
        raise ValueError("CP sharding needs page-aligned slot_ids")
    prefix: dict[int, None] = {}  # ordered sets: logical order of first appearance
    new: dict[int, None] = {}
    start = 0
    for seq_len, extend_len in zip(batch.seq_lens, batch.extend_lens, strict=True):
        pages = [x // p for x in firsts[start : start + -(-seq_len // p)]]
        start += len(pages)
        num_prefix = -(-(seq_len - extend_len) // p)  # pages holding a prefix token
        prefix.update(dict.fromkeys(pages[:num_prefix]))
        new.update(dict.fromkeys(pages[num_prefix:]))
    gather_ids = list(prefix)
    staged_ids = [q for q in new if q not in prefix]
    if any(not 0 <= q < num_pages for q in gather_ids + staged_ids):
        raise ValueError(f"batch slots outside the pool's {num_pages} pages")
    m = layout.max_owned(gather_ids) if gather_ids else 0
    ids = torch.tensor(gather_ids, dtype=torch.int64, device=device)
    gathered = gather_map(ids, layout.cp_size, m, backend)
    page_to_scratch = torch.full((num_pages,), -1, dtype=torch.int64, device=device)
    page_to_scratch[ids] = gathered
    first_staged = layout.cp_size * m
    staged = torch.tensor(staged_ids, dtype=torch.int64, device=device)
    page_to_scratch[staged] = torch.arange(len(staged_ids), device=device) + first_staged
    return CPGatherPlan(ids, gathered, m, layout.cp_size, len(staged_ids), page_to_scratch)
