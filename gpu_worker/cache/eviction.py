"""Eviction from the radix tree: least recently used unpinned leaves first, per tier.

A tier's candidates are its *leaves* there: on the device, a node with device pages, no
`lock_ref` and no child on the device (`device_leaf`); on the host, a node with host pages,
no `host_ref`, no backup in flight and no child on the host or getting there (`host_leaf`).
They are kept incrementally (`EvictionHeap`), so an eviction costs O(log n), not a scan of
every node, and are taken in `(last_access, id)` order: a logical clock, never wall-clock
time, so every rank evicts the same nodes.

`evict_device` and `evict_host` are the policy (which node next, what to do with one that
has no backup, which parent becomes a candidate); the tree's tier state
(`tree_tiers.TreeTiers`) does the drop itself (its page counters, KV events and child links),
through the `drop` it passes. This module knows nothing of the tree: a node is anything with
the attributes of `EvictableNode`, so it imports nothing of the tree's modules.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar


class EvictableNode(Protocol):
    """The attributes of a tree node that eviction reads."""

    @property
    def id(self) -> int: ...

    @property
    def last_access(self) -> int: ...

    @property
    def parent(self) -> Any: ...

    @property
    def children(self) -> dict[Any, Any]: ...

    @property
    def device_page_ids(self) -> array[Any] | None: ...

    @property
    def host_page_ids(self) -> array[Any] | None: ...

    @property
    def lock_ref(self) -> int: ...

    @property
    def host_ref(self) -> int: ...

    @property
    def backup_pending(self) -> bool: ...


N = TypeVar("N", bound=EvictableNode)


def device_leaf(n: EvictableNode) -> bool:
    """`n` may drop its device pages now: unlocked, and no child is on the device. (`not
    n.children` first: most nodes offered are new leaves, and `any` would build a generator
    to look at none.)"""
    return (
        n.parent is not None
        and n.device_page_ids is not None
        and n.lock_ref == 0
        and (not n.children or not any(c.device_page_ids is not None for c in n.children.values()))
    )


def host_leaf(n: EvictableNode) -> bool:
    """`n` may drop its host pages now: unpinned, no backup in flight, and no child is on
    the host or getting there."""
    return (
        n.host_page_ids is not None
        and n.host_ref == 0
        and not n.backup_pending
        and (
            not n.children
            or not any(c.host_page_ids is not None or c.backup_pending for c in n.children.values())
        )
    )


class EvictionHeap(Generic[N]):
    """The eviction candidates of one tier, kept incrementally: a heap with lazy invalidation.

    Rebuilding a heap from every node on each eviction cost 51 ms at 50k nodes; this costs
    O(log n) per eviction and nothing per match. Invariant (checked by `check`): every node
    that is `eligible` now is in `members` and has exactly one entry `(key, id, node)` in
    `entries`, with `key <= node.last_access`; no node has two entries. An entry may be
    stale: its node is no longer eligible (dropped when popped), or was accessed since it
    was pushed (pushed again with its current `last_access` when popped). `last_access` only
    grows, so the first fresh entry popped is the eligible node with the smallest
    `(last_access, id)`: exactly the order of a heap built from scratch. The tree calls
    `offer` wherever a node may have *become* eligible; losing eligibility needs no call.
    """

    __slots__ = ("eligible", "entries", "members")

    def __init__(self, eligible: Callable[[N], bool]) -> None:
        self.eligible = eligible
        self.entries: list[tuple[int, int, N]] = []
        self.members: set[N] = set()

    def offer(self, node: N) -> None:
        """Give `node` an entry if it is eligible and has none."""
        if node not in self.members and self.eligible(node):
            self.members.add(node)
            heapq.heappush(self.entries, (node.last_access, node.id, node))

    def pop(self) -> N | None:
        """Remove and return the eligible node with the smallest (last_access, id), or None."""
        entries, eligible = self.entries, self.eligible
        while entries:
            key, node_id, node = entries[0]
            if not eligible(node):
                heapq.heappop(entries)
                self.members.discard(node)
            elif key != node.last_access:
                heapq.heapreplace(entries, (node.last_access, node_id, node))
            else:
                heapq.heappop(entries)
                self.members.discard(node)
                return node
        return None

    def clear(self) -> None:
        self.entries.clear()
        self.members.clear()

    def order(self) -> list[N]:
        """The eligible nodes in the order `pop` would return them (on a copy; nothing moves)."""
        entries, out = list(self.entries), []
        while entries:
            key, node_id, node = heapq.heappop(entries)
            if not self.eligible(node):
                continue
            if key != node.last_access:
                heapq.heappush(entries, (node.last_access, node_id, node))
            else:
                out.append(node)
        return out

    def check(self, nodes: list[N], tier: str) -> None:
        """Assert that this incremental structure agrees with a from-scratch computation."""
        in_entries = [n for _, _, n in self.entries]
        assert len(set(in_entries)) == len(in_entries), f"{tier} heap: a node twice"
        assert set(in_entries) == self.members, f"{tier} heap: members differ from entries"
        assert self.members <= set(nodes), f"{tier} heap: holds a node not in the tree"
        assert all(k <= n.last_access for k, _, n in self.entries), f"{tier} heap: key ahead"
        for i in range(1, len(self.entries)):
            assert self.entries[(i - 1) // 2][:2] <= self.entries[i][:2], f"{tier} heap: order"
        scratch = sorted(
            (n for n in nodes if self.eligible(n)), key=lambda n: (n.last_access, n.id)
        )
        assert self.order() == scratch, f"{tier} heap: eviction order differs from a rebuild"


def evict_device(
    heap: EvictionHeap[N], num_pages: int, delete_unbacked: bool, drop: Callable[[N], None]
) -> tuple[list[int], list[N]]:
    """Free at least `num_pages` device pages, least recently used unlocked leaves first.

    Returns the freed pages and the leaves kept because they have no host copy (only with
    `delete_unbacked=False`): the caller backs them up first. `drop(node)` takes a node's
    device copy away (deleting the node when it has no host copy either); its parent may
    then become a candidate.
    """
    freed: list[int] = []
    unbacked: list[N] = []
    while len(freed) < num_pages:
        node = heap.pop()
        if node is None:
            break
        assert node.device_page_ids is not None
        if node.host_page_ids is None and not delete_unbacked:
            unbacked.append(node)
            continue
        freed += node.device_page_ids
        parent = node.parent
        drop(node)
        heap.offer(parent)
    for node in unbacked:  # still candidates once backed up
        heap.offer(node)
    return freed, unbacked


def evict_host(heap: EvictionHeap[N], num_pages: int, drop: Callable[[N], None]) -> list[int]:
    """Free at least `num_pages` host pages from least recently used unpinned host leaves.

    `drop(node)` takes a node's host copy away (deleting the node when it is not on the
    device); its parent may then become a candidate.
    """
    freed: list[int] = []
    while len(freed) < num_pages:
        node = heap.pop()
        if node is None:
            break
        assert node.host_page_ids is not None
        freed += node.host_page_ids
        parent = node.parent
        drop(node)
        heap.offer(parent)
    return freed
