"""`check_integrity` of the radix tree: every invariant, recomputed from scratch.

Tests call it after every step; the cache calls it from its own check. It only reads.
"""

from __future__ import annotations

from array import array

from gpu_worker.cache.tree_node import TreeNode, next_owner_rotation, owner_cycle_break
from gpu_worker.cache.tree_tiers import TreeTiers
from gpu_worker.cache.tree_walk import child_key


def check_integrity(
    page_size: int, nodes: list[TreeNode], tiers: TreeTiers, cp_size: int = 1
) -> None:
    """Raise AssertionError if any invariant of a tree is broken: `nodes` are all of its
    nodes but the roots, `tiers` its tier state, `cp_size` the CP ranks its pages go
    round-robin over."""
    ps = page_size
    device_seen: set[int] = set()
    host_seen: set[int] = set()
    num_device = num_locked = num_host = 0
    for n in nodes:
        parent = n.parent
        assert parent is not None
        assert n.key and len(n.key) % ps == 0, f"{n!r}: key not whole pages"
        assert isinstance(n.key, array) and n.key.typecode == "I", f"{n!r}: key not TokenIds"
        assert parent.children.get(child_key(n.key, ps)) is n, f"{n!r}: bad child link"
        assert n.on_device or n.on_host, f"{n!r}: holds no KV"
        _check_pins(n)
        rotation = next_owner_rotation(parent.owner_rotation, len(parent.key) // ps, cp_size)
        assert n.owner_rotation == rotation, f"{n!r}: owner rotation breaks its path's cycle"
        top = parent.parent is None
        if n.on_device:
            assert top or parent.on_device, f"{n!r}: on device, parent is not"
            assert n.device_page_ids is not None and len(n.device_page_ids) == len(n.key) // ps
            assert device_seen.isdisjoint(n.device_page_ids), f"{n!r}: device page twice"
            broken = owner_cycle_break(n.device_page_ids, n.owner_rotation, cp_size)
            assert broken is None, f"{n!r}: its page {broken} breaks the owner cycle"
            device_seen.update(n.device_page_ids)
            num_device += len(n.device_page_ids)
            num_locked += len(n.device_page_ids) if n.lock_ref else 0
        else:
            assert n.lock_ref == 0, f"{n!r}: locked but not on device"
        if n.on_host:
            assert not n.backup_pending, f"{n!r}: on host and pending"
            assert top or parent.on_host, f"{n!r}: on host, parent is not (prefix-closed)"
            assert n.host_page_ids is not None and len(n.host_page_ids) == len(n.key) // ps
            assert host_seen.isdisjoint(n.host_page_ids), f"{n!r}: host page twice"
            host_seen.update(n.host_page_ids)
            num_host += len(n.host_page_ids)
        if n.backup_pending:
            assert n.on_device and n.lock_ref > 0, f"{n!r}: pending backup not locked"
            assert top or parent.on_host or parent.backup_pending, f"{n!r}: backup gap"
    assert (num_device, num_locked, num_host) == (
        tiers.num_device_pages,
        tiers.num_locked_device_pages,
        tiers.num_host_pages,
    ), "page counters drifted"
    tiers.device_heap.check(nodes, "device")
    tiers.host_heap.check(nodes, "host")


def _check_pins(n: TreeNode) -> None:
    """A pin on a node pins its whole path: no node has fewer pins than its children."""
    child_locks = sum(c.lock_ref for c in n.children.values())
    assert n.lock_ref >= child_locks, f"{n!r}: lock_ref below its children's"
    child_refs = sum(c.host_ref for c in n.children.values())
    assert n.host_ref >= child_refs, f"{n!r}: host_ref below its children's"
