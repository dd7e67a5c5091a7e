"""The host tier under CP page sharding (issue 22, build item 6; acceptance 3's host rows).

In a real world of CP ranks (gloo processes), every rank runs one seeded sequence of cache
operations (requests that match, load their host hit back, compute and insert, under device
and host pressure; evictions; matches; flushes) on its sharded cache, and the same sequence
on a replicated cache with the same owner classes (the pages of a CP1 pool, same page ids).
A request's KV is a function of its tokens, written as the model writes it: each rank's
sharded pool keeps only its owned rows. After every operation:

- the trees hold the same device and host pages, and a path's host pages keep its owner
  cycle (host page of path page k on rank k % N), as its device pages do;
- the union of the ranks' host rows is the replicated host pool, byte for byte, and the
  union of their device rows of the tree's pages is the replicated pool's.

And restore -> gather -> attend: a layer's gather waits for the rank's loads in flight
(`PoolGroup.wait_for_restores`). Loads are slowed by injected delays and the load targets
are poisoned (NaN) first; a gather started right after the load was submitted, before its
ACK is consumed, must still pack the loaded rows.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from multirank import run_gloo_ranks

from gpu_worker.cache.hicache import CacheConfig, PrefixCache
from gpu_worker.cache.radix import TreeNode
from gpu_worker.cache.transfer import DelayInjection, TransferKind
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.memory.pool_group import KVSharding, PoolGroup
from gpu_worker.memory.sharded_pool import ShardedDeviceKVPool

CPU = torch.device("cpu")
PS = 2
NUM_PAGES = 24
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=2, page_size=PS, dtype=torch.float32)
PREFIXES = ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8], [1, 2, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5], [])
# (write policy, host layout) per pass of one world
PASSES = [
    ("write_through", "layer_first"),
    ("write_through_selective", "page_first"),
    ("write_back", "layer_first"),
]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 8: torch.int64}[t.element_size()])


def token_kv(ids: list[int], layer: int) -> torch.Tensor:
    """(len(ids), 2, num_kv_heads, head_dim): K and V of each position, a function of the
    tokens up to it (as a model's KV is)."""
    rows = []
    for j in range(len(ids)):
        digest = hashlib.blake2b(repr((ids[: j + 1], layer)).encode(), digest_size=8).digest()
        seed = int.from_bytes(digest, "little") % (1 << 31)
        rows.append(torch.rand(2, SPEC.num_kv_heads, SPEC.head_dim, generator=_gen(seed)))
    return torch.stack(rows)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@dataclass(frozen=True, slots=True)
class Batch:
    """What a sharded pool's gather reads of a batch (`AttendedBatch`)."""

    seq_lens: list[int]
    extend_lens: list[int]
    slot_ids: list[torch.Tensor]


class Pair:
    """A rank's sharded cache and the replicated cache, driven alike."""

    def __init__(
        self, rank: int, world: int, group: Any, policy: str, layout: str, transport: str
    ) -> None:
        cfg = CacheConfig(
            page_size=PS,
            num_device_pages=NUM_PAGES,
            enable_hierarchical_cache=True,
            hicache_ratio=1.0,
            hicache_write_policy=policy,  # type: ignore[arg-type]
            hicache_mem_layout=layout,  # type: ignore[arg-type]
            write_through_threshold=1,
            transfer_delay=DelayInjection(max_ms=30.0, seed=rank),
        )
        sharding = KVSharding(rank, world, group, poison=True, transport=transport)
        pools = PoolGroup.target_only(SPEC, NUM_PAGES, CPU, num_owners=world, sharding=sharding)
        self.n, self.rank = world, rank
        assert isinstance(pools.device, ShardedDeviceKVPool)
        assert pools.device.transport == ("collective" if transport == "collective" else "shm")
        self.sharded = PrefixCache(cfg, SPEC, CPU, pools=pools, cp_size=world)
        plain = dataclasses.replace(cfg, transfer_delay=None)
        self.replicated = PrefixCache(plain, SPEC, CPU, cp_size=world)
        self.caches = (self.sharded, self.replicated)
        self.num_loads_checked = 0  # host hits loaded back (and gathered at once)
        self.most_host_pages = 0  # the most host pages the tree held at a check

    @property
    def pool(self) -> ShardedDeviceKVPool:
        pool = self.sharded.device_pool
        assert isinstance(pool, ShardedDeviceKVPool)
        return pool

    def request(self, prompt: list[int]) -> None:
        """Match, load the host hit back (gathering it before the ACK is consumed), compute
        the rest and insert, on both caches."""
        ps = self.sharded.page_size
        aligned = prompt[: (len(prompt) - 1) // ps * ps]
        if not aligned:
            return
        sharded, replicated = (c.match(prompt) for c in self.caches)
        assert sharded.host_page_ids == replicated.host_page_ids
        if sharded.host_len:
            self.load(prompt, sharded, replicated)
            sharded, replicated = (c.match(prompt) for c in self.caches)
        assert sharded.device_page_ids == replicated.device_page_ids
        device_len = sharded.device_len
        nodes = (sharded.last_device_node, replicated.last_device_node)
        for cache, node in zip(self.caches, nodes, strict=True):
            cache.lock(node)
        num_new = (len(aligned) - device_len) // ps
        new = [c.alloc(num_new, device_len // ps) for c in self.caches]
        assert new[0] == new[1]
        if new[0] is not None and num_new:
            pages = list(sharded.device_page_ids) + new[0]
            self.write_kv(aligned, pages, device_len)
            for cache, own in zip(self.caches, new, strict=True):
                assert own is not None
                cache.insert(aligned, list(sharded.device_page_ids) + own, device_len)
        for cache, node in zip(self.caches, nodes, strict=True):
            cache.unlock(node)

    def load(self, prompt: list[int], sharded: Any, replicated: Any) -> None:
        """Start both loads with the sharded one's target rows poisoned, gather layer 0 of
        the whole prefix at once (the load's copy may still run: the gather waits for it),
        and compare it with the replicated pool's rows."""
        for cache, match in zip(self.caches, (sharded, replicated), strict=True):
            cache.lock(match.last_device_node)
        allocator = self.sharded.device_pool.allocator
        free = sorted(allocator.free_set())
        local = [q // self.n for q in free if q % self.n == self.rank]
        for j in local:  # what a load writes was NaN before it
            self.pool.kv[:, :, j * PS : (j + 1) * PS] = float("nan")
        tickets = [c.start_load(m) for c, m in zip(self.caches, (sharded, replicated), strict=True)]
        assert (tickets[0] is None) == (tickets[1] is None)
        if tickets[0] is not None and tickets[1] is not None:
            assert tickets[0].page_ids == tickets[1].page_ids
            self.replicated.drain()
            pages = list(sharded.device_page_ids) + tickets[0].page_ids
            length = len(pages) * PS
            slots = self.pool.slot_ids(pages, length)
            batch = Batch([length], [0], [slots])
            self.pool.before_attention(0, batch)  # packs layer 0, prefetches layer 1
            k, v = self.pool.get_kv(0, slots)
            want_k, want_v = self.replicated.device_pool.get_kv(0, slots)
            assert torch.equal(bits(k), bits(want_k)) and torch.equal(bits(v), bits(want_v)), (
                "a gather packed rows whose load had not landed"
            )
            self.pool.before_attention(1, batch)
            self.num_loads_checked += 1
        self.sharded.drain()
        for cache, match in zip(self.caches, (sharded, replicated), strict=True):
            cache.unlock(match.last_device_node)

    def write_kv(self, ids: list[int], pages: list[int], start: int) -> None:
        """The KV of tokens `[start, len(ids))` over `pages`, written as the model does."""
        for layer in range(SPEC.num_layers):
            kv = token_kv(ids, layer)[start:]
            for cache in self.caches:
                slots = cache.device_pool.slot_ids(pages, len(ids))[start:]
                cache.device_pool.set_kv(layer, slots, kv[:, 0], kv[:, 1])

    def step(self, rng: random.Random) -> None:
        op = rng.random()
        if op < 0.6:
            tail = [rng.randint(1, 4) for _ in range(rng.randint(0, 6))]
            self.request(PREFIXES[rng.randrange(len(PREFIXES))] + tail + [0])
        elif op < 0.8:
            num_pages = rng.randint(1, 10)
            for cache in self.caches:
                cache.drain()
                cache.evict_device(num_pages)
        elif op < 0.97:
            prompt = PREFIXES[rng.randrange(len(PREFIXES))] + [rng.randint(1, 4), 0]
            for cache in self.caches:
                cache.match(prompt)
        else:
            for cache in self.caches:
                cache.flush()

    def check(self, group: Any) -> None:
        for cache in self.caches:
            cache.drain()
            cache.check_integrity()
        s, r = self.sharded.tree, self.replicated.tree
        assert s.device_page_set() == r.device_page_set()
        assert s.host_page_set() == r.host_page_set()
        self.most_host_pages = max(self.most_host_pages, len(s.host_page_set()))
        for node in s.iter_nodes():
            check_cycle(node, self.n)
        check_union(self, group)


def check_cycle(node: TreeNode, n: int) -> None:
    """Page k of a path, on either tier, belongs to CP rank k % N."""
    first = (node.path_len() - len(node.key)) // PS
    for pages in (node.device_page_ids, node.host_page_ids):
        if pages is not None:
            assert [p % n for p in pages] == [(first + i) % n for i in range(len(pages))], node


def check_union(pair: Pair, group: Any) -> None:
    """The ranks' host rows, put back at their logical pages, are the replicated host pool
    (all of it: both saw the same copies of the same bytes); their device rows of the
    tree's pages are the replicated pool's."""
    n = pair.n
    host, want_host = pair.sharded.host_pool, pair.replicated.host_pool
    assert host is not None and want_host is not None and host.sharded
    full = _union(host.kv, host.layout, want_host.kv, n, group)
    assert torch.equal(bits(full), bits(want_host.kv)), "host rows differ from the CP1 pool"
    device = _union(pair.pool.kv, "layer_first", pair.replicated.device_pool.kv, n, group)
    for q in pair.sharded.tree.device_page_set():
        rows = slice(q * PS, (q + 1) * PS)
        got, want = device[:, :, rows], pair.replicated.device_pool.kv[:, :, rows]
        assert torch.equal(bits(got), bits(want)), f"device page {q} differs"


def _union(mine: torch.Tensor, layout: str, like: torch.Tensor, n: int, group: Any) -> torch.Tensor:
    """Every rank's local pages of a pool, at their logical pages, in `like`'s shape."""
    parts = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(parts, mine.contiguous(), group=group)
    page_dim = 2 if layout == "layer_first" else 0
    step = PS if layout == "layer_first" else 1
    full = torch.empty_like(like)
    num_pages = like.shape[page_dim] // step
    for q in range(num_pages):
        j, r = q // n, q % n
        src = parts[r].narrow(page_dim, j * step, step)
        full.narrow(page_dim, q * step, step).copy_(src)
    return full


def host_world(rank: int, world: int, group: Any, transport: str = "auto") -> None:
    """`transport`: the gather's; auto is shm here (CPU ranks of one host), where a rank
    reads its peers' rows, so a load must have landed on the owner, not only on itself."""
    for seed, (policy, layout) in enumerate(PASSES):
        pair = Pair(rank, world, group, policy, layout, transport)
        rng = random.Random(100 * world + seed)
        for _ in range(120):
            pair.step(rng)
            pair.check(group)
        assert pair.num_loads_checked > 0 and pair.most_host_pages > 0, policy
        for cache in pair.caches:
            cache.close()


# ---------------------------------------------------------------- the world


@pytest.mark.parametrize("transport", ["auto", "collective"])
def test_host_rows_are_owned_and_loads_land_before_gathers_cp2(transport: str) -> None:
    run_gloo_ranks(functools.partial(host_world, transport=transport), 2)


def test_host_rows_are_owned_and_loads_land_before_gathers_cp4() -> None:
    run_gloo_ranks(host_world, 4)


# ---------------------------------------------------------------- restore -> gather


def test_a_gather_waits_for_the_loads_of_its_own_pages_only() -> None:
    """One sharded rank (no collective): while a slow load of A's pages runs, a gather of
    other pages goes ahead without waiting for it, and a gather of A's pages waits and
    packs the loaded rows. The seed makes the load the slow one (the third copy: 229 ms
    after two backups); the test checks that it is still running when it should be."""
    cfg = CacheConfig(
        page_size=PS,
        num_device_pages=NUM_PAGES,
        enable_hierarchical_cache=True,
        transfer_delay=DelayInjection(max_ms=300.0, seed=1),
    )
    sharding = KVSharding(0, 1, None, poison=True)
    cache = PrefixCache(
        cfg, SPEC, CPU, pools=PoolGroup.target_only(SPEC, NUM_PAGES, CPU, sharding=sharding)
    )
    pool = cache.device_pool
    assert isinstance(pool, ShardedDeviceKVPool) and cache.transfers is not None
    a, b = list(range(1, 9)), list(range(11, 19))

    def write(ids: list[int], pages: list[int]) -> torch.Tensor:
        slots = pool.slot_ids(pages, len(ids))
        for layer in range(SPEC.num_layers):
            kv = token_kv(ids, layer)
            pool.set_kv(layer, slots, kv[:, 0], kv[:, 1])
        return slots

    for ids in (a, b):  # two backups (write_through)
        pages = cache.alloc(len(ids) // PS)
        assert pages is not None
        write(ids, pages)
        cache.insert(ids, pages, 0)
    cache.drain()
    cache.evict_device(NUM_PAGES)
    pool.kv.fill_(float("nan"))  # what a load has not written reads as NaN
    match = cache.match([*a, 0])
    cache.lock(match.last_device_node)
    ticket = cache.start_load(match)
    assert ticket is not None
    (load,) = cache.transfers.in_flight(TransferKind.LOAD)

    other = cache.alloc(2)  # pages no load writes
    assert other is not None
    slots = write(b[:4], other)
    pool.before_attention(0, Batch([4], [0], [slots]))
    assert not load.completion.done(), "the gather of other pages waited for the load"

    slots = pool.slot_ids(ticket.page_ids, len(a))
    pool.before_attention(0, Batch([len(a)], [0], [slots]))
    assert load.completion.done()
    k, v = pool.get_kv(0, slots)
    want = token_kv(a, 0)
    assert torch.equal(bits(k), bits(want[:, 0])) and torch.equal(bits(v), bits(want[:, 1]))
    cache.drain()
    cache.unlock(match.last_device_node)
    cache.free(other)
    cache.check_integrity()
    cache.close()


# ---------------------------------------------------------------- host memory per rank


def host_sizes(engine: Any) -> tuple[int, int]:
    pool = engine.cache.host_pool
    return pool.num_pages, pool.num_local_pages


def test_hicache_size_is_per_rank_under_sharding() -> None:
    """`--hicache-size` is each rank's host memory: a sharded CP2 rank holds that many
    pages of its own, so the logical host pool is twice as large (`--hicache-ratio` is of
    the logical device pool, sharded or not)."""
    from multirank import run_world

    from gpu_worker.engine.engine import EngineConfig
    from gpu_worker.parallel.config import ParallelConfig

    page_bytes = 4 * 2 * PS * 2 * 16 * 8  # tiny: layers x K/V x tokens x KV heads x dim x f64
    cache = CacheConfig(
        page_size=PS,
        num_device_pages=NUM_PAGES,
        enable_hierarchical_cache=True,
        hicache_size_gb=40 * page_bytes / 1e9,
    )
    cfg = EngineConfig(
        model="tiny", cache=cache, parallel=ParallelConfig(cp_size=2, kv_sharding=True)
    )
    assert run_world(cfg, host_sizes) == (80, 40)  # replicated CP2 holds (40, 40)
