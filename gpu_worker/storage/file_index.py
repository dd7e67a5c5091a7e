"""The `file` storage backend's capacity accounting: an LRU of the objects a process knows.

Each process keeps an LRU (key -> on-disk size) of the objects it knows and, when a put
would exceed capacity_bytes, deletes its least recently used files first. The cap is
enforced by each process on its own view: other processes' objects count only once this
process has seen them (start-up scan, exists, get), and a file another process evicted is
just a miss. Recency is a logical order (the OrderedDict), not time; mtime is used only
once, to seed the order from a previous run.

Not thread-safe by itself: its owner's lock guards every call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from gpu_worker.storage.base import is_valid_key


class LruIndex:
    """Known objects (key -> on-disk size), least recently used first, and their bytes."""

    def __init__(self) -> None:
        self.sizes: OrderedDict[str, int] = OrderedDict()  # key -> on-disk size, oldest first
        self.used_bytes = 0  # sum of self.sizes' values
        self.pending_bytes = 0  # reserved by puts in flight

    def __len__(self) -> int:
        return len(self.sizes)

    def touch(self, key: str, size: int) -> None:
        """Make `key` (of `size` bytes) the most recently used."""
        old = self.sizes.pop(key, None)
        if old is not None:
            self.used_bytes -= old
        self.sizes[key] = size
        self.used_bytes += size

    def forget(self, key: str) -> None:
        size = self.sizes.pop(key, None)
        if size is not None:
            self.used_bytes -= size

    def reserve(self, size: int, batch: set[str], cap: int) -> list[str] | None:
        """Make room for `size` bytes under `cap` (0: no cap): pick and forget least
        recently used objects (never ones in `batch`), reserve the bytes, and return the
        victims to delete. None (nothing changed) when the object cannot fit."""
        excess = self.used_bytes + self.pending_bytes + size - cap
        victims: list[str] = []
        if cap > 0 and excess > 0:
            for key, key_size in self.sizes.items():
                if key in batch:
                    continue
                victims.append(key)
                excess -= key_size
                if excess <= 0:
                    break
            if excess > 0:
                return None
        for key in victims:
            self.forget(key)
        self.pending_bytes += size
        return victims

    def merge_older(self, found: Iterable[tuple[int, str, int]]) -> None:
        """Put scanned (mtime_ns, key, size) objects not yet known behind every known one,
        oldest mtime least recently used."""
        for _, key, size in sorted(found, reverse=True):  # newest first, each to the front
            if key not in self.sizes:
                self.sizes[key] = size
                self.used_bytes += size
                self.sizes.move_to_end(key, last=False)

    def clear(self) -> None:
        self.sizes.clear()
        self.used_bytes = 0

    def check(self) -> None:
        """Assert the bookkeeping invariants."""
        assert self.used_bytes == sum(self.sizes.values()), "used bytes != LRU sizes"
        assert self.pending_bytes >= 0, "negative pending bytes"
        assert all(is_valid_key(k) for k in self.sizes), "invalid key in the LRU"
