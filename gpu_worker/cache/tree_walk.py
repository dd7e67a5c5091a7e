"""The one walk down the radix tree along a query: every verb that follows a key uses it.

Keys are compact (`bus_schemas.token_ids`): a node's `key` is an `array('I')` and the query
is turned into `bytes` once per walk, so comparing a node's tokens is one `startswith` (a
memcmp) and a child is found by its first token (page 1) or its first page's
4 * page_size bytes. The walk does no per-page Python work: one dict lookup and one
`startswith` per node, and a binary search over pages only in the node where the query
leaves the tree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from bus_schemas.token_ids import TokenIds
from gpu_worker.cache.tree_node import TreeNode

Step = tuple[TreeNode, int, int]
"""`(node, start, stop)`: the walk entered `node`, whose key starts at query token `start`,
and the query follows it up to token `stop` (`stop - start == len(node.key)` unless the
query leaves the node inside it, which only the last step of a walk that does not split
can show)."""


def child_key(key: TokenIds, page_size: int) -> Any:
    """The children-dict key of a node whose key is `key`: its first token at page 1,
    else the bytes of its first page (the same bytes a query's slice gives)."""
    return key[0] if page_size == 1 else key[:page_size].tobytes()


def common_len(key: TokenIds, qb: bytes, pos: int, end: int, page_size: int) -> int:
    """Page-aligned length of the common prefix of `key` and tokens `[pos, end)` of the
    query whose bytes are `qb`: C-level `startswith` on byte views, binary search on pages."""
    limit = min(len(key), end - pos)
    kb = memoryview(key).cast("B")
    off, pb = 4 * pos, 4 * page_size
    if qb.startswith(kb[: 4 * limit], off):
        return limit
    lo, hi = 0, limit // page_size  # pages [0, lo) equal; the first differing < hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if qb.startswith(kb[: mid * pb], off):
            lo = mid
        else:
            hi = mid - 1
    return lo * page_size


def walk(
    root: TreeNode,
    q: TokenIds,
    end: int,
    page_size: int,
    split: Callable[[TreeNode, int], TreeNode] | None,
) -> Iterator[Step]:
    """The nodes below `root` along tokens `[0, end)` of `q` (`end` page-aligned), in order.

    Where the query leaves a node inside it, `split(node, at)` cuts it at the page-aligned
    token offset `at` and the walk yields the returned upper part and stops; with `split`
    None it yields the node itself with the shorter `stop` and stops. A walk that stops
    early (no child for the next page, or the end of the query) says so only by its last
    step: the caller continues from `(last node, last stop)`, e.g. to add a leaf there.
    The walk changes nothing but the split; the caller may stop iterating at any step.
    """
    ps, pb, eb = page_size, 4 * page_size, 4 * end
    qb = q.tobytes()  # whole: a copy of a slice would cost 3x more than the bound below
    startswith = qb.startswith
    node, pos = root, 0
    while pos < end:
        off = 4 * pos
        # the child key inlined (`child_key`): this loop runs for every request
        child = node.children.get(q[pos] if ps == 1 else qb[off : off + pb])
        if child is None:
            return
        key = child.key
        if not startswith(key, off, eb):  # the query leaves this node inside it (or ends)
            at = common_len(key, qb, pos, end, ps)
            yield (child, pos, pos + at) if split is None else (split(child, at), pos, pos + at)
            return
        stop = pos + len(key)
        yield child, pos, stop
        node, pos = child, stop
