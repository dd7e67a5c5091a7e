"""The radix tree's one walk (`tree_walk.walk`), the verbs built on it that the match/insert
tests of test_radix.py do not reach (`host_prefix`, `cached_len`, `insert_host`), and the
owner rotation of a node's first page (context parallelism, CP size 1 today)."""

from __future__ import annotations

from array import array

import pytest

from bus_schemas.token_ids import as_token_ids
from gpu_worker.cache.radix import HostInsertResult, HostPrefix, PageIds, RadixTree, TreeNode
from gpu_worker.cache.tree_node import next_owner_rotation
from gpu_worker.cache.tree_walk import walk
from gpu_worker.memory.allocator import HostPageId


def dev(*ids: int) -> PageIds:
    return array("q", ids)


def steps(tree: RadixTree, ids: list[int], split: bool) -> list[tuple[list[int], int, int]]:
    q = as_token_ids(ids)
    end = len(q) - len(q) % tree.page_size
    out = walk(tree.root, q, end, tree.page_size, tree._split if split else None)
    return [(list(n.key), start, stop) for n, start, stop in out]


@pytest.mark.parametrize("page_size", [1, 2])
def test_walk_yields_each_node_with_its_token_range(page_size: int) -> None:
    tree = RadixTree(page_size)
    tree.insert([1, 2, 3, 4, 5, 6], dev(*range(6 // page_size)))
    tree.insert([1, 2, 3, 4, 7, 8], dev(*range(10, 10 + 6 // page_size)))
    assert steps(tree, [1, 2, 3, 4, 7, 8, 9, 9], split=False) == [
        ([1, 2, 3, 4], 0, 4),
        ([7, 8], 4, 6),
    ]
    assert steps(tree, [9, 9], split=False) == []  # no child for the first page: nothing
    tree.check_integrity()


def test_walk_without_split_shows_where_the_query_leaves_a_node() -> None:
    tree = RadixTree(2)
    node = tree.insert([1, 2, 3, 4, 5, 6], dev(0, 1, 2)).last_node
    assert steps(tree, [1, 2, 3, 4, 9, 9], split=False) == [([1, 2, 3, 4, 5, 6], 0, 4)]
    assert steps(tree, [1, 2, 3], split=False) == [([1, 2, 3, 4, 5, 6], 0, 2)]  # ends inside
    assert list(node.key) == [1, 2, 3, 4, 5, 6]  # nothing was cut
    assert steps(tree, [1, 2, 3, 4, 9, 9], split=True) == [([1, 2, 3, 4], 0, 4)]
    assert list(node.key) == [5, 6] and node.path_len() == 6  # the lower part kept the object
    tree.check_integrity()


def test_host_prefix_and_cached_len_read_without_changing_the_tree() -> None:
    tree = RadixTree(2)
    a = tree.insert([1, 2, 3, 4], dev(0, 1)).last_node
    tree.insert([1, 2, 3, 4, 5, 6, 7, 8], dev(0, 1, 2, 3))
    start = a.host_covered_len()
    tree.tiers.mark_backup_pending(a, start)
    tree.tiers.lock(a)
    tree.tiers.commit_backup(a, start, [HostPageId(7), HostPageId(8)])
    tree.tiers.unlock(a)
    clock, nodes = tree._clock, sorted(n.id for n in tree.iter_nodes())
    assert tree.host_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9]) == HostPrefix(a, 4)
    assert tree.host_prefix([1, 2, 3]) == HostPrefix(tree.root, 0)  # ends inside a
    assert tree.cached_len([1, 2, 3, 4, 5, 6, 9, 9]) == 6  # leaves the leaf after a page
    assert tree.cached_len([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8
    assert tree.cached_len([1, 2], salt="other") == 0  # no root for that salt
    assert (tree._clock, sorted(n.id for n in tree.iter_nodes())) == (clock, nodes)
    tree.check_integrity()


def test_insert_host_takes_pages_past_the_host_prefix_and_returns_the_rest() -> None:
    tree = RadixTree(2)
    a = tree.insert([1, 2], dev(0)).last_node
    tree.tiers.mark_backup_pending(a, 0)
    tree.tiers.lock(a)
    tree.tiers.commit_backup(a, 0, [HostPageId(5)])
    tree.tiers.unlock(a)
    b = tree.insert([1, 2, 3, 4], dev(0, 1)).last_node  # on the device only
    result = tree.insert_host([1, 2, 3, 4, 5, 6, 7], [HostPageId(6), HostPageId(7)], 2)
    assert isinstance(result, HostInsertResult)
    assert result.dup_end == 2 and result.unused_page_ids == []
    assert b.host_page_ids == array("q", [6]) and b.in_storage
    leaf = result.last_node
    assert list(leaf.key) == [5, 6] and leaf.host_page_ids == array("q", [7])
    assert leaf.device_page_ids is None and leaf.in_storage
    # again: every node already has its host copy, so no page is taken, and `dup_end` is
    # the range's end (the tree got nothing of it from storage)
    again = tree.insert_host([1, 2, 3, 4, 5, 6], [HostPageId(8), HostPageId(9)], 2)
    assert (again.last_node, again.dup_end, again.unused_page_ids) == (leaf, 6, [8, 9])
    tree.check_integrity()


def test_insert_host_skips_host_copies_made_meanwhile_and_takes_what_follows() -> None:
    """A backup that committed while the read ran gave the range's first node its host
    copy: that page is not taken, the node after it still takes its page (before, nothing
    past the first such node was taken, and `dup_end` claimed the rest came from storage)."""
    tree = RadixTree(2)
    tree.insert([1, 2, 3, 4, 5, 6], dev(0, 1, 2))
    tree.match_prefix([1, 2, 3, 4, 9])  # split: a = [1, 2, 3, 4], c = [5, 6]
    a = tree.match_prefix([1, 2, 9]).last_node  # split again: a = [1, 2], b = [3, 4]
    b = tree.match_prefix([1, 2, 3, 4, 9]).last_node
    c = tree.match_prefix([1, 2, 3, 4, 5, 6, 9]).last_node
    assert [list(n.key) for n in (a, b, c)] == [[1, 2], [3, 4], [5, 6]]
    for node, page in ((a, 5), (b, 6)):  # a was on the host at the read's start, b since
        tree.tiers.mark_backup_pending(node, 0 if node is a else 2)
        tree.tiers.lock(node)
        tree.tiers.commit_backup(node, 0 if node is a else 2, [HostPageId(page)])
        tree.tiers.unlock(node)
    result = tree.insert_host([1, 2, 3, 4, 5, 6, 9], [HostPageId(7), HostPageId(8)], 2)
    assert (result.dup_end, result.unused_page_ids) == (4, [7])
    assert c.host_page_ids == array("q", [8]) and c.in_storage and not b.in_storage
    tree.check_integrity()


def test_next_owner_rotation_follows_the_round_robin_cycle() -> None:
    assert next_owner_rotation(3, 2, cp_size=4) == 1
    assert next_owner_rotation(1, 4, cp_size=4) == 1
    for r in range(3):  # a split then the next part equals the unsplit run
        for p in range(5):
            for q in range(5):
                split = next_owner_rotation(next_owner_rotation(r, p, 3), q, 3)
                assert split == next_owner_rotation(r, p + q, 3)
    assert next_owner_rotation(5, 7) == 0  # CP size 1: always 0


def test_split_and_new_nodes_keep_owner_rotations_consistent() -> None:
    """Every node's rotation is its parent's plus the parent's pages (check_integrity checks
    it); with CP size 1 that is 0 everywhere, through splits and new leaves."""
    tree = RadixTree(2)
    n = tree.insert(list(range(12)), dev(*range(6))).last_node
    tree.match_prefix(list(range(6)))  # split after 3 pages
    tree.insert([*range(8), 99, 99], dev(*range(10, 15)))  # split again, plus a new leaf
    nodes: list[TreeNode] = list(tree.iter_nodes())
    assert len(nodes) == 4 and all(x.owner_rotation == 0 for x in nodes)
    tree.check_integrity()
    n.owner_rotation = 1  # off its path's cycle
    with pytest.raises(AssertionError, match="owner rotation"):
        tree.check_integrity()


def test_owner_rotations_follow_the_path_with_three_cp_ranks() -> None:
    """With CP size 3, a node starting at page p of its path has rotation p % 3, whatever
    splits and leaves made it."""
    tree = RadixTree(2, cp_size=3)
    tree.insert(list(range(14)), dev(*range(7)))  # one node, pages 0..6
    tree.match_prefix(list(range(4)))  # split after 2 pages: the lower part starts at page 2
    # split after page 5, new leaf: the path's pages 0..4 plus page 8 (owner 8 % 3 == 5 % 3)
    tree.insert([*range(10), 99, 99], dev(0, 1, 2, 3, 4, 8))
    starts = {}
    for node in tree.iter_nodes():
        start = node.path_len() - len(node.key)
        starts[start // 2] = node.owner_rotation
    assert starts == {0: 0, 2: 2, 5: 2}, starts
    tree.check_integrity()
    with pytest.raises(ValueError, match="cp_size"):
        RadixTree(2, cp_size=0)
