"""Benchmark `RadixTree.match_prefix`, `insert` and eviction.

    python benchmarks/bench_radix.py                     # page sizes 64 and 1, eviction
    python benchmarks/bench_radix.py --page-sizes 64 --calls 5000
    python benchmarks/bench_radix.py --page-sizes --evict-nodes 100000   # eviction only

Workload: `--num-seqs` sequences of `--seq-len` tokens over `--vocab`; sequence i is shared
prefix `i % --num-prefixes` (`--prefix-len` random tokens) followed by random tokens. Both
trees hold the same sequences. Queries are fresh objects, never the ones that were inserted:
our tree gets `TokenIds` (array('I'), what `Req.prompt_ids` is and `PrefixCache.match` passes),
the baseline lists of fresh ints (what its callers pass).

Cases, timed per call with `time.perf_counter_ns` (median after a warm-up pass):
  shared-prefix hit  a shared prefix followed by a new random suffix
  exact hit          a whole inserted sequence
  miss               a first token that no sequence starts with
  split hit          the first `--seq-len // 2` tokens of an inserted sequence, each query
                     timed once: the match ends inside a leaf, so that one call splits it
The first three never split a node: the tree is already cut at every shared prefix, so
repeating those queries times the same work. Insert is timed while building the tree.

The baseline is the usual design of a Python radix cache (SGLang's RadixCache), written
here from scratch: children keyed by the first token (or first page tuple), a `_key_match`
loop that compares keys token by token, the remaining key re-sliced at every node, a split
where a match ends inside a node. Its values are page-id lists (no tensors).

Eviction (`--evict-nodes`, 0 to skip): a random tree of that many nodes (page 16, sequences
of 4 pages sharing random page-aligned prefixes), then `evict_device(1)` timed call by call:
the tree's incremental heap (`--evict-calls` calls) against the former algorithm, which
rebuilt a heap from every node on each call (`--rebuild-calls` calls, run after, on the same
tree). Median microseconds per call, and the ratio.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import sys
import time
import tracemalloc
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

# Run as a script from a checkout where the project is not pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_worker.cache.eviction import device_leaf
from gpu_worker.cache.radix import EvictResult, RadixTree
from gpu_worker.cache.tree_walk import child_key

# ----------------------------------------------------------------- baseline


class BaselineNode:
    __slots__ = ("children", "key", "last_access", "parent", "value")

    def __init__(self, parent: BaselineNode | None, key: list[int], value: list[int]) -> None:
        self.children: dict[Any, BaselineNode] = {}
        self.parent = parent
        self.key = key
        self.value = value  # one page id per page of `key`
        self.last_access = 0


class BaselineRadixCache:
    """The classic design: token-by-token key matching, re-sliced keys, split on mismatch."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = BaselineNode(None, [], [])
        self.clock = 0

    def _child_key(self, key: list[int]) -> Any:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _key_match(self, key0: list[int], key1: list[int]) -> int:
        i = 0
        for t0, t1 in zip(key0, key1, strict=False):
            if t0 != t1:
                break
            i += 1
        return i - i % self.page_size

    def _split(self, child: BaselineNode, at: int) -> BaselineNode:
        parent = child.parent
        assert parent is not None
        pages = at // self.page_size
        upper = BaselineNode(parent, child.key[:at], child.value[:pages])
        upper.last_access = child.last_access
        parent.children[self._child_key(child.key)] = upper
        child.key, child.value, child.parent = child.key[at:], child.value[pages:], upper
        upper.children[self._child_key(child.key)] = child
        return upper

    def match_prefix(self, key: list[int]) -> tuple[list[int], BaselineNode]:
        key = key[: len(key) - len(key) % self.page_size]
        self.clock += 1
        node, value = self.root, []
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access = self.clock
            n = self._key_match(child.key, key)
            if n < len(child.key):
                node = self._split(child, n)
                value.append(node.value)
                break
            value.append(child.value)
            node, key = child, key[n:]
        return [p for v in value for p in v], node

    def insert(self, key: list[int], value: list[int]) -> int:
        """Returns the length already present (its pages are the caller's to free)."""
        key = key[: len(key) - len(key) % self.page_size]
        value = value[: len(key) // self.page_size]
        self.clock += 1
        node, total = self.root, 0
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                new = BaselineNode(node, key, value)
                new.last_access = self.clock
                node.children[self._child_key(key)] = new
                break
            child.last_access = self.clock
            n = self._key_match(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            total += n
            node, key, value = child, key[n:], value[n // self.page_size :]
        return total


# ----------------------------------------------------------------- workload


class Tree(Protocol):
    def insert(self, key: Any, value: list[int]) -> Any: ...
    def match_prefix(self, key: Any) -> Any: ...


@dataclass(frozen=True, slots=True)
class Workload:
    seqs: list[list[int]]
    shared_hits: list[list[int]]  # a shared prefix, then a new random suffix
    exact_hits: list[list[int]]
    misses: list[list[int]]
    split_hits: list[list[int]]  # end inside a leaf


def fresh(ids: Sequence[int]) -> list[int]:
    """A copy with new int objects, so no comparison short-cuts on object identity."""
    return array("q", ids).tolist()


def token_ids(queries: list[list[int]]) -> list[array]:
    """The queries as our tree's callers hold them: TokenIds, built once, outside timing."""
    return [array("I", q) for q in queries]


def make_workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(args.vocab) for _ in range(n)]

    prefixes = [tokens(args.prefix_len) for _ in range(args.num_prefixes)]
    suffix_len = args.seq_len - args.prefix_len
    seqs = [prefixes[i % len(prefixes)] + tokens(suffix_len) for i in range(args.num_seqs)]
    n = args.num_queries
    firsts = {s[0] for s in seqs}
    unused = [t for t in range(args.vocab) if t not in firsts][:n]
    misses = [[t, *tokens(args.seq_len - 1)] for t in unused]
    return Workload(
        seqs=seqs,
        shared_hits=[fresh(prefixes[i % len(prefixes)] + tokens(suffix_len)) for i in range(n)],
        exact_hits=[fresh(seqs[i % len(seqs)]) for i in range(n)],
        misses=[fresh(m) for m in misses],
        split_hits=[fresh(s[: args.seq_len // 2]) for s in seqs],
    )


# ----------------------------------------------------------------- timing


def build(tree: Tree, seqs: list[list[int]], compact: bool) -> list[float]:
    """Insert every sequence (as TokenIds when `compact`); microseconds per insert."""
    times = []
    for i, seq in enumerate(seqs):
        pages = list(range(i * len(seq), (i + 1) * len(seq)))
        key: Sequence[int] = array("I", seq) if compact else fresh(seq)
        t0 = time.perf_counter_ns()
        tree.insert(key, pages)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return times


def time_calls(fn: Callable[[Any], Any], queries: Sequence[Sequence[int]], calls: int) -> float:
    """Median microseconds per call over `calls` calls cycling through `queries`."""
    for q in queries:  # warm-up
        fn(q)
    times = []
    for i in range(calls):
        q = queries[i % len(queries)]
        t0 = time.perf_counter_ns()
        fn(q)
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def time_once_each(fn: Callable[[Any], Any], queries: Sequence[Sequence[int]]) -> float:
    times = []
    for q in queries:
        t0 = time.perf_counter_ns()
        fn(q)
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def tree_bytes(make: Callable[[], Tree], seqs: list[list[int]]) -> int:
    """Bytes allocated by building a tree (the token lists it keeps included)."""
    keys = [fresh(s) for s in seqs]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    tree = make()
    for i, key in enumerate(keys):
        tree.insert(key, list(range(i * len(key), (i + 1) * len(key))))
    del keys
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del tree
    return used


# ----------------------------------------------------------------- report


def count_nodes(tree: RadixTree) -> int:
    return sum(1 for _ in tree.iter_nodes())


def bench_page_size(ps: int, work: Workload, args: argparse.Namespace) -> list[str]:
    ours, base = RadixTree(ps), BaselineRadixCache(ps)
    ours_ins, base_ins = build(ours, work.seqs, True), build(base, work.seqs, False)
    rows = [row(ps, "insert (building the tree)", "no", ours_ins, base_ins)]

    def ours_len(q: Sequence[int]) -> int:
        return int(ours.match_prefix(q).device_len)

    def base_len(q: list[int]) -> int:
        return len(base.match_prefix(q)[0]) * ps

    cases = [
        ("shared-prefix hit", work.shared_hits),
        ("exact hit", work.exact_hits),
        ("miss", work.misses),
    ]
    for name, queries in cases:
        nodes = count_nodes(ours)
        lengths = {ours_len(q) for q in queries}
        assert lengths == {base_len(q) for q in queries}, name
        splits = "no" if count_nodes(ours) == nodes else "yes"
        name = f"{name} ({'/'.join(str(n) for n in sorted(lengths))} tok)"
        t_ours = time_calls(ours.match_prefix, token_ids(queries), args.calls)
        t_base = time_calls(base.match_prefix, queries, args.calls)
        rows.append(row(ps, name, splits, [t_ours], [t_base]))

    nodes = count_nodes(ours)
    t_ours = time_once_each(ours.match_prefix, token_ids(work.split_hits))
    t_base = time_once_each(base.match_prefix, work.split_hits)
    splits = f"yes ({count_nodes(ours) - nodes})"
    lengths = {ours_len(q) for q in work.split_hits}
    assert lengths == {base_len(q) for q in work.split_hits}
    name = f"split hit ({'/'.join(str(n) for n in sorted(lengths))} tok, 1st call)"
    rows.append(row(ps, name, splits, [t_ours], [t_base]))

    if args.memory:
        ours_mb = tree_bytes(lambda: RadixTree(ps), work.seqs) / 2**20
        base_mb = tree_bytes(lambda: BaselineRadixCache(ps), work.seqs) / 2**20
        rows.append(
            f"{ps:>4}  {'tree memory (MiB, tracemalloc)':<38} {'':>7} "
            f"{ours_mb:>10.2f} {base_mb:>10.2f} {ours_mb / base_mb:>10.2f}"
        )
    return rows


# ----------------------------------------------------------------- eviction


def random_tree(num_nodes: int, seed: int, page_size: int = 16, seq_pages: int = 4) -> RadixTree:
    """A tree of about `num_nodes` nodes: each sequence shares a random page-aligned prefix
    of an earlier one (which splits a node there) and ends in new random pages."""
    rng = random.Random(seed)
    tree = RadixTree(page_size)
    seqs: list[array] = []
    next_page = 0
    while tree._next_id - len(tree.roots) < num_nodes:
        shared = rng.randrange(1, seq_pages) * page_size if seqs else 0
        head = rng.choice(seqs)[:shared] if seqs else array("I")
        tail = [rng.randrange(1 << 31) for _ in range(seq_pages * page_size - len(head))]
        seq = head + array("I", tail)
        tree.insert(seq, range(next_page, next_page + seq_pages))
        next_page += seq_pages
        seqs.append(seq)
    return tree


def evict_device_rebuild(tree: RadixTree, num_pages: int) -> EvictResult:
    """The former `evict_device`: a heap rebuilt from every node on each call (for the ratio
    only; it bypasses the tree's incremental heap, so run it last on a tree)."""
    result = EvictResult()
    heap = [(n.last_access, n.id, n) for n in tree.iter_nodes() if device_leaf(n)]
    heapq.heapify(heap)
    while heap and len(result.freed_page_ids) < num_pages:
        _, _, node = heapq.heappop(heap)
        assert node.device_page_ids is not None and node.host_page_ids is None
        result.freed_page_ids += node.device_page_ids
        tree.tiers.num_device_pages -= len(node.device_page_ids)
        node.device_page_ids = None
        parent = node.parent
        assert parent is not None
        del parent.children[child_key(node.key, tree.page_size)]
        if device_leaf(parent):
            heapq.heappush(heap, (parent.last_access, parent.id, parent))
    return result


def time_evictions(evict: Callable[[], EvictResult], calls: int) -> tuple[float, float]:
    """Median wall and thread-CPU microseconds per call (CPU time is what a shared, loaded
    machine distorts least)."""
    wall, cpu = [], []
    for _ in range(calls):
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        freed = evict().freed_page_ids
        wall.append(time.perf_counter_ns() - t0)
        cpu.append(time.thread_time_ns() - c0)
        assert freed, "the tree ran out of evictable pages"
    return statistics.median(wall) / 1e3, statistics.median(cpu) / 1e3


def bench_eviction(args: argparse.Namespace) -> list[str]:
    t0 = time.perf_counter()
    tree = random_tree(args.evict_nodes, args.seed)
    nodes = count_nodes(tree)
    built_s = time.perf_counter() - t0
    # touch a random tenth of the tree: LRU order is not creation order
    for node in random.Random(args.seed).sample(list(tree.iter_nodes()), nodes // 10):
        tree.match_prefix(array("I", [t for _, n in node.path() for t in n.key]))
    inc_wall, inc_cpu = time_evictions(lambda: tree.tiers.evict_device(1), args.evict_calls)
    tree.check_integrity()  # the incremental heap still equals a rebuild
    old_wall, old_cpu = time_evictions(lambda: evict_device_rebuild(tree, 1), args.rebuild_calls)
    return [
        f"eviction: evict_device(1) on a {nodes}-node tree (page 16, built in {built_s:.1f} s), "
        "median us per call (wall / thread CPU)",
        f"  incremental heap      {inc_wall:>12.2f} / {inc_cpu:>12.2f}  ({args.evict_calls} calls)",
        f"  rebuild on each call  {old_wall:>12.2f} / {old_cpu:>12.2f}  "
        f"({args.rebuild_calls} calls, after)",
        f"  rebuild / incremental {old_wall / inc_wall:>12.0f}x / {old_cpu / inc_cpu:>11.0f}x",
    ]


def row(ps: int, name: str, splits: str, ours: list[float], base: list[float]) -> str:
    o, b = statistics.median(ours), statistics.median(base)
    return f"{ps:>4}  {name:<38} {splits:>7} {o:>10.2f} {b:>10.2f} {o / b:>10.3f} {b / o:>8.1f}x"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--page-sizes", type=int, nargs="*", default=[64, 1])
    p.add_argument("--num-seqs", type=int, default=500)
    p.add_argument("--seq-len", type=int, default=2000)
    p.add_argument("--num-prefixes", type=int, default=20)
    p.add_argument("--prefix-len", type=int, default=580)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--num-queries", type=int, default=200, help="distinct queries per case")
    p.add_argument("--calls", type=int, default=3000, help="timed calls per case")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-memory", dest="memory", action="store_false")
    p.add_argument("--evict-nodes", type=int, default=100_000, help="0: skip eviction")
    p.add_argument("--evict-calls", type=int, default=2000)
    p.add_argument("--rebuild-calls", type=int, default=10)
    args = p.parse_args(argv)
    if not 0 < args.prefix_len < args.seq_len:
        p.error("need 0 < --prefix-len < --seq-len")

    if args.page_sizes:
        work = make_workload(args)
        print(
            f"{args.num_seqs} sequences x {args.seq_len} tokens over {args.num_prefixes} shared "
            f"prefixes of {args.prefix_len} tokens, vocab {args.vocab}; median us per call"
        )
        print(
            f"{'page':>4}  {'case':<38} {'splits':>7} {'ours us':>10} {'base us':>10} "
            f"{'ours/base':>10} {'speedup':>9}"
        )
        for ps in args.page_sizes:
            for line in bench_page_size(ps, work, args):
                print(line, flush=True)
    if args.evict_nodes:
        for line in bench_eviction(args):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
