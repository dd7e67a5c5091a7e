"""External storage I/O of one rank: background threads and their ordered ACK queues.

The scheduler thread submits three kinds of work; each runs off it and completes through an
immutable ACK in an ordered FIFO of its kind (so a slow read never holds back the ACK of a
hit query behind it):

- a hit query (`query`, on the query thread): how many leading objects of a prefetch the
  store holds, MIN-agreed over every rank of the world on the `storage_hit` gloo group;
- a read (`read`, on the I/O thread) of the agreed hit into reserved host pages, in batches
  of `batch_pages`: after each batch the number of leading pages read so far is MIN-agreed
  over every rank on the separate `storage_progress` group, and the batch's ACK carries it.
  Exactly one ACK per batch, whatever happened (a failed read stops the count growing on
  that rank, so the MIN shrinks on every rank; a cancelled read skips its reading but still
  joins every reduction);
- a write (`write`) of host pages to the store, in two steps on two threads: the stage
  thread copies the pages out of the host pool, and the write's ACK completes then (the
  scheduler's pin on those pages can go: a slow store never holds host memory); the put
  thread stores the copy, MIN-agrees over every rank on the `storage_write` group how many
  leading pages all of them stored, and leaves that in `pop_stored` for rank 0's KV events
  (an event must not advertise a page one rank's shard lacks). Copies waiting for their put
  are bounded (`STAGING_BYTES`): past it the stage thread waits, and pins stay meanwhile.

Every rank submits the same work in the same order (its inputs are replicated), so the
background threads of all ranks run their collectives in the same order. The ACK counts the
scheduler consumes are agreed per step like the transfer ACKs' (`parallel/sync.py`), and
consuming waits where a rank's own work is still running.

Which objects hold a rank's part of a page, and how they reach its host pages, is the
codec's business (`storage_codec.py`): counts here are in pages; a page is whole only when
all its objects are. Under CP page sharding (`codec.share`) a rank looks up, reads and
writes only the pages it owns, and counts the others as whole: its count is the first of
its own pages that is missing (`first_missing`), and the MIN over the ranks is then the
first page missing anywhere. A rank that owns none of a batch's pages still joins its
agreement, so every rank's collectives stay in step.

A read batch or a write moves the rows of a set of pages of the pool group's host pools
(`memory/pool_group.py`) in one piece of work with one ACK: the target's host pool, where
a `packed` draft's layers sit in the same host rows, hence the same objects; a `sidecar`
draft's objects join the same batch (`storage_codec.PairedCodec`), so the draft's rows of
a page are read and written with the target's and a page is whole only with both.
"""

from __future__ import annotations

import collections
import enum
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gpu_worker.cache.storage_codec import ObjectCodec, first_missing
from gpu_worker.storage import StorageBackend

log = logging.getLogger(__name__)

STAGING_BYTES = 256 << 20  # copies of written pages waiting for their put, at most (one
# write larger than this is staged alone)


class StorageAckKind(enum.Enum):
    HIT = "hit"
    PROGRESS = "progress"
    WRITE = "write"


@dataclass(frozen=True, slots=True)
class StorageAck:
    """One completed (or running) piece of storage work; `future` gives its count: HIT the
    agreed hit pages, PROGRESS the agreed pages read so far, WRITE the pages stored here."""

    seq: int
    kind: StorageAckKind
    op: object  # what the scheduler side commits when the ACK is consumed
    future: Future[int]


@dataclass(frozen=True, slots=True)
class Stored:
    """A write whose put finished: pages this rank stored, and pages every rank stored."""

    op: object
    local_pages: int
    agreed_pages: int


@dataclass(frozen=True, slots=True)
class StorageFaults:
    """Test hooks, the same config on every rank; `seed` + the rank seeds each rank's own
    delays, so ranks see different readiness."""

    read_delay_ms: float = 0.0  # random [0, max] sleep before each read batch
    query_delay_ms: float = 0.0  # random [0, max] sleep before each hit query
    fail_rank: int = -1  # this world rank's reads fail ...
    fail_at_page: int = 0  # ... from this page of every read on
    fail_write_rank: int = -1  # this world rank's store takes none of its writes
    seed: int = 0
    disable_min: bool = False  # each rank keeps its own counts: the checker must object


@dataclass(slots=True)
class ReadOp:
    """A read of `keys` (the codec's `per_page` per page) into host pages `host_page_ids`,
    batch by batch."""

    keys: list[str]
    host_page_ids: list[int]
    batch_pages: int
    cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def num_batches(self) -> int:
        return -(-len(self.host_page_ids) // self.batch_pages)


class AckQueue:
    """One ordered FIFO of ACKs: the consumable prefix, and pops that wait when needed."""

    def __init__(self) -> None:
        self._queue: collections.deque[StorageAck] = collections.deque()

    def __len__(self) -> int:
        return len(self._queue)

    def append(self, ack: StorageAck) -> None:
        self._queue.append(ack)

    def num_ready(self) -> int:
        n = 0
        for ack in self._queue:
            if not ack.future.done():
                break
            n += 1
        return n

    def pop(self, n: int) -> list[StorageAck]:
        """The first `n` ACKs, each finished (waiting for those still running)."""
        if n > len(self._queue):
            raise ValueError(f"asked to consume {n} storage ACKs, only {len(self._queue)} queued")
        taken = [self._queue.popleft() for _ in range(n)]
        for ack in taken:
            ack.future.exception()  # waits; a failed future is handled by the consumer
        return taken


class StorageIO:
    """See the module docstring. `close()` when done (after every ACK was consumed)."""

    def __init__(
        self,
        backend: StorageBackend,
        codec: ObjectCodec,
        rank: int = 0,
        hit_group: dist.ProcessGroup | None = None,
        progress_group: dist.ProcessGroup | None = None,
        write_group: dist.ProcessGroup | None = None,
        faults: StorageFaults | None = None,
    ) -> None:
        """The groups span the whole world (None in a world of one)."""
        self.backend = backend
        self.codec = codec
        self.rank = rank
        self.hit_group = hit_group
        self.progress_group = progress_group
        self.write_group = write_group
        self.faults = faults or StorageFaults()
        self._rng = random.Random(self.faults.seed + 7919 * rank)
        self.hits = AckQueue()
        self.progress = AckQueue()
        self.writes = AckQueue()
        self.on_done: Callable[[], None] | None = None  # an ACK finished (see TransferEngine)
        self._seq = 0
        self._query_pool = ThreadPoolExecutor(1, thread_name_prefix="l3-query")
        self._read_pool = ThreadPoolExecutor(1, thread_name_prefix="l3-read")
        self._stage_pool = ThreadPoolExecutor(1, thread_name_prefix="l3-stage")
        self._write_pool = ThreadPoolExecutor(1, thread_name_prefix="l3-write")
        self._lock = threading.Lock()
        self._staging = threading.Condition(self._lock)
        self._staged_bytes = 0  # copies staged, their put not finished (under _staging)
        self._stored: collections.deque[Stored] = collections.deque()  # puts done, in order
        # measured on this rank (rank 0's feed the load-cost estimate; they decide nothing)
        self.read_pages = 0
        self.read_seconds = 0.0
        self.failed_reads = 0

    # ----------------------------------------------------------------- submit

    def query(self, keys: list[str], op: object, first_page: int = 0) -> StorageAck:
        """How many leading pages of `keys` (`per_page` each; the path's pages from
        `first_page` on, which say the pages' CP owners) the store holds, agreed."""
        future = self._query_pool.submit(self._query, keys, first_page)
        return self._enqueue(self.hits, StorageAckKind.HIT, op, future)

    def read(self, read: ReadOp, op: object) -> list[StorageAck]:
        """One ACK per batch of `read`, in order."""
        batches: list[Future[int]] = [Future() for _ in range(read.num_batches)]
        self._read_pool.submit(self._read, read, batches)
        return [self._enqueue(self.progress, StorageAckKind.PROGRESS, op, f) for f in batches]

    def write(self, keys: list[str], host_page_ids: list[int], op: object) -> StorageAck:
        """The ACK completes once the pages are staged; the put's outcome comes through
        `pop_stored`."""
        staged: Future[int] = Future()
        self._stage_pool.submit(self._stage, keys, host_page_ids, op, staged)
        return self._enqueue(self.writes, StorageAckKind.WRITE, op, staged)

    def pop_stored(self) -> list[Stored]:
        """Writes whose put finished since the last call, in submission order."""
        out = []
        while self._stored:
            out.append(self._stored.popleft())
        return out

    def wait_stored(self) -> None:
        """Block until every write submitted so far has been put (and agreed)."""
        self._stage_pool.submit(lambda: None).result()  # the stage queue is drained ...
        self._write_pool.submit(lambda: None).result()  # ... then the puts behind it

    def _enqueue(
        self, queue: AckQueue, kind: StorageAckKind, op: object, future: Future[int]
    ) -> StorageAck:
        ack = StorageAck(self._seq, kind, op, future)
        self._seq += 1
        queue.append(ack)
        if self.on_done is not None:
            listener = self.on_done
            future.add_done_callback(lambda _: listener())
        return ack

    # ----------------------------------------------------------------- workers

    def _query(self, keys: list[str], first_page: int) -> int:
        if self.faults.query_delay_ms:
            time.sleep(self._rng.uniform(0, self.faults.query_delay_ms) / 1e3)
        k = self.codec.per_page
        num_pages = len(keys) // k
        where, _ = self._select(range(first_page, first_page + num_pages))
        try:
            found = self.backend.exists(_keys_at(keys, where, k)) // k  # whole pages
            local = first_missing(where, found, num_pages)
        except Exception as e:  # a broken store is a miss, never a crash
            log.warning("storage exists() failed: %r", e)
            local = 0
        return self._agree(local, self.hit_group)

    def _select(self, page_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """The positions of this rank's pages among `page_ids`, and their local ids."""
        share = self.codec.share
        if share is None:
            return list(range(len(page_ids))), list(page_ids)
        return share.select(page_ids)

    def _read(self, read: ReadOp, batches: list[Future[int]]) -> None:
        done = 0  # leading pages read on this rank
        ok = True
        k = self.codec.per_page
        for b, future in enumerate(batches):
            lo = b * read.batch_pages
            hi = min(lo + read.batch_pages, len(read.host_page_ids))
            try:
                if ok and not read.cancelled.is_set():
                    n = self._read_batch(read.keys[lo * k : hi * k], read.host_page_ids[lo:hi], lo)
                    done += n
                    ok = n == hi - lo
            except Exception as e:
                log.warning("storage read failed: %r", e)
                ok = False
            if not ok:
                self.failed_reads += 1
            try:
                future.set_result(self._agree(done, self.progress_group))
            except BaseException as e:  # a collective that failed: the engine is going down
                future.set_exception(e)
                for rest in batches[b + 1 :]:
                    rest.set_exception(e)
                return

    def _read_batch(self, keys: list[str], host_ids: list[int], first: int) -> int:
        """Read the objects of host pages `host_ids`; how many leading pages arrived whole."""
        f = self.faults
        start = time.perf_counter()  # an injected delay is part of the read: a slow store
        if f.read_delay_ms:
            time.sleep(self._rng.uniform(0, f.read_delay_ms) / 1e3)
        k = self.codec.per_page
        where, local = self._select(host_ids)
        n = self.codec.read(self.backend, _keys_at(keys, where, k), local) // k if local else 0
        n = first_missing(where, n, len(host_ids))
        if f.fail_rank == self.rank:
            n = min(n, max(f.fail_at_page - first, 0))
        with self._lock:
            self.read_pages += n
            self.read_seconds += time.perf_counter() - start
        return n

    def _stage(self, keys: list[str], host_ids: list[int], op: object, staged: Future[int]) -> None:
        """Copy the pages out (waiting while the copies not yet put exceed the bound), let
        the scheduler unpin them, and queue the put."""
        where, local = self._select(host_ids)
        nbytes = len(local) * self.codec.page_nbytes if self.codec.writes else 0
        with self._staging:
            self._staging.wait_for(
                lambda: not self._staged_bytes or self._staged_bytes + nbytes <= STAGING_BYTES
            )
            self._staged_bytes += nbytes
        data: list[memoryview] | None = []
        try:
            if self.codec.writes and self.faults.fail_write_rank != self.rank:
                data = self.codec.stage(local)
        except Exception as e:  # the put stores nothing, and still joins the agreement
            log.warning("storage staging failed: %r", e)
            data = None
        staged.set_result(len(host_ids))
        owned = _keys_at(keys, where, self.codec.per_page)
        self._write_pool.submit(self._put, owned, where, len(host_ids), data, nbytes, op)

    def _put(
        self,
        keys: list[str],
        where: list[int],
        num_pages: int,
        data: list[memoryview] | None,
        nbytes: int,
        op: object,
    ) -> None:
        """Store a staged copy of this rank's pages (`keys`, at positions `where` of the
        write's `num_pages`); agree with every rank how many leading pages all stored."""
        local = 0
        try:
            if data is not None and self.faults.fail_write_rank != self.rank:
                stored = self.codec.put(self.backend, keys, data) // self.codec.per_page
                local = first_missing(where, stored, num_pages)
        except Exception as e:  # the backend reports full/read-only itself; anything else
            log.warning("storage put() failed: %r", e)
        finally:
            del data
            with self._staging:
                self._staged_bytes -= nbytes
                self._staging.notify_all()
        try:
            agreed = self._agree(local, self.write_group)
        except BaseException as e:  # a collective that failed: the engine is going down
            log.warning("storage write agreement failed: %r", e)
            agreed = 0
        self._stored.append(Stored(op, local, agreed))
        if self.on_done is not None:  # rank 0 may advertise it now
            self.on_done()

    def _agree(self, value: int, group: dist.ProcessGroup | None) -> int:
        if group is None or self.faults.disable_min:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return int(t[0])

    # ----------------------------------------------------------------- queues

    def ready_counts(self) -> tuple[int, int, int]:
        return self.hits.num_ready(), self.progress.num_ready(), self.writes.num_ready()

    def queued_counts(self) -> tuple[int, int, int]:
        return len(self.hits), len(self.progress), len(self.writes)

    def seconds_per_page(self) -> float | None:
        """Measured read time per page on this rank, once some were read."""
        with self._lock:
            return self.read_seconds / self.read_pages if self.read_pages else None

    def close(self) -> None:
        for pool in (self._query_pool, self._read_pool, self._stage_pool, self._write_pool):
            pool.shutdown(wait=True)


def _keys_at(keys: list[str], where: list[int], per_page: int) -> list[str]:
    """The keys of the pages at positions `where` (`per_page` keys a page)."""
    if len(where) * per_page == len(keys):
        return keys  # every page (`where` is every position, in order)
    return [keys[i * per_page + j] for i in where for j in range(per_page)]
