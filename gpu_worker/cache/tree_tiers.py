"""The tier state of the radix tree's nodes: their pages per tier, the pins on them, and
every move between tiers.

`TreeTiers` is the one owner of the state that must change in step with a node's pages: the
page counters, the two eviction heaps (a node may become a candidate at any change here) and
the KV-event log (every tier change is recorded in the order it happens). The tree
(`radix.py`) owns the shape (keys, links, splits) and hands the pages it attaches to
`add_device` / `add_host`; everything else that changes a node's tier goes through here.

Tier moves are committed only after the transfer engine's ACK for them was consumed
(`commit_backup`, `commit_load`): this class never moves data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

from gpu_worker.cache import eviction
from gpu_worker.cache.eviction import EvictionHeap
from gpu_worker.cache.kv_events import KVEventLog
from gpu_worker.cache.tree_node import PageIds, TreeNode, page_ids_of
from gpu_worker.cache.tree_walk import child_key
from gpu_worker.consensus.checker import rank_consensus
from gpu_worker.memory.allocator import HostPageId, PageId


@dataclass(slots=True)
class EvictResult:
    freed_page_ids: list[int] = field(default_factory=list)
    unbacked: list[TreeNode] = field(default_factory=list)  # leaves kept: need a backup first


class TreeTiers:
    """Pages per tier, pins and tier moves of one tree's nodes (see the module docstring)."""

    def __init__(self, page_size: int, event_log: KVEventLog) -> None:
        self.page_size = page_size
        self.event_log = event_log
        self.device_heap: EvictionHeap[TreeNode] = EvictionHeap(eviction.device_leaf)
        self.host_heap: EvictionHeap[TreeNode] = EvictionHeap(eviction.host_leaf)
        self.num_device_pages = 0  # device pages held by the tree
        self.num_locked_device_pages = 0  # of those, pinned by lock_ref > 0
        self.num_host_pages = 0

    @property
    def num_evictable_device_pages(self) -> int:
        return self.num_device_pages - self.num_locked_device_pages

    # ----------------------------------------------------------------- pages in

    def add_device(self, node: TreeNode, pages: PageIds) -> None:
        """`node` (linked and hashed, not on the device) now holds its KV in device `pages`."""
        node.device_page_ids = pages
        self.num_device_pages += len(pages)
        if node.lock_ref > 0:
            self.num_locked_device_pages += len(pages)
        self.event_log.record("stored", "device", node)
        self.device_heap.offer(node)

    def add_host(self, node: TreeNode, pages: PageIds) -> None:
        """`node` (linked and hashed, not on the host) now has a host copy in `pages`."""
        node.host_page_ids = pages
        self.num_host_pages += len(pages)
        self.event_log.record("stored", "host", node)
        self.host_heap.offer(node)

    # ----------------------------------------------------------------- pins

    def lock(self, node: TreeNode) -> None:
        """Pin the device pages of `node` and its ancestors (a running request reads them)."""
        while node.parent is not None:
            if node.lock_ref == 0 and node.device_page_ids is not None:
                self.num_locked_device_pages += len(node.device_page_ids)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0 and node.device_page_ids is not None:
                self.num_locked_device_pages -= len(node.device_page_ids)
                self.device_heap.offer(node)
            node = node.parent

    def ref_host(self, node: TreeNode) -> None:
        """Pin the host pages of `node` and its ancestors (a load or backup reads them)."""
        while node.parent is not None:
            node.host_ref += 1
            node = node.parent

    def unref_host(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.host_ref <= 0:
                raise RuntimeError(f"unref_host of an unpinned node {node!r}")
            node.host_ref -= 1
            if node.host_ref == 0:
                self.host_heap.offer(node)
            node = node.parent

    # ----------------------------------------------------------------- tier moves

    def mark_backup_pending(self, last_node: TreeNode, start_len: int) -> int:
        """Mark the nodes from `start_len` to `last_node` as having a backup in flight.

        Returns the number of pages they hold. The caller issues the copy and keeps the
        nodes device-locked until `commit_backup`.
        """
        pages = 0
        for _, n in last_node.path_range(start_len):
            assert n.device_page_ids is not None and n.host_page_ids is None
            n.backup_pending = True
            pages += len(n.device_page_ids)
        return pages

    def commit_backup(
        self, last_node: TreeNode, start_len: int, host_page_ids: Sequence[HostPageId]
    ) -> None:
        """A backup's ACK was consumed: the nodes from `start_len` get their host pages."""
        ps = self.page_size
        host = page_ids_of(host_page_ids)
        for pos, n in last_node.path_range(start_len):
            assert n.backup_pending and n.host_page_ids is None
            lo = (pos - start_len) // ps
            n.backup_pending = False
            self.add_host(n, host[lo : lo + len(n.key) // ps])

    def abort_backup(self, last_node: TreeNode, start_len: int) -> None:
        """A backup's copy failed: the nodes from `start_len` are no longer pending."""
        nodes = last_node.path_range(start_len)
        for _, n in nodes:
            n.backup_pending = False
        if nodes:  # a pending child no longer keeps the covered part from eviction
            parent = nodes[0].node.parent
            assert parent is not None
            self.host_heap.offer(parent)

    def commit_load(
        self, last_node: TreeNode, start_len: int, page_ids: Sequence[PageId]
    ) -> list[PageId]:
        """A load-back's ACK was consumed: host-only nodes from `start_len` get device pages.

        Returns the loaded pages the tree did not take (a node that became device-resident
        in the meantime, through `insert`, keeps its own pages): the caller frees them.
        """
        ps = self.page_size
        loaded = page_ids_of(page_ids)
        unused: list[PageId] = []
        for pos, n in last_node.path_range(start_len):
            lo = (pos - start_len) // ps
            pages = loaded[lo : lo + len(n.key) // ps]
            if n.device_page_ids is None:
                self.add_device(n, pages)
            else:
                unused += pages
        return unused

    # ----------------------------------------------------------------- eviction

    @rank_consensus(
        same_params=["num_pages", "delete_unbacked"],
        same_results=["list(result.freed_page_ids)", "[n.id for n in result.unbacked]"],
    )
    def evict_device(self, num_pages: int, delete_unbacked: bool = True) -> EvictResult:
        """Free at least `num_pages` device pages, least recently used unlocked leaves first.

        A leaf with a host copy drops to HOST. A leaf without one is deleted, or, with
        `delete_unbacked=False` (write-back), kept and listed in `unbacked` for the caller to
        back up first.
        """
        freed, unbacked = eviction.evict_device(
            self.device_heap, num_pages, delete_unbacked, self._drop_device
        )
        return EvictResult(freed, unbacked)

    def _drop_device(self, node: TreeNode) -> None:
        assert node.device_page_ids is not None
        self.num_device_pages -= len(node.device_page_ids)
        self.event_log.record("removed", "device", node)
        node.device_page_ids = None
        if node.host_page_ids is None:
            assert not node.children and node.host_ref == 0
            self._unlink(node)

    @rank_consensus(same_params=["num_pages"], same_results=["result"])
    def evict_host(self, num_pages: int) -> list[HostPageId]:
        """Free at least `num_pages` host pages from least recently used unpinned host leaves.

        A node that is also on the device keeps its device copy; a host-only node is deleted.
        """
        freed = eviction.evict_host(self.host_heap, num_pages, self._drop_host)
        return cast(list[HostPageId], freed)

    def _drop_host(self, node: TreeNode) -> None:
        assert node.host_page_ids is not None
        self.num_host_pages -= len(node.host_page_ids)
        self.event_log.record("removed", "host", node)
        node.host_page_ids = None
        if node.device_page_ids is None:
            assert not node.children and node.lock_ref == 0
            self._unlink(node)

    def _unlink(self, node: TreeNode) -> None:
        """Take `node`, which now holds nothing on any tier, out of the tree."""
        parent = node.parent
        assert parent is not None
        del parent.children[child_key(node.key, self.page_size)]

    def clear(self) -> None:
        """Forget every page (the tree dropped every node)."""
        self.device_heap.clear()
        self.host_heap.clear()
        self.num_device_pages = self.num_locked_device_pages = self.num_host_pages = 0
