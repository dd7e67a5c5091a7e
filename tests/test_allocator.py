"""The page allocator: lowest ids first, exact ids, and one free list per owner class."""

from __future__ import annotations

import pytest

from gpu_worker.memory.allocator import PageAllocator


def test_one_owner_hands_out_the_lowest_free_ids() -> None:
    a = PageAllocator(6)
    assert a.alloc(2) == [0, 1] and a.alloc(1) == [2]
    a.free([1, 0])
    assert a.num_free == 5 and a.free_set() == {0, 1, 3, 4, 5}
    assert a.alloc(3) == [0, 1, 3]
    assert a.alloc(3) is None and a.num_free == 2  # nothing taken
    assert a.alloc(0) == [] and a.can_alloc(2) and not a.can_alloc(3)
    a.reset()
    assert a.alloc(6) == [0, 1, 2, 3, 4, 5]


def test_two_owner_classes_each_hand_out_their_own_pages() -> None:
    a = PageAllocator(7, num_owners=2)
    assert (a.num_free, a.num_free_of(0), a.num_free_of(1)) == (7, 4, 3)
    assert a.alloc(2, owner=0) == [0, 2] and a.alloc(2, owner=1) == [1, 3]
    assert a.alloc(1) == [4]  # owner class 0 by default
    assert a.alloc(2, owner=1) is None and a.num_free_of(1) == 1  # nothing taken
    a.free([3, 0, 2])  # each page back to its own class
    assert (a.num_free_of(0), a.num_free_of(1)) == (3, 2)
    assert a.free_set() == {0, 2, 3, 5, 6}
    assert a.alloc(2, owner=1) == [3, 5] and a.alloc(3, owner=0) == [0, 2, 6]
    assert a.num_free == 0 and not a.can_alloc(1, owner=0)
    a.reset()
    assert a.alloc(4, owner=0) == [0, 2, 4, 6] and a.alloc(3, owner=1) == [1, 3, 5]


def test_owner_classes_must_fit_the_pool() -> None:
    with pytest.raises(ValueError, match="cannot have 3 owners"):
        PageAllocator(2, num_owners=3)
    with pytest.raises(ValueError, match="at least one page"):
        PageAllocator(0)
