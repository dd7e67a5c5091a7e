"""The `file` storage backend's books: what one process knows and has counted of a store.

`FileBooks` owns the one lock of a `FileBackend`, and under it the LRU of known objects
(`file_index.LruIndex`), the effective capacity, the read/write/eviction counters, the
quarantine and write-failure counts and the log-warning throttle; `stats()` is a snapshot of
them. Each method takes the lock for one step of the backend's bookkeeping; the backend's
file I/O runs outside it, between those steps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from types import MappingProxyType

from gpu_worker.storage.base import (
    QUARANTINE_REASONS,
    WRITE_FAILURES,
    QuarantineReason,
    StorageStats,
    WriteFailure,
)
from gpu_worker.storage.file_index import LruIndex

WARN_INTERVAL_S = 60.0  # at most one write-failure warning per reason per interval


@dataclass(slots=True)
class _Counters:
    num_reads: int = 0
    num_hits: int = 0
    num_misses: int = 0
    num_written: int = 0
    num_evictions: int = 0


class FileBooks:
    """Thread-safe bookkeeping of one `FileBackend`: the LRU index, capacity and counters."""

    def __init__(self, capacity: int | None) -> None:
        self._lock = threading.Lock()
        self._index = LruIndex()  # the known objects and their bytes
        self._counters = _Counters()
        self._quarantined = dict.fromkeys(QUARANTINE_REASONS, 0)
        self._write_failures = dict.fromkeys(WRITE_FAILURES, 0)
        self._last_warned: dict[str, float] = {}  # reason -> time.monotonic() of its warning
        self._capacity = capacity
        self._quarantine_objects = self._quarantine_bytes = self._quarantine_dropped = 0

    # ---------------------------------------------------------------- the LRU

    def touch(self, key: str, size: int) -> None:
        """Make `key` (of `size` bytes on disk) the most recently used."""
        with self._lock:
            self._index.touch(key, size)

    def forget(self, key: str, miss: bool = False) -> None:
        """Drop `key` from the LRU; count a miss too when `miss`."""
        with self._lock:
            self._index.forget(key)
            if miss:
                self._counters.num_misses += 1

    def merge_scan(self, found: Iterable[tuple[int, str, int]]) -> int:
        """Put scanned (mtime_ns, key, size) objects behind every known one; the bytes the
        LRU holds afterwards."""
        with self._lock:
            self._index.merge_older(found)
            return self._index.used_bytes

    def set_capacity(self, capacity: int) -> None:
        with self._lock:
            self._capacity = capacity

    def clear(self) -> None:
        """Forget every object and the quarantine's contents (its dropped count stays)."""
        with self._lock:
            self._index.clear()
            self._quarantine_objects = self._quarantine_bytes = 0

    # ---------------------------------------------------------------- reads

    def count_read(self, fail_get_after: int | None) -> bool:
        """Count a read; False (counted as a miss) once `fail_get_after` hits were served."""
        with self._lock:
            self._counters.num_reads += 1
            if fail_get_after is not None and self._counters.num_hits >= fail_get_after:
                self._counters.num_misses += 1
                return False
        return True

    def count_hit(self, key: str, size: int) -> None:
        """Count a verified read of `key` and make it the most recently used."""
        with self._lock:
            self._counters.num_hits += 1
            self._index.touch(key, size)

    def count_quarantined(self, key: str, reason: QuarantineReason) -> None:
        """Count a read of `key` that failed verification (a miss) and forget the key."""
        with self._lock:
            self._quarantined[reason] += 1
            self._counters.num_misses += 1
            self._index.forget(key)

    def set_quarantine(self, num_objects: int, num_bytes: int, dropped: int) -> None:
        """Record what the quarantine holds after a trim that dropped `dropped` objects."""
        with self._lock:
            self._quarantine_objects, self._quarantine_bytes = num_objects, num_bytes
            self._quarantine_dropped += dropped

    # ---------------------------------------------------------------- writes

    def reserve(self, size: int, batch: set[str]) -> list[str] | None:
        """Reserve `size` bytes for a put under the capacity, forgetting and counting the
        least recently used objects (never ones in `batch`) as evicted: the victims, whose
        files the caller deletes. None (nothing changed) when the object cannot fit."""
        with self._lock:
            victims = self._index.reserve(size, batch, self._capacity or 0)
            if victims is not None:
                self._counters.num_evictions += len(victims)
        return victims

    def release(self, size: int) -> None:
        """Return the bytes of a reservation whose write failed."""
        with self._lock:
            self._index.pending_bytes -= size

    def count_written(self, key: str, size: int, published: bool) -> None:
        """End the reservation of a completed put of `key`: it becomes the most recently
        used; counted as written when this process `published` it."""
        with self._lock:
            self._index.pending_bytes -= size
            if published:
                self._counters.num_written += 1
            self._index.touch(key, size)

    def count_write_failure(self, reason: WriteFailure) -> None:
        with self._lock:
            self._write_failures[reason] += 1

    def should_warn(self, kind: str) -> bool:
        """True at most once per WARN_INTERVAL_S for each kind (rate-limits log lines)."""
        now = time.monotonic()
        with self._lock:
            last = self._last_warned.get(kind)
            if last is not None and now - last < WARN_INTERVAL_S:
                return False
            self._last_warned[kind] = now
            return True

    # ---------------------------------------------------------------- views

    def stats(self, scanned: bool) -> StorageStats:
        with self._lock:
            c = self._counters
            return StorageStats(
                num_objects=len(self._index),
                num_bytes=self._index.used_bytes,
                scanned=scanned,
                num_reads=c.num_reads,
                num_hits=c.num_hits,
                num_misses=c.num_misses,
                num_written=c.num_written,
                num_evictions=c.num_evictions,
                quarantined=MappingProxyType(dict(self._quarantined)),
                write_failures=MappingProxyType(dict(self._write_failures)),
                capacity_bytes=self._capacity or 0,
                quarantine_objects=self._quarantine_objects,
                quarantine_bytes=self._quarantine_bytes,
                quarantine_dropped=self._quarantine_dropped,
            )

    def lru_keys(self) -> list[str]:
        """The known keys, least recently used first (a copy)."""
        with self._lock:
            return list(self._index.sizes)

    def check_integrity(self) -> None:
        """Assert the bookkeeping invariants."""
        with self._lock:
            self._index.check()
