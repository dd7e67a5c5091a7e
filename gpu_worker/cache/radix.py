"""The page-aligned radix tree over token ids, with per-node tier state.

A node owns a run of whole pages of tokens. Its KV lives on the device (`device_page_ids`),
on the host (`host_page_ids`), or both. Two sets stay prefix-closed, and
`check_integrity()` verifies it: the nodes on the device, and the nodes on the host (a
node is on a tier only if its parent is). So a matched path is always a device part
followed by a host-only part.

The tree is written by one thread only (the scheduler). It never moves data: tier moves are
committed here after the transfer engine's ACK for them has been consumed
(`commit_backup`, `commit_load`). Splits keep the original node object as the *lower*
part, so a node held as "the end of a path" by a lock or an in-flight transfer still ends
the same token path after any split.

LRU order uses a logical clock, never wall-clock time, so every rank evicts the same nodes.

Keys are compact (`bus_schemas.token_ids`): a node's `key` is an `array('I')` and a query
is turned into `bytes` once per call, so comparing a node's tokens is one `startswith` (a
memcmp) and a child is found by its first token (page 1) or its first page's 4 * page_size
bytes. Page ids are `array('q')`, so a match concatenates them at C speed.

Eviction candidates are kept incrementally (`eviction.EvictionHeap`), one lazy heap per tier,
so an eviction costs O(log n), not a scan of every node; the eviction policy lives in
`eviction.py`, the KV-event records of tier changes in `kv_events.py`.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

from bus_schemas.page_hash import chain_hashes, root_hash
from bus_schemas.token_ids import TokenIds, as_token_ids
from gpu_worker.cache import eviction, kv_events
from gpu_worker.cache.eviction import EvictionHeap
from gpu_worker.cache.kv_events import KVEventLog, KVEventRecord
from gpu_worker.consensus.checker import rank_consensus
from gpu_worker.memory.allocator import HostPageId, PageId

PageIds = array
"""An `array('q')` of page ids (device or host): compact, concatenated at C speed, and the
dtype of a torch int64 index tensor."""


def _join_page_ids(parts: list[PageIds]) -> PageIds:
    """One new `array('q')` holding `parts` end to end (a single copy of their bytes)."""
    out = array("q")
    if parts:
        out.frombytes(b"".join(parts))
    return out


def page_ids_of(page_ids: Sequence[int]) -> PageIds:
    """`page_ids` as an `array('q')` (no copy when it already is one)."""
    if isinstance(page_ids, array) and page_ids.typecode == "q":
        return page_ids
    return array("q", page_ids)


class Tier(enum.Enum):
    DEVICE = "device"
    HOST = "host"
    BOTH = "both"


class TreeNode:
    """One edge of the tree: `key` holds whole pages of token ids."""

    __slots__ = (
        "backup_pending",  # a backup to host is in flight (issued, ACK not yet consumed)
        "children",  # first token (page 1) or first page's bytes of the child's key -> child
        "device_page_ids",  # array('q'): one device page per page of `key`, or None
        "hit_count",  # matches that reached this node (write_through_selective)
        "host_page_ids",  # array('q'): one host page per page of `key`, or None
        "host_ref",  # host pins: in-flight loads/backups that read the host copy
        "id",  # creation order; breaks LRU ties deterministically
        "in_storage",  # its pages were written to (or read from) external storage
        "key",  # array('I') of token ids, len % page_size == 0
        "last_access",  # logical clock of the last match/insert through this node
        "lock_ref",  # device pins: running requests (and backups) reading the device pages
        "page_hashes",  # chained page hashes of `key` (when the tree tracks them)
        "parent",
    )

    def __init__(self, node_id: int, parent: TreeNode | None, key: TokenIds) -> None:
        self.id = node_id
        self.parent = parent
        self.key = key
        self.children: dict[Any, TreeNode] = {}
        self.device_page_ids: PageIds | None = None
        self.host_page_ids: PageIds | None = None
        self.lock_ref = 0
        self.host_ref = 0
        self.last_access = 0
        self.hit_count = 0
        self.backup_pending = False
        self.in_storage = False
        self.page_hashes: list[bytes] | None = None

    @property
    def tier(self) -> Tier | None:
        """Where this node's KV is readable; None only for the root."""
        if self.device_page_ids is not None:
            return Tier.BOTH if self.host_page_ids is not None else Tier.DEVICE
        return Tier.HOST if self.host_page_ids is not None else None

    @property
    def on_device(self) -> bool:
        return self.device_page_ids is not None

    @property
    def on_host(self) -> bool:
        return self.host_page_ids is not None

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, len={len(self.key)}, tier={self.tier}, lock={self.lock_ref})"
        )


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


@dataclass(frozen=True, slots=True)
class InsertResult:
    """`dup_len`: tokens whose device pages the tree already held; `last_node`: end of the path."""

    dup_len: int
    last_node: TreeNode


@dataclass(slots=True)
class EvictResult:
    freed_page_ids: list[int] = field(default_factory=list)
    unbacked: list[TreeNode] = field(default_factory=list)  # leaves kept: need a backup first


class RadixTree:
    """Page-aligned radix tree. See the module docstring for the invariants."""

    def __init__(
        self, page_size: int, namespace: str | None = None, record_events: bool = True
    ) -> None:
        """With a `namespace`, nodes carry chained page hashes (bus_schemas.page_hash: the
        names of their objects in external storage) and, with `record_events`, every tier
        change is recorded in `events` for the KV-event stream."""
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self.namespace = namespace
        self.record_events = record_events
        self.event_log = KVEventLog(namespace is not None and record_events)
        self._next_id = 0
        self._clock = 0
        self._device_heap: EvictionHeap[TreeNode] = EvictionHeap(self._device_leaf)
        self._host_heap: EvictionHeap[TreeNode] = EvictionHeap(self._host_leaf)
        self.roots: dict[str, TreeNode] = {}  # one root per cache_salt: salts never share KV
        self.root = self._root_for("")
        self.num_device_pages = 0  # device pages held by the tree
        self.num_locked_device_pages = 0  # of those, pinned by lock_ref > 0
        self.num_host_pages = 0

    # ----------------------------------------------------------------- helpers

    def _new_node(self, parent: TreeNode | None, key: TokenIds) -> TreeNode:
        node = TreeNode(self._next_id, parent, key)
        self._next_id += 1
        return node

    def _root_for(self, salt: str) -> TreeNode:
        root = self.roots.get(salt)
        if root is None:
            root = self._new_node(None, array("I"))
            root.lock_ref = 1  # a root is never evicted
            if self.namespace is not None:
                root.page_hashes = [root_hash(self.namespace, salt)]
            self.roots[salt] = root
        return root

    def _hash_new(self, node: TreeNode) -> None:
        if self.namespace is not None:
            assert node.parent is not None and node.parent.page_hashes is not None
            node.page_hashes = chain_hashes(node.parent.page_hashes[-1], node.key, self.page_size)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _child_key(self, key: Sequence[int]) -> Any:
        """The children-dict key of a node whose key is `key`: its first token at page 1,
        else the bytes of its first page (the same bytes a query's slice gives)."""
        if self.page_size == 1:
            return key[0]
        return as_token_ids(key[: self.page_size]).tobytes()

    def _common_len(self, key: TokenIds, qb: bytes, pos: int, end: int) -> int:
        """Page-aligned length of the common prefix of `key` and tokens `[pos, end)` of the
        query whose bytes are `qb`: C-level `startswith` on byte views, binary search on pages."""
        limit = min(len(key), end - pos)
        kb = memoryview(key).cast("B")
        off, pb = 4 * pos, 4 * self.page_size
        if qb.startswith(kb[: 4 * limit], off):
            return limit
        lo, hi = 0, limit // self.page_size  # pages [0, lo) equal; the first differing < hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if qb.startswith(kb[: mid * pb], off):
                lo = mid
            else:
                hi = mid - 1
        return lo * self.page_size

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut `node` at token offset `at`; the new *upper* node is returned.

        The original object keeps the lower part, so references to it as a path end stay valid.
        """
        ps = self.page_size
        parent = node.parent
        assert parent is not None and 0 < at < len(node.key) and at % ps == 0
        upper = self._new_node(parent, node.key[:at])
        upper.lock_ref = node.lock_ref
        upper.host_ref = node.host_ref
        upper.last_access = node.last_access
        upper.hit_count = node.hit_count
        upper.backup_pending = node.backup_pending
        upper.in_storage = node.in_storage
        pages = at // ps
        if node.device_page_ids is not None:
            upper.device_page_ids = node.device_page_ids[:pages]
            node.device_page_ids = node.device_page_ids[pages:]
        if node.host_page_ids is not None:
            upper.host_page_ids = node.host_page_ids[:pages]
            node.host_page_ids = node.host_page_ids[pages:]
        if node.page_hashes is not None:
            upper.page_hashes = node.page_hashes[:pages]
            node.page_hashes = node.page_hashes[pages:]
        parent.children[self._child_key(node.key)] = upper
        node.key = node.key[at:]
        node.parent = upper
        upper.children[self._child_key(node.key)] = node
        self._device_heap.offer(upper)  # on device above a host-only lower part
        return upper

    def _aligned_len(self, ids: Sequence[int]) -> int:
        return len(ids) - len(ids) % self.page_size

    # ----------------------------------------------------------------- verbs

    def match_prefix(self, ids: Sequence[int] | TokenIds, salt: str = "") -> MatchResult:
        """Longest cached page-aligned prefix of `ids`; marks the path as recently used.

        Splits a node where the match ends inside it, so `last_node` ends exactly at the match.
        Counts a hit on every matched node (for write_through_selective). Pass an
        `array('I')` (TokenIds): a list is converted first, once per call.
        """
        q = ids if type(ids) is array and ids.typecode == "I" else as_token_ids(ids)
        ps, pb = self.page_size, 4 * self.page_size
        end = len(q) - len(q) % ps
        # the aligned part as bytes: a key running past `end` then fails `startswith` by itself
        qb = q.tobytes() if end == len(q) else memoryview(q)[:end].tobytes()
        startswith = qb.startswith
        self._clock += 1
        clock = self._clock
        node = last_device = self.roots.get(salt) or self._root_for(salt)
        pos = device_len = 0
        device_parts: list[PageIds] = []  # joined once at the end: `array +=` per node
        host_parts: list[PageIds] = []  # reallocates (arrays grow by 1/16) and cost 3x more
        while pos < end:
            off = 4 * pos
            # the child key inlined (`_child_key`): this loop runs for every request
            child = node.children.get(q[pos] if ps == 1 else qb[off : off + pb])
            if child is None:
                break
            key = child.key
            whole = startswith(key, off)
            if not whole:  # the match ends inside this node: cut it there, stop after it
                child = self._split(child, self._common_len(key, qb, pos, end))
                key = child.key
            child.last_access = clock
            child.hit_count += 1
            pos += len(key)
            pages = child.device_page_ids
            if pages is not None:
                device_parts.append(pages)
                last_device, device_len = child, pos
            else:
                assert child.host_page_ids is not None
                host_parts.append(child.host_page_ids)
            node = child
            if not whole:
                break
        return MatchResult(
            device_len,
            pos - device_len,
            _join_page_ids(device_parts),
            _join_page_ids(host_parts),
            last_device,
            node,
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
        """
        q = as_token_ids(ids)
        qb = q.tobytes()
        ps, pb = self.page_size, 4 * self.page_size
        end = self._aligned_len(q)
        if len(page_ids) < end // ps:
            raise ValueError(
                f"insert needs {end // ps} pages for {end} tokens, got {len(page_ids)}"
            )
        clock = self._tick()
        node, pos, dup_len = self._root_for(salt), 0, 0
        while pos < end:
            off = 4 * pos
            child_key = q[pos] if ps == 1 else qb[off : off + pb]
            child = node.children.get(child_key)
            if child is None:
                pages = page_ids_of(page_ids[pos // ps : end // ps])  # only what is new
                node = self._add_leaf(node, child_key, q[pos:end], pages, clock)
                break
            if pos + len(child.key) <= end and qb.startswith(child.key, off):
                matched = len(child.key)
            else:
                matched = self._common_len(child.key, qb, pos, end)
                child = self._split(child, matched)
            child.last_access = clock
            if child.device_page_ids is None:  # host-only: the caller's pages revive it
                child.device_page_ids = page_ids_of(page_ids[pos // ps : (pos + matched) // ps])
                self._add_device_pages(child, len(child.device_page_ids))
                self.event_log.record("stored", "device", child)
                self._device_heap.offer(child)
            else:
                dup_len = pos + matched
            node, pos = child, pos + matched
        return InsertResult(dup_len, node)

    def _add_leaf(
        self, parent: TreeNode, child_key: Any, key: TokenIds, pages: PageIds, clock: int
    ) -> TreeNode:
        new = self._new_node(parent, key)
        new.device_page_ids = pages
        new.last_access = clock
        parent.children[child_key] = new
        self.num_device_pages += len(pages)
        self._hash_new(new)
        self.event_log.record("stored", "device", new)
        self._device_heap.offer(new)
        return new

    def host_prefix(self, ids: Sequence[int] | TokenIds, salt: str = "") -> tuple[TreeNode, int]:
        """The deepest node of `ids`' path whose whole path is on the host (committed), and
        its path length: where KV read from external storage can be attached. Changes
        nothing (no split, no LRU tick, no hit count)."""
        q = as_token_ids(ids)
        qb = q.tobytes()
        ps, pb = self.page_size, 4 * self.page_size
        end = self._aligned_len(q)
        node = self._root_for(salt)
        pos = 0
        while pos < end:
            off = 4 * pos
            child = node.children.get(q[pos] if ps == 1 else qb[off : off + pb])
            if child is None or child.host_page_ids is None:
                break
            if pos + len(child.key) > end or not qb.startswith(child.key, off):
                break  # the query ends inside it, or leaves it
            node, pos = child, pos + len(child.key)
        return node, pos

    def cached_len(self, ids: Sequence[int] | TokenIds, salt: str = "") -> int:
        """Length of the cached page-aligned prefix of `ids` (any tier), without the side
        effects of `match_prefix` (no split, LRU tick or hit count)."""
        q = as_token_ids(ids)
        qb = q.tobytes()
        ps, pb = self.page_size, 4 * self.page_size
        end = self._aligned_len(q)
        node = self.roots.get(salt)
        pos = 0
        while node is not None and pos < end:
            off = 4 * pos
            child = node.children.get(q[pos] if ps == 1 else qb[off : off + pb])
            if child is None:
                break
            if pos + len(child.key) <= end and qb.startswith(child.key, off):
                node, pos = child, pos + len(child.key)
            else:
                return pos + self._common_len(child.key, qb, pos, end)
        return pos

    def insert_host(
        self,
        ids: Sequence[int] | TokenIds,
        host_page_ids: Sequence[int],
        start_len: int,
        salt: str = "",
    ) -> tuple[TreeNode, int, list[HostPageId]]:
        """Attach KV read from external storage: tokens `[start_len, end)` of `ids` (end: its
        aligned length) are in `host_page_ids`; tokens `[0, start_len)` are on the path and
        on the host (the caller pinned them with `ref_host` when the read started).

        Nodes past `start_len` without a host copy take the pages (a node on the device only
        gains its host copy; new host-only nodes are created where the path ends); they are
        marked `in_storage`. From the first node that already has a host copy or a backup in
        flight, pages are not taken. Returns the last node attached to (or the path's end),
        `dup_end` (tokens up to which the tree already had the host copy: what was attached
        is `[dup_end, ...)`), and the pages not taken, which the caller frees.
        """
        q = as_token_ids(ids)
        qb = q.tobytes()
        ps, pb = self.page_size, 4 * self.page_size
        end = self._aligned_len(q)
        host = page_ids_of(host_page_ids)
        if len(host) != (end - start_len) // ps or start_len % ps:
            raise ValueError(f"insert_host: {len(host)} pages for tokens [{start_len}, {end})")
        clock = self._tick()
        node, pos, dup_end = self._root_for(salt), 0, start_len
        unused: list[HostPageId] = []
        taking = True  # until a node past start_len already has (or is getting) a host copy
        while pos < end:
            off = 4 * pos
            child_key = q[pos] if ps == 1 else qb[off : off + pb]
            child = node.children.get(child_key)
            if child is None:
                if taking and pos >= start_len:
                    node = self._add_host_leaf(node, child_key, q[pos:end], host, start_len, clock)
                else:
                    unused += [HostPageId(p) for p in host[max(pos - start_len, 0) // ps :]]
                break
            if pos + len(child.key) <= end and qb.startswith(child.key, off):
                matched = len(child.key)
            else:
                matched = self._common_len(child.key, qb, pos, end)
                if matched == 0:
                    unused += [HostPageId(p) for p in host[max(pos - start_len, 0) // ps :]]
                    break
                child = self._split(child, matched)
            child.last_access = clock
            if pos >= start_len:
                pages = host[(pos - start_len) // ps : (pos + matched - start_len) // ps]
                if taking and child.host_page_ids is None and not child.backup_pending:
                    child.host_page_ids = pages
                    child.in_storage = True
                    self.num_host_pages += len(pages)
                    self.event_log.record("stored", "host", child)
                    self._host_heap.offer(child)
                else:
                    if taking and child.host_page_ids is not None:
                        dup_end = pos + matched  # already on host: a prefix of the range
                    taking = False
                    unused += [HostPageId(p) for p in pages]
            node, pos = child, pos + matched
        return node, dup_end, unused

    def _add_host_leaf(
        self,
        parent: TreeNode,
        child_key: Any,
        key: TokenIds,
        host: PageIds,
        start_len: int,
        clock: int,
    ) -> TreeNode:
        pos = self.path_len(parent)
        new = self._new_node(parent, key)
        new.host_page_ids = host[(pos - start_len) // self.page_size :]
        new.in_storage = True
        new.last_access = clock
        parent.children[child_key] = new
        self.num_host_pages += len(new.host_page_ids)
        self._hash_new(new)
        self.event_log.record("stored", "host", new)
        self._host_heap.offer(new)
        return new

    def _add_device_pages(self, node: TreeNode, n: int) -> None:
        self.num_device_pages += n
        if node.lock_ref > 0:
            self.num_locked_device_pages += n

    def lock(self, node: TreeNode) -> None:
        """Pin the device pages of `node` and its ancestors (a running request reads them)."""
        while node.parent is not None:
            if node.lock_ref == 0 and node.device_page_ids is not None:
                self.num_locked_device_pages += len(node.device_page_ids)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0 and node.device_page_ids is not None:
                self.num_locked_device_pages -= len(node.device_page_ids)
                self._device_heap.offer(node)
            assert node.parent is not None
            node = node.parent

    def ref_host(self, node: TreeNode) -> None:
        """Pin the host pages of `node` and its ancestors (a load or backup reads them)."""
        while node.parent is not None:
            node.host_ref += 1
            assert node.parent is not None
            node = node.parent

    def unref_host(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.host_ref <= 0:
                raise RuntimeError(f"unref_host of an unpinned node {node!r}")
            node.host_ref -= 1
            if node.host_ref == 0:
                self._host_heap.offer(node)
            assert node.parent is not None
            node = node.parent

    # ----------------------------------------------------------------- paths

    def path(self, node: TreeNode) -> list[tuple[int, TreeNode]]:
        """`(start_token, node)` for every node from the root's child down to `node`."""
        chain: list[TreeNode] = []
        while node.parent is not None:
            chain.append(node)
            assert node.parent is not None
            node = node.parent
        chain.reverse()
        out, pos = [], 0
        for n in chain:
            out.append((pos, n))
            pos += len(n.key)
        return out

    def path_len(self, node: TreeNode) -> int:
        total = 0
        while node.parent is not None:
            total += len(node.key)
            assert node.parent is not None
            node = node.parent
        return total

    def path_device_page_ids(self, node: TreeNode) -> PageIds:
        """Device pages of the path to `node`; every node on it must be on the device."""
        pages: PageIds = array("q")
        for _, n in self.path(node):
            if n.device_page_ids is None:
                raise RuntimeError(f"{n!r} on the path is not on the device")
            pages += n.device_page_ids
        return pages

    def path_range(self, last_node: TreeNode, start_len: int) -> list[tuple[int, TreeNode]]:
        """Nodes of the path to `last_node` that start at or after token `start_len`."""
        return [(p, n) for p, n in self.path(last_node) if p >= start_len]

    # ----------------------------------------------------------------- tier moves

    def host_covered_len(self, node: TreeNode) -> int:
        """Tokens of the path to `node` that are on the host or have a backup in flight."""
        covered = 0
        for pos, n in self.path(node):
            if n.host_page_ids is None and not n.backup_pending:
                break
            covered = pos + len(n.key)
        return covered

    def mark_backup_pending(self, last_node: TreeNode, start_len: int) -> int:
        """Mark the nodes from `start_len` to `last_node` as having a backup in flight.

        Returns the number of pages they hold. The caller issues the copy and keeps the
        nodes device-locked until `commit_backup`.
        """
        pages = 0
        for _, n in self.path_range(last_node, start_len):
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
        for pos, n in self.path_range(last_node, start_len):
            assert n.backup_pending and n.host_page_ids is None
            lo = (pos - start_len) // ps
            n.host_page_ids = host[lo : lo + len(n.key) // ps]
            n.backup_pending = False
            self.num_host_pages += len(n.host_page_ids)
            self.event_log.record("stored", "host", n)
            self._host_heap.offer(n)

    def abort_backup(self, last_node: TreeNode, start_len: int) -> None:
        """A backup's copy failed: the nodes from `start_len` are no longer pending."""
        nodes = self.path_range(last_node, start_len)
        for _, n in nodes:
            n.backup_pending = False
        if nodes:  # a pending child no longer keeps the covered part from eviction
            parent = nodes[0][1].parent
            assert parent is not None
            self._host_heap.offer(parent)

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
        for pos, n in self.path_range(last_node, start_len):
            lo = (pos - start_len) // ps
            pages = loaded[lo : lo + len(n.key) // ps]
            if n.device_page_ids is None:
                n.device_page_ids = pages
                self._add_device_pages(n, len(pages))
                self.event_log.record("stored", "device", n)
                self._device_heap.offer(n)
            else:
                unused += pages
        return unused

    # ----------------------------------------------------------------- eviction

    def _device_leaf(self, n: TreeNode) -> bool:
        return eviction.device_leaf(n)

    def _host_leaf(self, n: TreeNode) -> bool:
        return eviction.host_leaf(n)

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
            self._device_heap, num_pages, delete_unbacked, self._drop_device
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
        freed = eviction.evict_host(self._host_heap, num_pages, self._drop_host)
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
        parent = node.parent
        assert parent is not None
        del parent.children[self._child_key(node.key)]

    # ----------------------------------------------------------------- inspection

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node but the root, parents before children."""
        stack = [c for root in self.roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def drain_events(self) -> list[KVEventRecord]:
        """The tier changes recorded since the last drain, in order."""
        return self.event_log.drain()

    def snapshot_events(self) -> list[KVEventRecord]:
        """`stored` records for everything the tree holds now, per tier."""
        if self.namespace is None:
            return []
        return kv_events.snapshot(self.iter_nodes())

    @property
    def num_evictable_device_pages(self) -> int:
        return self.num_device_pages - self.num_locked_device_pages

    def reset(self) -> tuple[list[PageId], list[HostPageId]]:
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
        self._device_heap.clear()
        self._host_heap.clear()
        self.num_device_pages = self.num_locked_device_pages = self.num_host_pages = 0
        return device, host

    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant of the tree is broken."""
        ps = self.page_size
        device_seen: set[int] = set()
        host_seen: set[int] = set()
        num_device = num_locked = num_host = 0
        nodes = list(self.iter_nodes())
        for n in nodes:
            parent = n.parent
            assert parent is not None
            assert n.key and len(n.key) % ps == 0, f"{n!r}: key not whole pages"
            assert isinstance(n.key, array) and n.key.typecode == "I", f"{n!r}: key not TokenIds"
            assert parent.children.get(self._child_key(n.key)) is n, f"{n!r}: bad child link"
            assert n.on_device or n.on_host, f"{n!r}: holds no KV"
            child_locks = sum(c.lock_ref for c in n.children.values())
            assert n.lock_ref >= child_locks, f"{n!r}: lock_ref below its children's"
            child_refs = sum(c.host_ref for c in n.children.values())
            assert n.host_ref >= child_refs, f"{n!r}: host_ref below its children's"
            top = parent.parent is None
            if n.on_device:
                assert top or parent.on_device, f"{n!r}: on device, parent is not"
                assert n.device_page_ids is not None and len(n.device_page_ids) == len(n.key) // ps
                assert device_seen.isdisjoint(n.device_page_ids), f"{n!r}: device page twice"
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
            self.num_device_pages,
            self.num_locked_device_pages,
            self.num_host_pages,
        ), "page counters drifted"
        self._device_heap.check(nodes, "device")
        self._host_heap.check(nodes, "host")

    def device_page_set(self) -> set[int]:
        return {p for n in self.iter_nodes() for p in (n.device_page_ids or [])}

    def host_page_set(self) -> set[int]:
        return {p for n in self.iter_nodes() for p in (n.host_page_ids or [])}
