"""The counters of one rank's cache, kept by the cache and its storage tier."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, fields

RECENT_ACKS = 256  # consumed ACK seqs kept for tests and debugging (a window, not a history)


@dataclass(slots=True)
class CacheStats:
    """Counters since the last flush; cached tokens are what requests actually reused."""

    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    num_backups: int = 0
    num_loads: int = 0
    backed_up_pages: int = 0
    loaded_pages: int = 0
    loads_skipped: int = 0  # host hits recomputed because loading looked slower
    storage_hit_tokens: int = 0  # prompt tokens requests got from storage (via the host)
    num_prefetches: int = 0  # hit queries sent to the store
    storage_pages_read: int = 0  # pages read from the store into the tree
    storage_reads_skipped: int = 0  # storage hits recomputed because reading looked slower
    storage_reads_short: int = 0  # grants cut to a shorter prefix: pins left too few to evict
    num_storage_writes: int = 0  # writes to the store submitted
    storage_pages_written: int = 0  # pages the store took (this rank)
    evicted_device_pages: int = 0  # device pages the tree gave up to make room
    evicted_host_pages: int = 0  # host pages the tree gave up to make room
    num_consumed_acks: int = 0
    # the last RECENT_ACKS consumed ACK seqs, in consume order: bounded, it grows with nothing
    consumed_acks: deque[int] = field(default_factory=lambda: deque(maxlen=RECENT_ACKS))

    def reset(self) -> None:
        """Zero every counter (a flush). The object stays the same one: the cache and its
        tiers share it."""
        fresh = CacheStats()
        for f in fields(self):
            setattr(self, f.name, getattr(fresh, f.name))
