"""What the storage tier asks of the cache that owns it: host pages, and the live state its
decisions read.

`StorageTier` and `StorageWrites` hold a `HostPages` (the cache's `HostTier` implements it):
they see these five members instead of the whole cache, and their modules never import the
cache's (which imports them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from gpu_worker.cache.load_cost import LoadCostEstimate
from gpu_worker.cache.stats import CacheStats
from gpu_worker.memory.allocator import HostPageId


class HostPages(Protocol):
    """The host tier's pages as the storage tier takes and gives them back. Driven from the
    scheduler thread only, like the cache behind it."""

    @property
    def stats(self) -> CacheStats:
        """The owner's counters (one object for the cache's life: a flush zeroes it)."""
        ...

    @property
    def cost_estimate(self) -> LoadCostEstimate:
        """The load-cost estimate every rank decides from (replaced when a new one is set)."""
        ...

    @property
    def num_queued_acks(self) -> int:
        """Host<->device copies in flight; consuming their ACKs releases the host pages
        they pin."""
        ...

    def alloc_host_upto(self, num_pages: int, start_page: int = 0) -> list[HostPageId]:
        """Up to `num_pages` free host pages for a path's pages `start_page, ...` (they
        continue its CP owner cycle), evicting unpinned host cache for them: fewer (maybe
        none) when the pool cannot free that many. The caller owns them until it gives them
        to the tree or back (`free_host`)."""
        ...

    def free_host(self, page_ids: Sequence[int]) -> None:
        """Give host pages the caller owns back to the pool."""
        ...
