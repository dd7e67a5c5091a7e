"""Page ids and the page allocator shared by the device and host pools."""

from __future__ import annotations

from typing import NewType

PageId = NewType("PageId", int)  # a device-pool page: slots [id * page_size, (id + 1) * page_size)
HostPageId = NewType("HostPageId", int)  # a host-pool page


class PageAllocator:
    """Hands out page ids, lowest first, by owner class.

    Page `p` belongs to owner class `p % num_owners`, and each class has its own free list:
    `alloc(n, owner)` takes from that class only. Context parallelism hands a sequence's
    pages out round-robin over its CP ranks' classes (`alloc_run`: page j of a run from class
    `(first_owner + j) % num_owners`); with one class every page is class 0 and `alloc_run`
    is `alloc`.

    Lowest-first (rather than a LIFO stack) makes the ids a deterministic function of the
    sequence of alloc/free calls, which is what lets ranks of one engine, and tests, agree on
    exact page ids. A free list is kept unsorted and sorted lazily on the next `alloc` from
    it, so a burst of frees costs O(n) appends and one sort.
    """

    def __init__(self, num_pages: int, name: str = "device", num_owners: int = 1) -> None:
        if num_pages <= 0:
            raise ValueError(f"{name} pool needs at least one page, got {num_pages}")
        if num_owners <= 0 or num_owners > num_pages:
            raise ValueError(f"{name} pool of {num_pages} pages cannot have {num_owners} owners")
        self.name = name
        self.num_pages = num_pages
        self.num_owners = num_owners
        self._free: list[list[int]] = []  # per owner class, highest id first once sorted
        self._sorted: list[bool] = []
        self.reset()

    @property
    def num_free(self) -> int:
        """Free pages of every owner class together."""
        if self.num_owners == 1:
            return len(self._free[0])
        return sum(len(f) for f in self._free)

    def num_free_of(self, owner: int) -> int:
        return len(self._free[owner])

    def can_alloc(self, n: int, owner: int = 0) -> bool:
        return n <= len(self._free[owner])

    def alloc(self, n: int, owner: int = 0) -> list[int] | None:
        """Take `n` pages of owner class `owner`, or None (and nothing taken) when fewer of
        its pages are free."""
        free = self._free[owner]
        if n > len(free):
            return None
        if not self._sorted[owner]:
            free.sort(reverse=True)
            self._sorted[owner] = True
        if n == 0:
            return []
        taken = free[-n:]
        del free[-n:]
        taken.reverse()
        return taken

    def run_counts(self, n: int, first_owner: int = 0) -> list[int]:
        """Pages of each owner class in a run of `n` starting at class `first_owner`."""
        k = self.num_owners
        base, extra = divmod(n, k)
        return [base + int((o - first_owner) % k < extra) for o in range(k)]

    def shortfall(self, n: int, first_owner: int = 0) -> int:
        """Pages missing from the owner classes that a run of `n` starting at `first_owner`
        takes from (0 when `alloc_run` would succeed)."""
        counts = self.run_counts(n, first_owner)
        return sum(max(0, c - len(free)) for c, free in zip(counts, self._free, strict=True))

    def run_fit(self, n: int, first_owner: int = 0) -> int:
        """The longest run of at most `n` pages starting at class `first_owner` that
        `alloc_run` can take now (a prefix of the run: its first short class ends it)."""
        if self.num_owners == 1:
            return min(n, len(self._free[0]))
        left = [len(f) for f in self._free]
        for j in range(n):
            owner = (first_owner + j) % self.num_owners
            if not left[owner]:
                return j
            left[owner] -= 1
        return n

    def alloc_run(self, n: int, first_owner: int = 0) -> list[int] | None:
        """`n` pages continuing an owner cycle: page j is of class `(first_owner + j) %
        num_owners`, lowest free id of its class first. None (and nothing taken) when any
        class is short. With one class this is `alloc(n)`: the same ids in the same order."""
        k = self.num_owners
        if k == 1:
            return self.alloc(n)
        if self.shortfall(n, first_owner):
            return None
        per_class = [self.alloc(c, o) or [] for o, c in enumerate(self.run_counts(n, first_owner))]
        # page j is the (j // k)-th page of its class: the classes take turns, one page each
        return [per_class[(first_owner + j) % k][j // k] for j in range(n)]

    def free(self, page_ids: list[int]) -> None:
        """Return pages, each to its owner class. The caller must own them; a double free
        corrupts the pool."""
        if not page_ids:
            return
        if self.num_owners == 1:
            self._free[0].extend(page_ids)
            self._sorted[0] = False
            return
        for p in page_ids:
            owner = p % self.num_owners
            self._free[owner].append(p)
            self._sorted[owner] = False

    def free_set(self) -> set[int]:
        """Free pages of every owner class."""
        return {p for f in self._free for p in f}

    def reset(self) -> None:
        """Every page free again."""
        k = self.num_owners
        self._free = [list(range(o, self.num_pages, k))[::-1] for o in range(k)]
        self._sorted = [True] * k
