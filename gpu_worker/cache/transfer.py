"""The transfer engine: asynchronous page copies and their ordered queue of ACKs.

Every copy between tiers (device -> host backup, host -> device load) is submitted here and
runs off the scheduler thread: on a CUDA stream on GPU, on worker threads on CPU. One
submission moves a set of pages through every (source, destination) pair of a pool group
(`PoolGroup.tier_views`: the target's pools and a draft's, packed or sidecar) as one
operation with one completion, and appends an immutable `TransferAck` to one FIFO: a draft's
rows are never read before the target's ACK is consumed. Copies may *finish* in any order
(several workers, injected delays), but the scheduler consumes ACKs strictly from the front:
`num_ready()` counts the finished prefix, `pop(n)` takes exactly `n` from the front, waiting
on any that has not finished (a later PP stage told to consume `n` by PP0 does that). Cache
bookkeeping changes only when an ACK is popped.
"""

from __future__ import annotations

import collections
import enum
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from gpu_worker.kernels.moves import PoolView, move_pages

COMPLETION_LOG_LEN = 256  # completion order kept for tests and debugging (a window)

ViewPairs = Sequence[tuple[PoolView, PoolView]]  # (source, destination) per member of a group


class TransferKind(enum.Enum):
    BACKUP = "backup"  # device -> host
    LOAD = "load"  # host -> device


class Completion(Protocol):
    def done(self) -> bool: ...

    def wait(self) -> BaseException | None:
        """Block until the copy finished; its error if it failed (None if it succeeded)."""
        ...

    def seconds(self) -> float | None:
        """How long the copy itself ran, when measured (after it finished)."""
        ...


class _FutureCompletion:
    __slots__ = ("_future",)

    def __init__(self, future: Future[float]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> BaseException | None:
        return self._future.exception()

    def seconds(self) -> float | None:
        if not self._future.done() or self._future.exception() is not None:
            return None
        return self._future.result()


class _CudaCompletion:
    __slots__ = ("_event",)

    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def done(self) -> bool:
        return bool(self._event.query())

    def wait(self) -> BaseException | None:
        self._event.synchronize()
        return None

    def seconds(self) -> float | None:
        return None


@dataclass(frozen=True, slots=True)
class TransferAck:
    """One submitted copy. `op` is what the submitter commits when the ACK is consumed."""

    seq: int
    kind: TransferKind
    num_pages: int
    op: object
    completion: Completion


@dataclass(frozen=True, slots=True)
class DelayInjection:
    """Test hook: sleep a random `[0, max_ms]` before each copy (seeded, reproducible)."""

    max_ms: float
    seed: int = 0


class TransferEngine:
    """Runs page copies asynchronously and queues their ACKs in submission order."""

    def __init__(
        self, device: torch.device, num_workers: int = 1, delay: DelayInjection | None = None
    ) -> None:
        self.device = device
        self._queue: collections.deque[TransferAck] = collections.deque()
        self._seq = 0
        self._delay = delay
        self._rng = random.Random(delay.seed if delay else 0)
        self._lock = threading.Lock()
        # the last COMPLETION_LOG_LEN ACK seqs in the order their copies finished: bounded,
        # so a long-running engine does not grow it with every transfer
        self.completion_log: collections.deque[int] = collections.deque(maxlen=COMPLETION_LOG_LEN)
        self.num_completed = 0  # copies finished (successfully) since start
        self.wait_seconds = 0.0  # spent in pop() waiting for unfinished copies (measured only)
        self.num_waited = 0  # ACKs pop() took before their copy had finished (measured only)
        # called (on the worker thread) when a copy finished: wakes a scheduler that waits
        # for ACKs instead of spinning (CPU copies only; a CUDA event is polled)
        self.on_done: Callable[[], None] | None = None
        self._stream: torch.cuda.Stream | None = None
        self._pool: ThreadPoolExecutor | None = None
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device=device)
        else:
            self._pool = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="kv-xfer")

    def submit(
        self,
        kind: TransferKind,
        views: ViewPairs,
        src_page_ids: list[int],
        dst_page_ids: list[int],
        op: object,
        inject_failure: bool = False,
    ) -> TransferAck:
        """Start copying pages `src_page_ids` to `dst_page_ids` through every (source,
        destination) pair of `views`, in order, as one operation: its ACK completes when
        every pair's copy has.

        The caller must keep both page sets alive and unwritten until the ACK is consumed.
        """
        if len(src_page_ids) != len(dst_page_ids):
            raise ValueError("source and destination page lists differ in length")
        if not views:
            raise ValueError("a transfer needs at least one pair of views")
        views = tuple(views)
        delay_s = self._rng.uniform(0, self._delay.max_ms) / 1e3 if self._delay else 0.0
        if inject_failure:  # test hook: the copy fails instead of running
            src_page_ids, dst_page_ids = [-1], [-1]
        src_ids = torch.tensor(src_page_ids, dtype=torch.int64)
        dst_ids = torch.tensor(dst_page_ids, dtype=torch.int64)
        completion: Completion
        if self._stream is not None:
            completion = self._submit_cuda(views, src_ids, dst_ids, delay_s)
        else:
            assert self._pool is not None
            future = self._pool.submit(self._copy, self._seq, views, src_ids, dst_ids, delay_s)
            if self.on_done is not None:
                listener = self.on_done
                future.add_done_callback(lambda _: listener())
            completion = _FutureCompletion(future)
        ack = TransferAck(self._seq, kind, len(src_page_ids), op, completion)
        self._seq += 1
        self._queue.append(ack)
        return ack

    def _copy(
        self,
        seq: int,
        views: ViewPairs,
        src_ids: torch.Tensor,
        dst_ids: torch.Tensor,
        delay_s: float,
    ) -> float:
        if delay_s:
            time.sleep(delay_s)
        start = time.perf_counter()
        for src, dst in views:
            move_pages(src, dst, src_ids, dst_ids)
        elapsed = time.perf_counter() - start
        with self._lock:
            self.completion_log.append(seq)
            self.num_completed += 1
        return elapsed

    def _submit_cuda(
        self,
        views: ViewPairs,
        src_ids: torch.Tensor,
        dst_ids: torch.Tensor,
        delay_s: float,
    ) -> Completion:
        assert self._stream is not None
        # The copy must see every kernel already queued on the compute stream (the KV it backs
        # up was written there), and must not block it.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            if delay_s:
                torch.cuda._sleep(int(delay_s * 1e9))  # ~1 cycle per ns: a rough delay
            for src, dst in views:
                move_pages(src, dst, src_ids, dst_ids)
            event = torch.cuda.Event()
            event.record(self._stream)
        return _CudaCompletion(event)

    # -- the ordered ACK queue

    def __len__(self) -> int:
        return len(self._queue)

    def num_ready(self) -> int:
        """How many ACKs at the front of the queue have finished (the consumable prefix)."""
        n = 0
        for ack in self._queue:
            if not ack.completion.done():
                break
            n += 1
        return n

    def in_flight(self, kind: TransferKind) -> list[TransferAck]:
        """Queued ACKs of `kind` whose copy has not finished yet."""
        return [ack for ack in self._queue if ack.kind is kind and not ack.completion.done()]

    def wait_copy(self, ack: TransferAck) -> None:
        """Block until `ack`'s copy has finished; the ACK stays queued, to be consumed in
        order. What a CP-sharded pool's gather does for a load of the pages it is about to
        pack (`HostTier`): a copy moves every layer in one go, so a layer's
        restore-complete event is its copy's completion."""
        if not ack.completion.done():
            start = time.perf_counter()
            ack.completion.wait()
            self.wait_seconds += time.perf_counter() - start

    def pop(self, n: int) -> list[TransferAck]:
        """Take exactly the first `n` ACKs, waiting for any whose copy is still running."""
        if n > len(self._queue):
            raise ValueError(f"asked to consume {n} ACKs, only {len(self._queue)} queued")
        taken = [self._queue.popleft() for _ in range(n)]
        for ack in taken:
            if not ack.completion.done():
                start = time.perf_counter()
                ack.completion.wait()
                self.wait_seconds += time.perf_counter() - start
                self.num_waited += 1
        return taken

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
