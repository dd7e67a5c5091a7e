"""Page ids and the page allocator shared by the device and host pools."""

from __future__ import annotations

from typing import NewType

PageId = NewType("PageId", int)  # a device-pool page: slots [id * page_size, (id + 1) * page_size)
HostPageId = NewType("HostPageId", int)  # a host-pool page


class PageAllocator:
    """Hands out page ids, lowest first.

    Lowest-first (rather than a LIFO stack) makes the ids a deterministic function of the
    sequence of alloc/free calls, which is what lets ranks of one engine, and tests, agree on
    exact page ids. The free list is kept unsorted and sorted lazily on the next `alloc`, so a
    burst of frees costs O(n) appends and one sort.
    """

    def __init__(self, num_pages: int, name: str = "device") -> None:
        if num_pages <= 0:
            raise ValueError(f"{name} pool needs at least one page, got {num_pages}")
        self.name = name
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._sorted = True

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """Take `n` pages, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        if not self._sorted:
            self._free.sort(reverse=True)
            self._sorted = True
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        taken.reverse()
        return taken

    def free(self, page_ids: list[int]) -> None:
        """Return pages. The caller must own them; a double free corrupts the pool."""
        if page_ids:
            self._free.extend(page_ids)
            self._sorted = False

    def free_set(self) -> set[int]:
        return set(self._free)

    def reset(self) -> None:
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._sorted = True
