"""The storage tier (L3) of one rank's cache: prefetch into host pages, and backups to it.

DESIGN.md section 3 and the article's section on L3 under PP. Everything here runs on the
scheduler thread and changes state only when an agreed number of storage ACKs is consumed
(`StorageIO`'s queues), or when a command every rank applies says so, so all ranks take the
same decisions at the same logical points.

Prefetch of a request (`start` when it is added, before admission):
1. Its prompt's pages past the deepest host-covered node of its path (the node is pinned
   with `ref_host` until the prefetch finishes) up to the last whole page before its last
   token are named by their chained page hashes (which cover the model, dtype, page size
   and the request's cache_salt) plus this rank's shard (`object_key`); a hit query asks
   the store how many leading objects it holds, MIN over every rank.
2. Consuming that HIT ACK reserves host pages for the agreed hit, at most what keeps the
   pages reserved by all prefetches under half the host pool, and at most what the host
   pool can free (a shorter page-aligned prefix when space is short), and starts the read;
   with `--hicache-load-policy cost` a hit whose read would be slower than recomputing it
   (rank 0's measured figures, broadcast) is not read.
3. Each PROGRESS ACK consumed gives the agreed pages read so far.
4. The request may be admitted when its prefetch is done, or earlier as the policy says:
   `wait_complete` waits for every batch; `best_effort` takes what was read when the request
   reaches admission; `timeout` waits until its deadline (a base plus a per-1K-tokens term,
   capped), which rank 0 alone reads off its clock and turns into a `StopPrefetch` command.
   Then `finish` attaches the pages read into the tree as host pages (`insert_host`) and the
   request's match finds them there; pages reserved but not read are freed once the read's
   last ACK is consumed (the I/O thread may still write them until then).

Backups: a page committed to the host is written to the store by `write_through`, or once
its node was matched `hicache_storage_write_threshold` times (`write_through_selective`).
Whether to write is decided from replicated state (a node is marked `in_storage` when its
write is submitted, whatever the result), so every rank submits the same writes; the host
pages stay pinned until the WRITE ACK is consumed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from bus_schemas.page_hash import chain_hashes
from bus_schemas.token_ids import TokenIds
from gpu_worker.cache.radix import KVEventRecord, TreeNode
from gpu_worker.cache.storage_io import ReadOp, StorageAck, StorageIO
from gpu_worker.consensus.checker import rank_consensus
from gpu_worker.memory.allocator import HostPageId

if TYPE_CHECKING:
    from gpu_worker.cache.hicache import PrefixCache

log = logging.getLogger(__name__)

PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]
PREFETCH_POLICIES: tuple[PrefetchPolicy, ...] = ("best_effort", "wait_complete", "timeout")
StorageWritePolicy = Literal["write_through", "write_through_selective"]
STORAGE_WRITE_POLICIES: tuple[StorageWritePolicy, ...] = (
    "write_through",
    "write_through_selective",
)


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
    started_at: float  # rank 0's clock: only the timeout policy reads it, only on rank 0
    hit_pages: int | None = None  # agreed, once the HIT ACK is consumed
    host_page_ids: list[HostPageId] = field(default_factory=list)  # reserved for the read
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
        return self.hit_pages is not None and self.batches_left == 0


@dataclass(frozen=True, slots=True)
class _Write:
    last_node: TreeNode  # pinned with ref_host until the WRITE ACK is consumed
    num_pages: int
    page_hashes: list[str]  # hex, for rank 0's storage KV events


class StorageTier:
    """See the module docstring. Owned by a `PrefixCache` with a host tier."""

    def __init__(
        self,
        cache: PrefixCache,
        io: StorageIO,
        scope: str,
        policy: PrefetchPolicy,
        timeout: PrefetchTimeout,
        write_policy: StorageWritePolicy,
        write_threshold: int,
        batch_pages: int,
    ) -> None:
        self.cache = cache
        self.io = io
        self.scope = scope
        self.policy = policy
        self.timeout = timeout
        self.write_policy = write_policy
        self.write_threshold = write_threshold
        self.batch_pages = batch_pages
        self.prefetches: dict[int, Prefetch] = {}  # rid -> not finished, or its read not done
        self.reserved_pages = 0  # host pages reserved by running reads
        self.events: list[KVEventRecord] = []  # ("stored", "storage", hashes): rank 0 sends

    @property
    def host_limit(self) -> int:
        """At most this many host pages are reserved by prefetches at once."""
        assert self.cache.host_pool is not None
        return self.cache.host_pool.num_pages // 2

    # ----------------------------------------------------------------- prefetch

    @rank_consensus(same_params=["rid", "len(ids)", "salt"], same_results=["result is None"])
    def start(self, rid: int, ids: TokenIds, salt: str) -> Prefetch | None:
        """Start prefetching what the store may hold of `ids` past the host-covered prefix;
        None when there is nothing to ask for."""
        tree, ps = self.cache.tree, self.cache.page_size
        limit = (len(ids) - 1) // ps * ps  # a request computes at least its last token
        node, start = tree.host_prefix(ids[:limit], salt)
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
            time.monotonic(),
        )
        tree.ref_host(node)
        self.io.query(p.keys, p)
        self.prefetches[rid] = p
        self.cache.stats.num_prefetches += 1
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
            assert isinstance(ack.op, _Write)
            self._on_write(ack.op, value)

    @rank_consensus(same_params=["p.rid", "agreed"], same_results=["len(p.host_page_ids)"])
    def _on_hit(self, p: Prefetch, agreed: int) -> None:
        p.hit_pages = agreed
        want = min(agreed, max(self.host_limit - self.reserved_pages, 0))
        by_cost = self.cache.config.hicache_load_policy == "cost"
        if (
            want
            and by_cost
            and not self.cache.cost_estimate.worth_reading(want * self.cache.page_size)
        ):
            self.cache.stats.storage_reads_skipped += 1
            want = 0
        if want and not (p.stopped or p.finished):
            p.host_page_ids = self.cache.alloc_host_upto(want)  # start_node stays pinned
        if not p.host_page_ids:
            self._maybe_forget(p)
            return
        self.reserved_pages += len(p.host_page_ids)
        n = len(p.host_page_ids)
        k = self.io.codec.per_page
        p.read = ReadOp(p.keys[: n * k], list(p.host_page_ids), self.batch_pages)
        p.batches_left = p.read.num_batches
        self.io.read(p.read, p)

    def _on_progress(self, p: Prefetch, agreed: int) -> None:
        p.completed_pages = agreed
        p.batches_left -= 1
        if p.batches_left == 0:
            self.reserved_pages -= len(p.host_page_ids)
            if p.finished:  # committed earlier: the pages it did not take are free now
                self.cache.free_host(p.host_page_ids[p.storage_used :])
            self._maybe_forget(p)

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
        """Attach what was read to the tree, unpin, and give back what is not needed."""
        if p.finished:
            return
        p.finished = True
        if p.read is not None and not p.complete:
            p.read.cancelled.set()  # the rest is not wanted
        n = p.completed_pages if p.taken_pages is None else p.taken_pages
        n = n if p.read is not None else 0
        p.storage_used = n
        tree, ps = self.cache.tree, self.cache.page_size
        if n:
            end = p.start_len + n * ps
            _, dup_end, unused = tree.insert_host(
                p.ids[:end], p.host_page_ids[:n], p.start_len, p.salt
            )
            self.cache.free_host(unused)
            p.storage_range = (dup_end, end) if dup_end < end else (0, 0)
            self.cache.stats.storage_pages_read += n
        tree.unref_host(p.start_node)  # the pin taken at start
        if p.read is not None and p.complete:
            self.cache.free_host(p.host_page_ids[n:])
        self._maybe_forget(p)

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

    def timed_out(self, now: float) -> list[int]:
        """Rank 0: prefetches of the `timeout` policy past their deadline (their rids)."""
        if self.policy != "timeout":
            return []
        out = []
        for p in self.prefetches.values():
            num_tokens = p.num_pages * self.cache.page_size
            if not (p.finished or p.stopped) and now - p.started_at > self.timeout.deadline_s(
                num_tokens
            ):
                out.append(p.rid)
        return out

    def _maybe_forget(self, p: Prefetch) -> None:
        if p.finished and (p.read is None or p.complete) and self.prefetches.get(p.rid) is p:
            del self.prefetches[p.rid]

    # ----------------------------------------------------------------- backups

    def after_backup(self, last_node: TreeNode) -> None:
        """Pages of the path to `last_node` reached the host: write-through to the store."""
        if self.write_policy == "write_through":
            self.write(last_node)

    def after_match(self, node: TreeNode) -> None:
        """A match reached `node`: write_through_selective writes a hot enough path."""
        if self.write_policy == "write_through_selective" and node.hit_count >= max(
            self.write_threshold, 1
        ):
            self.write(node)

    @rank_consensus(same_params=["last_node.id"], same_results=["result"])
    def write(self, last_node: TreeNode) -> int:
        """Write the host pages of the path to `last_node` not yet in the store; pages."""
        tree = self.cache.tree
        page_hashes: list[bytes] = []
        host_ids: list[int] = []
        end = last_node
        for _, n in tree.path(last_node):
            if n.host_page_ids is None:
                break  # host coverage is prefix-closed: nothing below is on the host
            end = n
            if n.in_storage:
                continue
            assert n.page_hashes is not None
            n.in_storage = True
            page_hashes += n.page_hashes
            host_ids += n.host_page_ids
        if not page_hashes:
            return 0
        tree.ref_host(end)
        keys = self.io.codec.keys(page_hashes)
        op = _Write(end, len(page_hashes), [h.hex() for h in page_hashes])
        self.io.write(keys, host_ids, op)
        self.cache.stats.num_storage_writes += 1
        return len(page_hashes)

    def _on_write(self, op: _Write, stored: int) -> None:
        self.cache.tree.unref_host(op.last_node)
        self.cache.stats.storage_pages_written += stored
        if stored == op.num_pages and self.cache.tree.record_events:
            self.events.append(("stored", "storage", op.page_hashes))

    def drain_events(self) -> list[KVEventRecord]:
        events, self.events = self.events, []
        return events
