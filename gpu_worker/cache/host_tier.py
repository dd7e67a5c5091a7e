"""The host tier of one rank's cache: host pages, and the copies between the tiers.

`HostTier` owns the pool group's host pools (through `PoolGroup.attach_host`) and the
transfer engine. A backup copies a tree path's device pages to host pages, a load copies a
match's host pages back to device pages; each moves every member of the pool group in one
transfer with one ACK, and the tree changes only when `consume` pops that ACK, in order.
Which nodes to back up and when (the write policies) is the `PrefixCache`'s decision.

It is the storage tier's `HostPages` (`host_pages.py`): prefetches take their host pages
here. Driven from the scheduler thread only.

Context parallelism: host page ids have owner classes like device page ids, and the host
pages of a path continue its owner cycle (`_alloc_host` and `alloc_host_upto` take the path
position of the first page): page k of a path, on either tier, belongs to CP rank k % N.
So a backup's device page and its host page have one owner, as do a load's host page and
the device page `PrefixCache.alloc` gives it; with a sharded pool each rank copies only the
pairs it owns, local rows to local rows (`PoolGroup.local_pairs`), but every rank submits
every copy (maybe of no page) and consumes its ACK, so ACK counts stay agreed. A sharded
pool's gather of a layer first waits for this rank's loads in flight into the pages it
packs (restore -> gather -> attend, `PoolGroup.wait_for_restores`). Today a batch's own
loads are consumed before it is admitted, so this orders what the scheduler already does
(and costs a look at the queue); a scheduler that admitted a batch with its restore still
running would get the order from it as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gpu_worker.cache.load_cost import LoadCostEstimate, LoadCostModel
from gpu_worker.cache.radix import MatchResult, RadixTree, TreeNode
from gpu_worker.cache.stats import CacheStats
from gpu_worker.cache.transfer import TransferAck, TransferEngine, TransferKind
from gpu_worker.consensus.checker import rank_consensus
from gpu_worker.memory.allocator import HostPageId, PageAllocator, PageId
from gpu_worker.memory.host_pool import HostKVPool
from gpu_worker.memory.pool_group import PoolGroup

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadTicket:
    """A load-back of a request's host hit; `done` flips when its ACK is consumed."""

    last_node: TreeNode  # end of the host range being loaded
    start_len: int  # the range is tokens [start_len, path end) of last_node's path
    page_ids: list[PageId]  # device pages receiving it
    done: bool = False
    failed: bool = False  # the copy failed: the pages stay the request's, uncommitted


@dataclass(frozen=True, slots=True)
class _BackupOp:
    last_node: TreeNode
    start_len: int
    host_page_ids: list[HostPageId]


class HostTier:
    """See the module docstring."""

    def __init__(
        self,
        pools: PoolGroup,
        tree: RadixTree,
        transfers: TransferEngine,
        stats: CacheStats,
        cost: LoadCostModel,
        estimate: Callable[[], LoadCostEstimate],
        fail_loads: int = 0,
    ) -> None:
        """`pools`: the group, its host pools attached; `stats`: the cache's counters (one object
        for the cache's life); `cost`: the load measurements to feed; `estimate`: the load
        cost every rank decides from, as the cache holds it now; `fail_loads`: a test hook,
        the next N loads fail."""
        if pools.host is None:
            raise ValueError("the host tier needs the group's host pools (attach_host)")
        self.pools = pools
        self.pool: HostKVPool = pools.host  # the target's
        self.tree = tree
        self.transfers = transfers
        self.stats = stats
        self.cost = cost
        self._estimate = estimate
        self._loads_to_fail = fail_loads
        pools.wait_for_restores(self._restore_before_gather)
        # told of every backup its ACK committed (the path to the node is on the host now):
        # the storage tier's write policy, once there is one
        self.after_backup: Callable[[TreeNode], None] | None = None

    @property
    def cost_estimate(self) -> LoadCostEstimate:
        return self._estimate()

    @property
    def num_queued_acks(self) -> int:
        return len(self.transfers)

    def num_ready_acks(self) -> int:
        return self.transfers.num_ready()

    # ----------------------------------------------------------------- host pages

    def alloc_host_upto(self, num_pages: int, start_page: int = 0) -> list[HostPageId]:
        """Up to `num_pages` host pages for a path's pages `start_page, ...` (on its owner
        cycle), evicting unpinned host cache for them: fewer (maybe none) when the pool
        cannot free that many."""
        allocator, first = self._make_room(num_pages, start_page)
        pages = allocator.alloc_run(allocator.run_fit(num_pages, first), first) or []
        return [HostPageId(p) for p in pages]

    def free_host(self, page_ids: Sequence[int]) -> None:
        if page_ids:
            self.pool.allocator.free(list(page_ids))

    def _alloc_host(self, num_pages: int, start_page: int) -> list[HostPageId] | None:
        allocator, first = self._make_room(num_pages, start_page)
        pages = allocator.alloc_run(num_pages, first)
        return None if pages is None else [HostPageId(p) for p in pages]

    def _make_room(self, num_pages: int, start_page: int) -> tuple[PageAllocator, int]:
        """The host allocator and the owner class of path page `start_page`, after evicting
        unpinned host cache until a run of `num_pages` from there fits (or nothing more can
        be evicted: eviction frees least recently used pages of any class)."""
        allocator = self.pool.allocator
        first = start_page % allocator.num_owners
        short = allocator.shortfall(num_pages, first)
        while short > 0:
            evicted = self.tree.tiers.evict_host(short)
            allocator.free(list(evicted))
            self.stats.evicted_host_pages += len(evicted)
            if not evicted or allocator.num_owners == 1:
                break
            short = allocator.shortfall(num_pages, first)
        return allocator, first

    # ----------------------------------------------------------------- copies

    @rank_consensus(same_params=["node.id"], same_results=["result"])
    def backup(self, node: TreeNode) -> bool:
        """Start backing up the path to `node` from where its host coverage ends."""
        start = node.host_covered_len()
        nodes = node.path_range(start)
        if not nodes:
            return False
        device_ids = [p for _, n in nodes for p in (n.device_page_ids or [])]
        # Pin the covered prefix while making room: evicting it would leave a gap above the
        # pages about to be backed up (the host set must stay prefix-closed).
        self.tree.tiers.ref_host(node)
        host_ids = self._alloc_host(len(device_ids), start // self.tree.page_size)
        self.tree.tiers.unref_host(node)
        if host_ids is None:
            return False
        self.tree.tiers.mark_backup_pending(node, start)
        self.tree.tiers.lock(node)  # the device copy must outlive the copy
        op = _BackupOp(node, start, host_ids)
        views = [pair.backup() for pair in self.pools.tier_views()]
        src, dst = self.pools.local_pairs(device_ids, host_ids)
        self.transfers.submit(TransferKind.BACKUP, views, src, dst, op)
        self.stats.num_backups += 1
        self.stats.backed_up_pages += len(device_ids)
        return True

    def load(self, match: MatchResult, pages: list[PageId]) -> LoadTicket:
        """Start loading `match`'s host part into device `pages` (the caller took them and
        pinned the host range with `ref_host`; the ACK unpins it)."""
        ticket = LoadTicket(match.last_node, match.device_len, pages)
        self.pools.mark_loading(pages, True)
        fail = self._loads_to_fail > 0
        self._loads_to_fail -= int(fail)
        views = [pair.load() for pair in self.pools.tier_views()]
        dst, src = self.pools.local_pairs(pages, match.host_page_ids)
        self.transfers.submit(TransferKind.LOAD, views, src, dst, ticket, inject_failure=fail)
        self.stats.num_loads += 1
        self.stats.loaded_pages += len(pages)
        return ticket

    def _restore_before_gather(self, layer: int, page_ids: torch.Tensor) -> None:
        """A sharded pool is about to pack `layer`'s rows of logical pages `page_ids`
        ((n,) int64): wait for this rank's loads in flight into any of them. Loads of other
        pages (requests still waiting for theirs) go on while the batch runs."""
        loads = self.transfers.in_flight(TransferKind.LOAD)
        if not loads:
            return
        pages = set(page_ids.tolist())
        for ack in loads:
            ticket = ack.op
            assert isinstance(ticket, LoadTicket)
            if not pages.isdisjoint(ticket.page_ids):
                self.transfers.wait_copy(ack)

    # ----------------------------------------------------------------- ACKs

    def consume(self, num_acks: int) -> None:
        """Apply the first `num_acks` queued ACKs, in order (waiting for unfinished ones)."""
        if num_acks == 0:
            return
        for ack in self.transfers.pop(num_acks):
            self._apply(ack)

    def _apply(self, ack: TransferAck) -> None:
        """Commit one consumed ACK; a failed copy changes nothing but releases its pins."""
        self.stats.consumed_acks.append(ack.seq)
        self.stats.num_consumed_acks += 1
        error = ack.completion.wait()
        if error is not None:
            log.warning("%s transfer %d failed: %r", ack.kind.value, ack.seq, error)
        if ack.kind is TransferKind.BACKUP:
            op = ack.op
            assert isinstance(op, _BackupOp)
            if error is None:
                self.tree.tiers.commit_backup(op.last_node, op.start_len, op.host_page_ids)
                if self.after_backup is not None:
                    self.after_backup(op.last_node)
            else:
                self.tree.tiers.abort_backup(op.last_node, op.start_len)
                self.pool.allocator.free(list(op.host_page_ids))
            self.tree.tiers.unlock(op.last_node)
            return
        ticket = ack.op
        assert isinstance(ticket, LoadTicket)
        self.pools.mark_loading(ticket.page_ids, False)
        if error is None:
            freed = self.tree.tiers.commit_load(ticket.last_node, ticket.start_len, ticket.page_ids)
            self.pools.device.allocator.free(list(freed))
            seconds = ack.completion.seconds()
            if seconds is not None:  # every rank copies its share at once: the whole load's
                num_bytes = len(ticket.page_ids) * self.pools.bytes_per_page
                self.cost.observe_load(num_bytes, seconds)
        else:
            ticket.failed = True  # the requester keeps the pages and computes instead
        self.tree.tiers.unref_host(ticket.last_node)
        ticket.done = True
