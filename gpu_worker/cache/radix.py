"""The page-aligned radix tree over token ids, with per-node tier state.

A node owns a run of whole pages of tokens. Its KV lives on the device (`device_page_ids`),
on the host (`host_page_ids`), or both. Two sets stay prefix-closed, and
`check_integrity()` verifies it: the nodes on the device, and the nodes on the host (a
node is on a tier only if its parent is). So a matched path is always a device part
followed by a host-only part.

The tree is written by one thread only (the scheduler). It never moves data: tier moves are
committed after the transfer engine's ACK for them has been consumed (`commit_backup`,
`commit_load`). Splits keep the original node object as the *lower* part, so a node held as
"the end of a path" by a lock or an in-flight transfer still ends the same token path after
any split.

LRU order uses a logical clock, never wall-clock time, so every rank evicts the same nodes.

The parts, one job each: `RadixTree` (here) owns the shape: keys, child links, splits, roots
per salt, and the verbs that follow a query key, all through one walk (`tree_walk.walk`);
`tree_node.py` the node and the queries along a node's path; `tree_tiers.TreeTiers` the
pages per tier, pins, tier moves and eviction (policy in `eviction.py`, KV-event records in
`kv_events.py`), reached as `tree.tiers` (`tree.tiers.lock(node)`); `tree_check.py` the
integrity check.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from bus_schemas.page_hash import chain_hashes, root_hash
from bus_schemas.token_ids import TokenIds, as_token_ids
from gpu_worker.cache import kv_events, tree_check
from gpu_worker.cache.kv_events import KVEventLog, KVEventRecord
from gpu_worker.cache.tree_node import (
    PageIds,
    Tier,
    TreeNode,
    join_page_ids,
    next_owner_rotation,
    owner_cycle_break,
    page_ids_of,
)
from gpu_worker.cache.tree_tiers import EvictResult, TreeTiers
from gpu_worker.cache.tree_walk import walk
from gpu_worker.memory.allocator import HostPageId, PageId

__all__ = [
    "DroppedPages",
    "EvictResult",
    "HostInsertResult",
    "HostPrefix",
    "InsertResult",
    "KVEventRecord",
    "MatchResult",
    "PageIds",
    "RadixTree",
    "Tier",
    "TreeNode",
    "page_ids_of",
]


class MatchResult(NamedTuple):
    """The longest cached page-aligned prefix of a query.

    Tokens `[0, device_len)` are on the device in `device_page_ids`; tokens
    `[device_len, device_len + host_len)` are only on the host, in `host_page_ids`. Both are
    `array('q')` (a fresh one per match: the caller may keep it).

    A NamedTuple, not a frozen dataclass: equally immutable and typed, but built in a third of
    the time (a frozen dataclass's `__init__` cost ~1 us of a ~5 us match).
    """

    device_len: int
    host_len: int
    device_page_ids: PageIds  # of PageId
    host_page_ids: PageIds  # of HostPageId
    last_device_node: TreeNode  # end of the device part (the root when device_len == 0)
    last_node: TreeNode  # end of the whole match

    @property
    def total_len(self) -> int:
        return self.device_len + self.host_len


class InsertResult(NamedTuple):
    """`dup_len`: tokens whose device pages the tree already held; `last_node`: end of the path.
    A NamedTuple for the reason `MatchResult` is one: built once per insert."""

    dup_len: int
    last_node: TreeNode


@dataclass(frozen=True, slots=True)
class HostPrefix:
    """The deepest node of a query's path whose whole path is on the host, and that path's
    length in tokens (`host_len`; the root and 0 when the first node is not on the host)."""

    node: TreeNode
    host_len: int


@dataclass(frozen=True, slots=True)
class HostInsertResult:
    """What `insert_host` made of pages read from storage.

    `last_node`: the last node attached to (or the path's end); `dup_end`: tokens up to
    which the tree already had the host copy (what was attached is `[dup_end, ...)`);
    `unused_page_ids`: the pages the tree did not take, which the caller frees.
    """

    last_node: TreeNode
    dup_end: int
    unused_page_ids: list[HostPageId]


@dataclass(frozen=True, slots=True)
class DroppedPages:
    """The pages of every node `reset` dropped, per tier."""

    device_page_ids: list[PageId]
    host_page_ids: list[HostPageId]


class RadixTree:
    """Page-aligned radix tree. See the module docstring for the invariants."""

    def __init__(
        self,
        page_size: int,
        namespace: str | None = None,
        record_events: bool = True,
        cp_size: int = 1,
    ) -> None:
        """With a `namespace`, nodes carry chained page hashes (bus_schemas.page_hash: the
        names of their objects in external storage) and, with `record_events`, every tier
        change is recorded in `event_log` for the KV-event stream. `cp_size`: the CP ranks
        a path's pages go round-robin over (`TreeNode.owner_rotation`)."""
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if cp_size <= 0:
            raise ValueError(f"cp_size must be positive, got {cp_size}")
        self.page_size = page_size
        self.cp_size = cp_size
        self._splitter = self._split  # bound once: the walks of every request pass it
        self.namespace = namespace
        self.record_events = record_events
        self.event_log = KVEventLog(namespace is not None and record_events, cp_size)
        self.tiers = TreeTiers(page_size, self.event_log)
        self._next_id = 0
        self._clock = 0
        self.roots: dict[str, TreeNode] = {}  # one root per cache_salt: salts never share KV
        self.root = self._root_for("")

    # ----------------------------------------------------------------- shape

    def _root_for(self, salt: str) -> TreeNode:
        root = self.roots.get(salt)
        if root is None:
            root = self._new_node(None, array("I"))
            root.lock_ref = 1  # a root is never evicted
            if self.namespace is not None:
                root.page_hashes = [root_hash(self.namespace, salt)]
            self.roots[salt] = root
        return root

    def _new_node(self, parent: TreeNode | None, key: TokenIds, clock: int = 0) -> TreeNode:
        """A node for `key`, linked under `parent` (with its page hashes and owner rotation
        continuing the parent's); the caller gives it its pages."""
        node = TreeNode(self._next_id, parent, key)
        self._next_id += 1
        node.last_access = clock
        if parent is not None:
            ps = self.page_size  # `child_key` inlined: one node per insert
            parent.children[key[0] if ps == 1 else key[:ps].tobytes()] = node
            if self.cp_size > 1:  # else every rotation is 0 (TreeNode's default)
                node.owner_rotation = next_owner_rotation(
                    parent.owner_rotation, len(parent.key) // self.page_size, self.cp_size
                )
            if self.namespace is not None:
                assert parent.page_hashes is not None
                node.page_hashes = chain_hashes(parent.page_hashes[-1], key, self.page_size)
        return node

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut `node` at token offset `at`; the new *upper* node is returned.

        The original object keeps the lower part, so references to it as a path end stay valid.
        """
        ps = self.page_size
        parent = node.parent
        assert parent is not None and 0 < at < len(node.key) and at % ps == 0
        upper = TreeNode(self._next_id, parent, node.key[:at])
        self._next_id += 1
        upper.lock_ref = node.lock_ref
        upper.host_ref = node.host_ref
        upper.last_access = node.last_access
        upper.hit_count = node.hit_count
        upper.backup_pending = node.backup_pending
        upper.in_storage = node.in_storage
        upper.owner_rotation = node.owner_rotation
        pages = at // ps
        if self.cp_size > 1:
            node.owner_rotation = next_owner_rotation(node.owner_rotation, pages, self.cp_size)
        if node.device_page_ids is not None:
            upper.device_page_ids = node.device_page_ids[:pages]
            node.device_page_ids = node.device_page_ids[pages:]
        if node.host_page_ids is not None:
            upper.host_page_ids = node.host_page_ids[:pages]
            node.host_page_ids = node.host_page_ids[pages:]
        if node.page_hashes is not None:
            upper.page_hashes = node.page_hashes[:pages]
            node.page_hashes = node.page_hashes[pages:]
        key = node.key
        # `child_key` inlined: a split is on the path of the match that causes it
        parent.children[key[0] if ps == 1 else key[:ps].tobytes()] = upper
        node.key = key = key[at:]
        node.parent = upper
        upper.children[key[0] if ps == 1 else key[:ps].tobytes()] = node
        if node.device_page_ids is None:  # else its one child is on the device: not a leaf
            self.tiers.device_heap.offer(upper)  # on device above a host-only lower part
        return upper

    # ----------------------------------------------------------------- verbs along a key

    def match_prefix(self, ids: Sequence[int] | TokenIds, salt: str = "") -> MatchResult:
        """Longest cached page-aligned prefix of `ids`; marks the path as recently used.

        Splits a node where the match ends inside it, so `last_node` ends exactly at the match.
        Counts a hit on every matched node (for write_through_selective). Pass an
        `array('I')` (TokenIds): a list is converted first, once per call.
        """
        q = ids if type(ids) is array and ids.typecode == "I" else as_token_ids(ids)
        self._clock += 1
        clock = self._clock
        root = node = last_device = self.roots.get(salt) or self._root_for(salt)
        pos = device_len = 0
        device_parts: list[PageIds] = []  # joined once at the end: `array +=` per node
        host_parts: list[PageIds] = []  # reallocates (arrays grow by 1/16) and cost 3x more
        end = len(q) - len(q) % self.page_size
        for node, _, pos in walk(root, q, end, self.page_size, self._splitter):
            node.last_access = clock
            node.hit_count += 1
            pages = node.device_page_ids
            if pages is not None:
                device_parts.append(pages)
                last_device, device_len = node, pos
            else:
                assert node.host_page_ids is not None
                host_parts.append(node.host_page_ids)
        # `tuple.__new__` skips the NamedTuple's Python-level `__new__` (0.24 -> 0.11 us);
        # an empty part list (every miss; the host part of most hits) skips the join's call
        return tuple.__new__(
            MatchResult,
            (
                device_len,
                pos - device_len,
                join_page_ids(device_parts) if device_parts else array("q"),
                join_page_ids(host_parts) if host_parts else array("q"),
                last_device,
                node,
            ),
        )

    def insert(
        self, ids: Sequence[int] | TokenIds, page_ids: Sequence[int], salt: str = ""
    ) -> InsertResult:
        """Insert a page-aligned prefix of `ids` whose KV is in device pages `page_ids`.

        Returns `dup_len` and the path's last node: the tree already held device pages for
        tokens `[0, dup_len)`, so the caller's pages for that range are not taken (the caller
        frees those it allocated itself). Every page past `dup_len` now belongs to the tree:
        host-only nodes on the path take the caller's pages as their device copy, new nodes
        are created for the rest.

        With `cp_size` > 1 the page for path position k must be of owner class k % cp_size
        (a root's path starts at rotation 0): pages of another rotation would join two
        incompatible owner cycles, so such an insert raises ValueError and changes nothing.
        """
        q = ids if type(ids) is array and ids.typecode == "I" else as_token_ids(ids)
        ps = self.page_size
        end = len(q) - len(q) % ps
        if len(page_ids) < end // ps:
            raise ValueError(
                f"insert needs {end // ps} pages for {end} tokens, got {len(page_ids)}"
            )
        if self.cp_size > 1:
            k = owner_cycle_break(page_ids[: end // ps], 0, self.cp_size)
            if k is not None:
                raise ValueError(
                    f"insert: device page {page_ids[k]} at path page {k} is owned by CP rank "
                    f"{page_ids[k] % self.cp_size}, the path's cycle needs rank "
                    f"{k % self.cp_size} (cp_size {self.cp_size})"
                )
        self._clock += 1
        clock = self._clock
        root = node = self.roots.get(salt) or self._root_for(salt)
        pos = dup_len = 0
        for node, start, pos in walk(root, q, end, ps, self._splitter):
            node.last_access = clock
            if node.device_page_ids is None:  # host-only: the caller's pages revive it
                self.tiers.add_device(node, page_ids_of(page_ids[start // ps : pos // ps]))
            else:
                dup_len = pos
        if pos < end:
            node = self._new_node(node, q[pos:end], clock)
            self.tiers.add_device(node, page_ids_of(page_ids[pos // ps : end // ps]))
        return tuple.__new__(InsertResult, (dup_len, node))

    def host_prefix(self, ids: Sequence[int] | TokenIds, salt: str = "") -> HostPrefix:
        """The deepest node of `ids`' path whose whole path is on the host (committed), and
        its path length: where KV read from external storage can be attached. Changes
        nothing (no split, no LRU tick, no hit count)."""
        q = as_token_ids(ids)
        node = self._root_for(salt)
        pos = 0
        end = len(q) - len(q) % self.page_size
        for child, start, stop in walk(node, q, end, self.page_size, None):
            if child.host_page_ids is None or stop - start < len(child.key):
                break  # not on the host, or the query ends inside it or leaves it
            node, pos = child, stop
        return HostPrefix(node, pos)

    def cached_len(self, ids: Sequence[int] | TokenIds, salt: str = "") -> int:
        """Length of the cached page-aligned prefix of `ids` (any tier), without the side
        effects of `match_prefix` (no split, LRU tick or hit count)."""
        q = as_token_ids(ids)
        root = self.roots.get(salt)
        if root is None:
            return 0
        stop = 0
        for step in walk(root, q, len(q) - len(q) % self.page_size, self.page_size, None):
            stop = step[2]  # the last step's stop, inside a node where the query leaves it
        return stop

    def insert_host(
        self,
        ids: Sequence[int] | TokenIds,
        host_page_ids: Sequence[int],
        start_len: int,
        salt: str = "",
    ) -> HostInsertResult:
        """Attach KV read from external storage: tokens `[start_len, end)` of `ids` (end: its
        aligned length) are in `host_page_ids`; tokens `[0, start_len)` are on the path and
        on the host (the caller pinned them with `ref_host` when the read started).

        Nodes past `start_len` without a host copy take the pages (a node on the device only
        gains its host copy; new host-only nodes are created where the path ends); they are
        marked `in_storage`. Nodes of the range that got their host copy meanwhile (a backup
        committed while the read ran) form a prefix of it (the host tier is prefix-closed):
        their pages are not taken, and `dup_end` ends after them. From a node with a backup
        in flight on, nothing is taken (see `HostInsertResult` for what is returned).

        Host page ids are not owner-classed (the host pool has one class), so nothing here
        checks an owner cycle: a host page's owner rank follows from its path position.
        """
        q = as_token_ids(ids)
        ps = self.page_size
        end = len(q) - len(q) % ps
        host = page_ids_of(host_page_ids)
        if len(host) != (end - start_len) // ps or start_len % ps:
            raise ValueError(f"insert_host: {len(host)} pages for tokens [{start_len}, {end})")
        self._clock += 1
        clock = self._clock
        root = node = self._root_for(salt)
        pos, dup_end = 0, start_len
        unused: list[HostPageId] = []
        taking = True  # until a node past the host copies has a backup in flight
        for node, start, pos in walk(root, q, end, ps, self._splitter):
            node.last_access = clock
            if start < start_len:
                continue
            pages = host[(start - start_len) // ps : (pos - start_len) // ps]
            if taking and node.host_page_ids is not None and dup_end == start:
                dup_end = pos  # got its host copy meanwhile (a backup): the range's prefix
                unused += [HostPageId(p) for p in pages]
            elif taking and node.host_page_ids is None and not node.backup_pending:
                node.in_storage = True
                self.tiers.add_host(node, pages)
            else:  # a backup in flight: neither it nor what follows can take host pages
                taking = False
                unused += [HostPageId(p) for p in pages]
        if pos < end and taking and pos >= start_len:
            node = self._new_node(node, q[pos:end], clock)
            node.in_storage = True
            self.tiers.add_host(node, host[(pos - start_len) // ps :])
        elif pos < end:
            unused += [HostPageId(p) for p in host[max(pos - start_len, 0) // ps :]]
        return HostInsertResult(node, dup_end, unused)

    # ----------------------------------------------------------------- whole tree

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node but the root, parents before children."""
        stack = [c for root in self.roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    @property
    def num_device_pages(self) -> int:
        return self.tiers.num_device_pages

    @property
    def num_host_pages(self) -> int:
        return self.tiers.num_host_pages

    @property
    def num_evictable_device_pages(self) -> int:
        return self.tiers.num_evictable_device_pages

    def drain_events(self) -> list[KVEventRecord]:
        """The tier changes recorded since the last drain, in order."""
        return self.event_log.drain()

    def snapshot_events(self) -> list[KVEventRecord]:
        """`stored` records for everything the tree holds now, per tier."""
        if self.namespace is None:
            return []
        return kv_events.snapshot(self.iter_nodes(), self.cp_size)

    def reset(self) -> DroppedPages:
        """Drop every node; returns their device and host pages. Nothing may be pinned."""
        device: list[PageId] = []
        host: list[HostPageId] = []
        for n in self.iter_nodes():
            if n.lock_ref or n.host_ref or n.backup_pending:
                raise RuntimeError(f"reset with a pinned node {n!r}")
            device += n.device_page_ids or []
            host += n.host_page_ids or []
            if n.device_page_ids is not None:
                self.event_log.record("removed", "device", n)
            if n.host_page_ids is not None:
                self.event_log.record("removed", "host", n)
        for root in self.roots.values():
            root.children.clear()
        self.tiers.clear()
        return DroppedPages(device, host)

    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant of the tree is broken."""
        tree_check.check_integrity(
            self.page_size, list(self.iter_nodes()), self.tiers, self.cp_size
        )

    def device_page_set(self) -> set[int]:
        return {p for n in self.iter_nodes() for p in (n.device_page_ids or [])}

    def host_page_set(self) -> set[int]:
        return {p for n in self.iter_nodes() for p in (n.host_page_ids or [])}
