"""The storage tier (L3) of one rank's cache: prefetch into host pages, and backups to it.

DESIGN.md section 3 and the article's section on L3 under PP. Everything here runs on the
scheduler thread and changes state only when an agreed number of storage ACKs is consumed
(`StorageIO`'s queues), or when a command every rank applies says so, so all ranks take the
same decisions at the same logical points.

Prefetch of a request (`start` when it is added, before admission):
1. Its prompt's pages past the deepest host-covered node of its path (the node is pinned
   with `ref_host` until the request is admitted) up to the last whole page before its last
   token are named by their chained page hashes (which cover the model, dtype, page size
   and the request's cache_salt) plus this rank's shard (`object_key`); a hit query asks
   the store how many leading objects it holds, MIN over every rank.
2. Consuming that HIT ACK queues the prefetch for host pages (`grant`, once per step, first
   come first served). The budget: prefetches hold at most half the host pool
   (`budget_pages`, as SGLang stops prefetching past about half), counting each page from
   its grant until its request is admitted or leaves, so the reads of queued requests never
   crowd the tree out. The head of the queue waits until the budget has room for its whole
   hit (capped at the budget), then makes room by evicting unpinned host pages, least
   recently used first. Where pins leave too few, it keeps what it got and waits while
   those pins clear by themselves (copies in flight, requests ahead being admitted), else
   falls back to the shorter page-aligned prefix it has, and starts the read. With
   `--hicache-load-policy cost` a hit whose read would be slower than recomputing it (rank
   0's measured figures, broadcast) is not read.
3. Each PROGRESS ACK consumed gives the agreed pages read so far.
4. The request may be admitted when its prefetch is done, or earlier as the policy says:
   `wait_complete` waits for every batch; `best_effort` takes what was read when the request
   reaches admission; `timeout` waits until its deadline (a base plus a per-1K-tokens term,
   capped, from the read's start: a slow store is cut, a wait for host room is not), which
   rank 0 alone reads off its clock and turns into a `StopPrefetch` command.
   Then `finish` attaches the pages read into the tree as host pages (`insert_host`) and
   keeps them pinned until `release` (the request was admitted: its load holds them now, or
   it left), so a request that must still wait for device room does not lose them to other
   prefetches' evictions. Pages granted but not read are freed once the read's last ACK is
   consumed (the I/O thread may still write them until then).

Every decision above reads replicated state only (agreed ACK counts, the tree, the budget
count, rank 0's verdicts applied as commands), so all ranks grant, evict and fall back alike.

Backups to the store are `StorageWrites`' (`storage_writes.py`); this tier owns it and hands
it the WRITE ACKs.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from bus_schemas.page_hash import chain_hashes
from bus_schemas.token_ids import TokenIds
from gpu_worker.cache.host_pages import HostPages
from gpu_worker.cache.radix import RadixTree, TreeNode
from gpu_worker.cache.storage_io import ReadOp, StorageAck, StorageIO
from gpu_worker.cache.storage_writes import StorageWritePolicy, StorageWrites
from gpu_worker.consensus.checker import rank_consensus
from gpu_worker.memory.allocator import HostPageId

log = logging.getLogger(__name__)

PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]
PREFETCH_POLICIES: tuple[PrefetchPolicy, ...] = ("best_effort", "wait_complete", "timeout")
# grant attempts (one a step) in a row that may free nothing before a grant stops waiting for
# pins to clear and reads the shorter prefix it has: copies in flight finish within a step
# or two, while pins that never clear (those of requests behind it) must not starve it
GRANT_PATIENCE = 8


@dataclass(frozen=True, slots=True)
class PrefetchTimeout:
    """The `timeout` policy's deadline: base + per 1K tokens to fetch, capped."""

    base_s: float = 0.5
    per_ki_token_s: float = 0.25
    max_s: float = 10.0

    def deadline_s(self, num_tokens: int) -> float:
        return min(self.base_s + self.per_ki_token_s * num_tokens / 1024, self.max_s)


@dataclass(eq=False, slots=True)
class Prefetch:
    """One request's prefetch. The scheduler holds it on the request until `finished`."""

    rid: int
    ids: TokenIds  # the prompt's whole pages before its last token
    salt: str
    start_node: TreeNode  # host-covered end of the path when it started (pinned)
    start_len: int
    keys: list[str]  # the objects of the pages from start_len on (`per_page` each)
    num_pages: int  # pages asked for
    hit_pages: int | None = None  # agreed, once the HIT ACK is consumed
    # when its read started, on this rank's clock: only the timeout policy reads it, only
    # on rank 0 (a prefetch waiting for room is not late: the store has not been asked yet)
    read_started_at: float | None = None
    awaiting_room: bool = False  # hit agreed, queued for a grant under the budget
    stalled_grants: int = 0  # grant attempts in a row that got no page
    host_page_ids: list[HostPageId] = field(default_factory=list)  # granted for the read
    attached_pages: int = 0  # pages `finish` put into the tree, held until `release`
    pin_node: TreeNode | None = None  # end of what `finish` attached, pinned until `release`
    read: ReadOp | None = None
    batches_left: int = 0  # PROGRESS ACKs not consumed yet
    completed_pages: int = 0  # agreed pages read, from the last PROGRESS ACK consumed
    stopped: bool = False  # take what was read (a verdict, or the request left)
    taken_pages: int | None = None  # pages read when a verdict stopped it: what it takes
    finished: bool = False  # what was read is in the tree; the request may be admitted
    storage_used: int = 0  # pages read and offered to the tree at `finish`
    storage_range: tuple[int, int] = (0, 0)  # tokens [a, b) the tree got from storage

    @property
    def complete(self) -> bool:
        """Nothing more will arrive: no hit, or every batch's ACK consumed."""
        return self.hit_pages is not None and not self.awaiting_room and self.batches_left == 0


class StorageTier:
    """See the module docstring. Owned by a `PrefixCache` with a host tier."""

    def __init__(
        self,
        host: HostPages,
        tree: RadixTree,
        io: StorageIO,
        scope: str,
        policy: PrefetchPolicy,
        timeout: PrefetchTimeout,
        write_policy: StorageWritePolicy,
        write_threshold: int,
        batch_pages: int,
        num_host_pages: int,
        read_by_cost: bool,
    ) -> None:
        """`host`: the owning cache's host pages (reads are granted from them); `tree`: its
        radix tree, which the reads join; `num_host_pages`: the host pool's size (the grant
        budget is half of it); `read_by_cost`: skip hits slower to read than to recompute
        (`--hicache-load-policy cost`)."""
        self.host = host
        self.tree = tree
        self.page_size = tree.page_size
        self.num_host_pages = num_host_pages
        self.read_by_cost = read_by_cost
        self.io = io
        self.scope = scope
        self.policy = policy
        self.timeout = timeout
        self.batch_pages = batch_pages
        self.writes = StorageWrites(host, tree, io, write_policy, write_threshold)
        self.prefetches: dict[int, Prefetch] = {}  # rid -> not finished, or its read not done
        self.held_pages = 0  # host pages prefetches hold (granted, not yet released or freed)
        self.room_queue: deque[Prefetch] = deque()  # hits waiting for a grant, in start order

    @property
    def budget_pages(self) -> int:
        """Prefetches hold at most this many host pages at once: half the host pool (SGLang
        stops prefetching past about half too), so the tree keeps the other half."""
        return self.num_host_pages // 2

    # ----------------------------------------------------------------- prefetch

    @rank_consensus(same_params=["rid", "len(ids)", "salt"], same_results=["result is None"])
    def start(self, rid: int, ids: TokenIds, salt: str) -> Prefetch | None:
        """Start prefetching what the store may hold of `ids` past the host-covered prefix;
        None when there is nothing to ask for."""
        tree, ps = self.tree, self.page_size
        limit = (len(ids) - 1) // ps * ps  # a request computes at least its last token
        covered = tree.host_prefix(ids[:limit], salt)
        node, start = covered.node, covered.host_len
        if start >= limit or tree.cached_len(ids[:limit], salt) >= limit:
            return None  # every page is held already (on the host, or on the device)
        assert node.page_hashes is not None, "the tree must hash pages to name objects"
        hashes = chain_hashes(node.page_hashes[-1], ids[start:limit], ps)
        p = Prefetch(
            rid,
            ids[:limit],
            salt,
            node,
            start,
            self.io.codec.keys(hashes),
            len(hashes),
        )
        tree.tiers.ref_host(node)
        self.io.query(p.keys, p, start // ps)
        self.prefetches[rid] = p
        self.host.stats.num_prefetches += 1
        return p

    def on_ack(self, ack: StorageAck) -> None:
        """Apply one consumed storage ACK (in its queue's order)."""
        error = ack.future.exception()
        value = 0 if error is not None else ack.future.result()
        if error is not None:
            log.warning("storage %s failed: %r", ack.kind.value, error)
        if isinstance(ack.op, Prefetch):
            if ack.kind.value == "hit":
                self._on_hit(ack.op, value)
            else:
                self._on_progress(ack.op, value)
        else:
            self.writes.on_ack(ack.op, value)

    @rank_consensus(same_params=["p.rid", "agreed"], same_results=["p.awaiting_room"])
    def _on_hit(self, p: Prefetch, agreed: int) -> None:
        """The agreed hit is known: queue it for a grant (`grant`)."""
        p.hit_pages = agreed
        want = agreed
        if (
            want
            and self.read_by_cost
            and not self.host.cost_estimate.worth_reading(want * self.page_size)
        ):
            self.host.stats.storage_reads_skipped += 1
            want = 0
        if want and not (p.stopped or p.finished):
            p.awaiting_room = True
            self.room_queue.append(p)
        else:
            self._maybe_forget(p)

    def grant(self) -> None:
        """Give queued hits their host pages, first come first served, and start their reads
        (the scheduler calls it once per step, on every rank alike).

        The head of the queue takes what the budget allows, evicting unpinned host pages for
        it, and keeps what it got. It waits for the rest while pins that clear by themselves
        hold the pool (`_room_may_come`); otherwise it reads the shorter prefix it has."""
        while self.room_queue:
            p = self.room_queue[0]
            if p.stopped:  # a verdict came first: it takes nothing
                self.room_queue.popleft()
                self._give_back_grant(p)
                continue
            assert p.hit_pages is not None
            want = min(p.hit_pages, self.budget_pages)
            need = want - len(p.host_page_ids)
            if need > self.budget_pages - self.held_pages:
                return  # wait until requests ahead are admitted and release theirs
            first = p.start_len // self.page_size + len(p.host_page_ids)  # path page
            got = self.host.alloc_host_upto(need, first)
            p.host_page_ids += got
            self.held_pages += len(got)
            p.stalled_grants = 0 if got else p.stalled_grants + 1
            if len(p.host_page_ids) < want and self._room_may_come(p):
                return
            self.room_queue.popleft()
            p.awaiting_room = False
            self._start_read(p, want)

    def _room_may_come(self, p: Prefetch) -> bool:
        """Whether host pages pinned now are released without `p`'s request moving: copies
        in flight (loads, backups, writes not yet staged) finish, and the requests ahead,
        whose prefetches hold the rest of the budget, get admitted; and it has not waited
        `GRANT_PATIENCE` attempts in a row for nothing. Replicated counts."""
        return p.stalled_grants < GRANT_PATIENCE and bool(
            self.host.num_queued_acks
            or len(self.io.writes)
            or self.held_pages > len(p.host_page_ids)
        )

    def _give_back_grant(self, p: Prefetch) -> None:
        """A prefetch leaves the queue without reading: the pages it was granted go back."""
        p.awaiting_room = False
        self.host.free_host(p.host_page_ids)
        self.held_pages -= len(p.host_page_ids)
        p.host_page_ids = []

    @rank_consensus(same_params=["p.rid", "want"], same_results=["len(p.host_page_ids)"])
    def _start_read(self, p: Prefetch, want: int) -> None:
        """Read into the pages granted: `want`, or fewer when pins left too few to evict
        (a shorter page-aligned prefix); none at all: the request computes its prompt."""
        n = len(p.host_page_ids)
        if n < want:
            self.host.stats.storage_reads_short += 1
        if not n:
            self._maybe_forget(p)
            return
        k = self.io.codec.per_page
        p.read = ReadOp(p.keys[: n * k], list(p.host_page_ids), self.batch_pages)
        p.batches_left = p.read.num_batches
        p.read_started_at = time.monotonic()
        self.io.read(p.read, p)

    def _on_progress(self, p: Prefetch, agreed: int) -> None:
        p.completed_pages = agreed
        p.batches_left -= 1
        if p.batches_left == 0:
            if p.finished:  # committed earlier: the pages it did not take are free now
                self._free_unused(p)
            self._maybe_forget(p)

    def _free_unused(self, p: Prefetch) -> None:
        """The granted pages `finish` did not attach go back to the pool and the budget."""
        unused = p.host_page_ids[p.storage_used :]
        self.host.free_host(unused)
        self.held_pages -= len(unused)

    def ready(self, p: Prefetch) -> bool:
        """Whether the request may be admitted now (it finishes its prefetch first)."""
        if p.finished or p.complete or p.stopped:
            return True
        return self.policy == "best_effort"

    @rank_consensus(
        same_params=["p.rid", "p.completed_pages", "p.complete"],
        same_results=["p.storage_range"],
    )
    def finish(self, p: Prefetch) -> None:
        """Attach what was read to the tree, pinned for the request until `release`, and
        give back what is not needed."""
        if p.finished:
            return
        p.finished = True
        if p.awaiting_room:  # still waiting for room: it takes nothing
            self.room_queue.remove(p)
            self._give_back_grant(p)
        if p.read is not None and not p.complete:
            p.read.cancelled.set()  # the rest is not wanted
        n = p.completed_pages if p.taken_pages is None else p.taken_pages
        n = n if p.read is not None else 0
        p.storage_used = n
        tree, ps = self.tree, self.page_size
        end = p.start_len + n * ps
        if n:
            attached = tree.insert_host(p.ids[:end], p.host_page_ids[:n], p.start_len, p.salt)
            dup_end, unused = attached.dup_end, attached.unused_page_ids
            self.host.free_host(unused)
            self.held_pages -= len(unused)
            p.attached_pages = n - len(unused)
            p.storage_range = (dup_end, end) if dup_end < end else (0, 0)
            self.host.stats.storage_pages_read += n
        # The host prefix the request will load (what was covered at start, and what was
        # attached) stays pinned until `release`: the deepest node of it that is on the host.
        p.pin_node = tree.host_prefix(p.ids[:end], p.salt).node
        tree.tiers.ref_host(p.pin_node)
        tree.tiers.unref_host(p.start_node)  # the pin taken at start
        if p.read is not None and p.complete:
            self._free_unused(p)
        self._maybe_forget(p)

    def release(self, p: Prefetch) -> None:
        """The request was admitted (its load pins what it reads now) or left: the host
        prefix `finish` pinned becomes ordinary host cache, and what it attached leaves the
        budget."""
        if p.pin_node is not None:
            self.tree.tiers.unref_host(p.pin_node)
            p.pin_node = None
        self.held_pages -= p.attached_pages
        p.attached_pages = 0

    def stop(self, rid: int) -> None:
        """A verdict (rank 0's timeout, applied by every rank): take what was read."""
        p = self.prefetches.get(rid)
        if p is not None and not p.finished:
            p.stopped = True
            p.taken_pages = p.completed_pages
            if p.read is not None:
                p.read.cancelled.set()

    def cancel(self, p: Prefetch) -> None:
        """The request left before admission: keep what was read as ordinary cache."""
        p.stopped = True
        self.finish(p)
        self.release(p)

    def timed_out(self, now: float) -> list[int]:
        """Rank 0: prefetches of the `timeout` policy past their deadline (their rids)."""
        if self.policy != "timeout":
            return []
        out = []
        for p in self.prefetches.values():
            if p.finished or p.stopped or p.read is None or p.read_started_at is None:
                continue
            num_tokens = len(p.host_page_ids) * self.page_size
            if now - p.read_started_at > self.timeout.deadline_s(num_tokens):
                out.append(p.rid)
        return out

    def _maybe_forget(self, p: Prefetch) -> None:
        if p.finished and (p.read is None or p.complete) and self.prefetches.get(p.rid) is p:
            del self.prefetches[p.rid]
