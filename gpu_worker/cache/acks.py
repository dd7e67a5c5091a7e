"""The ordered ACK queues of one rank's cache, as the per-step agreement sees them.

Four FIFOs: the host tier's transfers, then the storage tier's hit queries, read progress
and writes. Each step the ranks agree (MIN over the world) how many finished ACKs at the
front of each queue to consume (`ready_counts`), and every rank consumes exactly those
(`consume_counts`), queue by queue, in order. Without a host tier or storage the missing
queues count 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gpu_worker.cache.host_tier import HostTier
from gpu_worker.cache.storage_tier import StorageTier


class AckQueues:
    """See the module docstring. Driven from the scheduler thread; `set_listener` is what
    the worker threads call."""

    def __init__(self, host: HostTier | None, storage: StorageTier | None) -> None:
        self.host = host
        self.storage = storage

    def set_listener(self, listener: Callable[[], None] | None) -> None:
        """Call `listener` (from a worker thread) whenever an ACK's work finishes, so the
        scheduler can sleep until there is something to consume instead of spinning."""
        if self.host is not None:
            self.host.transfers.on_done = listener
        if self.storage is not None:
            self.storage.io.on_done = listener

    def ready_counts(self) -> tuple[int, ...]:
        """Finished ACKs at the front of each queue: transfers, then storage hit queries,
        read progress and writes (the per-step agreement takes their MIN over the ranks)."""
        storage = (0, 0, 0) if self.storage is None else self.storage.io.ready_counts()
        return (0 if self.host is None else self.host.num_ready_acks(), *storage)

    def queued_counts(self) -> tuple[int, ...]:
        storage = (0, 0, 0) if self.storage is None else self.storage.io.queued_counts()
        return (0 if self.host is None else self.host.num_queued_acks, *storage)

    def consume_counts(self, counts: Sequence[int]) -> None:
        """Apply the first `counts[i]` ACKs of each queue (agreed counts), queue by queue."""
        if self.host is not None:
            self.host.consume(counts[0])
        if self.storage is None:
            return
        io = self.storage.io
        for queue, n in zip((io.hits, io.progress, io.writes), counts[1:], strict=True):
            for ack in queue.pop(n):
                self.storage.on_ack(ack)
        self.storage.writes.collect_stored()

    def drain(self) -> None:
        """Wait for and apply every queued ACK (storage writes a backup starts included),
        and for the store to hold what was written."""
        while any(self.queued_counts()):
            self.consume_counts(self.queued_counts())
        if self.storage is not None:
            self.storage.io.wait_stored()
            self.storage.writes.collect_stored()
