"""Page ownership under context parallelism (CP): which rank keeps a logical page, and where.

For `N` shard ranks (`cp_size`), page size `p` and a logical slot `x` (DESIGN section 4):

    q = x // p                        # the logical page
    r = q % N                         # its owner rank
    l = (q // N) * p + x % p          # the row of rank r's device pool that holds x

Every CP rank keeps the same logical tree, page ids and allocator (whose owner class of page
`q` is `q % N`, `memory/allocator.py`); only the pool translates. The mapping is arithmetic,
so no per-page table exists to drift between ranks. Rank `r`'s local page `j` is logical page
`j * N + r`: every rank's pool has `ceil(num_pages / N)` local pages, the last of which is
unused on ranks that own one page fewer.

The integer functions are torch-free; the `*_rows` / `owned_mask` helpers take and return
int64 tensors of slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class CPLayout:
    """Ownership of pages of `page_size` tokens over `cp_size` shard ranks."""

    page_size: int  # p
    cp_size: int  # N

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.cp_size <= 0:
            raise ValueError(f"CPLayout sizes must be positive: {self}")

    # -- pages (torch-free)

    def owner_of_page(self, page_id: int) -> int:
        """r = q % N."""
        return page_id % self.cp_size

    def local_page(self, page_id: int) -> int:
        """The owner's local page of logical page `q`: q // N."""
        return page_id // self.cp_size

    def logical_page(self, local_page: int, rank: int) -> int:
        """The logical page that rank `rank` keeps at `local_page` (the inverse of
        `local_page` for the owner): local_page * N + rank."""
        return local_page * self.cp_size + rank

    def num_local_pages(self, num_pages: int) -> int:
        """Pages of each rank's pool for `num_pages` logical pages: ceil(num_pages / N), the
        same on every rank so pools (and the gather's chunks) have one size."""
        return -(-num_pages // self.cp_size)

    def owned_pages(self, page_ids: list[int], rank: int) -> list[int]:
        """The pages of `page_ids` that `rank` owns, in their order of appearance (the order
        in which the gather packs them)."""
        return [q for q in page_ids if q % self.cp_size == rank]

    def max_owned(self, page_ids: list[int]) -> int:
        """The most pages of `page_ids` any one rank owns: the gather's chunk, in pages."""
        counts = [0] * self.cp_size
        for q in page_ids:
            counts[q % self.cp_size] += 1
        return max(counts)

    # -- slots (tensors)

    def owner_of_slots(self, slot_ids: torch.Tensor) -> torch.Tensor:
        """(n,) int64 logical slots -> (n,) int64 owner ranks: (x // p) % N."""
        return torch.div(slot_ids, self.page_size, rounding_mode="floor") % self.cp_size

    def owned_mask(self, slot_ids: torch.Tensor, rank: int) -> torch.Tensor:
        """(n,) int64 logical slots -> (n,) bool: True where `rank` owns the slot."""
        return self.owner_of_slots(slot_ids) == rank

    def local_rows(self, slot_ids: torch.Tensor) -> torch.Tensor:
        """(n,) int64 logical slots -> (n,) int64 rows of their owners' pools:
        (x // p // N) * p + x % p. Meaningful only on the owner (see `owned_mask`)."""
        p = self.page_size
        q = torch.div(slot_ids, p, rounding_mode="floor")
        return torch.div(q, self.cp_size, rounding_mode="floor") * p + slot_ids % p

    def logical_slots(self, local_rows: torch.Tensor, rank: int) -> torch.Tensor:
        """(n,) int64 rows of rank `rank`'s pool -> (n,) int64 logical slots they hold."""
        p = self.page_size
        j = torch.div(local_rows, p, rounding_mode="floor")
        return (j * self.cp_size + rank) * p + local_rows % p
