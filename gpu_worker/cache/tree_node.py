"""A node of the radix tree, its page-id arrays, and the queries that follow a node's path up.

A node owns a run of whole pages of tokens (`key`, an `array('I')`). Its KV lives on the
device (`device_page_ids`), on the host (`host_page_ids`), or both; page ids are
`array('q')`, so a match concatenates them at C speed. Everything here reads or builds nodes
only: the tree (`radix.py`) is the one writer of their links and tier state.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Sequence
from typing import Any, NamedTuple

from bus_schemas.token_ids import TokenIds

PageIds = array
"""An `array('q')` of page ids (device or host): compact, concatenated at C speed, and the
dtype of a torch int64 index tensor."""


def join_page_ids(parts: list[PageIds]) -> PageIds:
    """One new `array('q')` holding `parts` end to end. One or two parts (most matches) are
    one slice or one concatenation, a single copy; more are joined as bytes first (two
    copies, but one allocation however many parts: `+` per part would be quadratic)."""
    n = len(parts)
    if n == 1:
        return parts[0][:]
    if n == 2:
        return parts[0] + parts[1]
    out = array("q")
    if parts:
        out.frombytes(b"".join(parts))
    return out


def page_ids_of(page_ids: Sequence[int]) -> PageIds:
    """`page_ids` as an `array('q')` (no copy when it already is one)."""
    if isinstance(page_ids, array) and page_ids.typecode == "q":
        return page_ids
    return array("q", page_ids)


def next_owner_rotation(rotation: int, num_pages: int, cp_size: int = 1) -> int:
    """The owner rotation of the page `num_pages` after a page whose rotation is `rotation`.

    Context parallelism shards pages round-robin over `cp_size` ranks along a path, so the
    part of a node that starts `num_pages` later (the lower part of a split, or a child)
    starts that many owners further on. With `cp_size` 1 (today) every rotation is 0.
    """
    return (rotation + num_pages) % cp_size


def owner_cycle_break(page_ids: Sequence[int], rotation: int, cp_size: int) -> int | None:
    """The first offset `i` of a run of device pages starting at owner `rotation` whose page
    is not of owner class `(rotation + i) % cp_size` (page `q` is owned by CP rank
    `q % cp_size`), or None when the run keeps the cycle (always with `cp_size` 1)."""
    if cp_size == 1:
        return None
    for i, q in enumerate(page_ids):
        if q % cp_size != (rotation + i) % cp_size:
            return i
    return None


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
        # the context-parallel rank owning this node's first page: page i of the node lives
        # on CP rank (owner_rotation + i) % cp_size; always 0 while cp_size is 1
        "owner_rotation",
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
        self.owner_rotation = 0
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

    # ------------------------------------------------------------- the path (read only)

    def path(self) -> list[PathStep]:
        """A `PathStep` for every node from the root's child down to this node."""
        chain: list[TreeNode] = []
        node = self
        while node.parent is not None:
            chain.append(node)
            node = node.parent
        chain.reverse()
        out, pos = [], 0
        for n in chain:
            out.append(PathStep(pos, n))
            pos += len(n.key)
        return out

    def path_len(self) -> int:
        """Tokens on the path from the root to the end of this node."""
        total, node = 0, self
        while node.parent is not None:
            total += len(node.key)
            node = node.parent
        return total

    def path_range(self, start_len: int) -> list[PathStep]:
        """The steps of the path to this node whose nodes start at or after token
        `start_len`."""
        return [step for step in self.path() if step.start >= start_len]

    def path_device_page_ids(self) -> PageIds:
        """Device pages of the path to this node; every node on it must be on the device."""
        pages: PageIds = array("q")
        for _, n in self.path():
            if n.device_page_ids is None:
                raise RuntimeError(f"{n!r} on the path is not on the device")
            pages += n.device_page_ids
        return pages

    def host_covered_len(self) -> int:
        """Tokens of the path to this node that are on the host or have a backup in flight."""
        covered = 0
        for pos, n in self.path():
            if n.host_page_ids is None and not n.backup_pending:
                break
            covered = pos + len(n.key)
        return covered

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, len={len(self.key)}, tier={self.tier}, lock={self.lock_ref})"
        )


class PathStep(NamedTuple):
    """A node of a path and the token of the path where its key starts (a NamedTuple:
    callers unpack `for start, node in node.path()`)."""

    start: int
    node: TreeNode
