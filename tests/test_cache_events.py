"""The KV events the cache produces on eviction and tier moves, exactly (issue 7).

The index keeps Redis current only from these events, so an eviction that emitted no
`removed` event would leave the router steering requests to KV that is gone. Each test pins
which page hashes, which tier, in which order, through the public API only (RadixTree and
PrefixCache verbs, `drain_events()`).
"""

from __future__ import annotations

import torch

from bus_schemas.page_hash import page_hashes
from gpu_worker.cache.hicache import CacheConfig, PrefixCache
from gpu_worker.cache.kv_events import KVEventRecord
from gpu_worker.cache.radix import RadixTree
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.memory.allocator import HostPageId
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.model.sampling import SamplingParams

NS = "tiny|float64|p4"
PS = 4
A = list(range(16))  # 4 pages
B = A[:8] + list(range(100, 108))  # shares A's first 2 pages
HA = page_hashes(A, PS, NS)
HB = page_hashes(B, PS, NS)
HOST_PAGES = [HostPageId(p) for p in (10, 11, 12, 13)]
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, page_size=PS, dtype=torch.float64)


def stored(tier: str, hashes: list[str]) -> KVEventRecord:
    return KVEventRecord("stored", tier, hashes)


def removed(tier: str, hashes: list[str]) -> KVEventRecord:
    return KVEventRecord("removed", tier, hashes)


def tree_with_a_and_b() -> RadixTree:
    """A then B (B splits A after 2 pages); LRU order: A's tail, then B's tail."""
    tree = RadixTree(PS, NS)
    tree.insert(A, [0, 1, 2, 3])
    tree.insert(B, [0, 1, 4, 5])
    assert tree.drain_events() == [stored("device", HA), stored("device", HB[2:])]
    return tree


def test_device_eviction_removes_each_leaf_in_lru_order() -> None:
    tree = tree_with_a_and_b()
    assert sorted(tree.tiers.evict_device(2).freed_page_ids) == [2, 3]  # A's tail, the oldest leaf
    assert tree.drain_events() == [removed("device", HA[2:])]
    tree.tiers.evict_device(100)  # everything: B's tail, then the shared head (a leaf by then)
    assert tree.drain_events() == [removed("device", HB[2:]), removed("device", HA[:2])]
    assert tree.num_device_pages == 0 and tree.drain_events() == []


def test_a_touched_leaf_is_evicted_last() -> None:
    tree = tree_with_a_and_b()
    tree.insert(A, [0, 1, 2, 3])  # A again: all duplicate pages, A's tail is now the newest
    assert tree.drain_events() == []  # nothing new is stored
    tree.tiers.evict_device(2)
    assert tree.drain_events() == [removed("device", HB[2:])]


def test_backup_then_device_eviction_moves_pages_to_host() -> None:
    tree = tree_with_a_and_b()
    a_tail = tree.match_prefix([*A, 0]).last_node
    tree.tiers.mark_backup_pending(a_tail, 0)
    assert tree.drain_events() == []  # nothing is on the host before the ACK is consumed
    tree.tiers.commit_backup(a_tail, 0, HOST_PAGES)
    # one record per node on the path, root side first
    assert tree.drain_events() == [stored("host", HA[:2]), stored("host", HA[2:])]
    tree.tiers.evict_device(100)
    # A's tail and head drop to host (no host event), B's tail is deleted
    events = tree.drain_events()
    assert sorted(events) == sorted(
        [removed("device", HA[2:]), removed("device", HB[2:]), removed("device", HA[:2])]
    )
    assert events.index(removed("device", HA[2:])) < events.index(removed("device", HA[:2]))
    assert events.index(removed("device", HB[2:])) < events.index(removed("device", HA[:2]))
    assert tree.num_host_pages == 4
    # host eviction: leaf first, then its parent
    assert tree.tiers.evict_host(100) == [12, 13, 10, 11]
    assert tree.drain_events() == [removed("host", HA[2:]), removed("host", HA[:2])]
    assert tree.num_host_pages == 0


def test_write_back_eviction_emits_nothing_until_the_backup_lands() -> None:
    tree = tree_with_a_and_b()
    result = tree.tiers.evict_device(2, delete_unbacked=False)
    assert result.freed_page_ids == [] and len(result.unbacked) == 2
    assert tree.drain_events() == []  # nothing left the device yet
    a_tail = tree.match_prefix([*A, 0]).last_node
    tree.tiers.mark_backup_pending(a_tail, 0)
    tree.tiers.commit_backup(a_tail, 0, HOST_PAGES)
    assert tree.drain_events() == [stored("host", HA[:2]), stored("host", HA[2:])]
    assert sorted(tree.tiers.evict_device(2, delete_unbacked=False).freed_page_ids) == [2, 3]
    assert tree.drain_events() == [removed("device", HA[2:])]


def test_cache_write_back_eviction_stores_host_then_removes_device() -> None:
    """PrefixCache with write_back: evicting backs the leaf up first, then drops it."""
    cfg = CacheConfig(
        page_size=PS,
        num_device_pages=8,
        enable_hierarchical_cache=True,
        hicache_write_policy="write_back",
    )
    cache = PrefixCache(cfg, SPEC, torch.device("cpu"), NS)
    pages = cache.alloc(4)
    assert pages is not None
    cache.insert(A, pages, cached_len=0)
    assert cache.drain_events() == [stored("device", HA)]
    cache.evict_device(4)
    assert cache.drain_events() == [stored("host", HA), removed("device", HA)]
    assert cache.num_free_device_pages == 8 and cache.tree.num_host_pages == 4
    cache.check_integrity()
    cache.close()


def test_engine_events_after_device_pressure() -> None:
    """A device pool of 6 pages and 13-token prompts (4 pages while running, 3 cached after):
    each new prompt evicts the one before,
    and the events say so, in order, with the exact hashes."""
    cfg = CacheConfig(page_size=PS, num_device_pages=6)
    eng = Engine(EngineConfig(cache=cfg))
    sp = SamplingParams(max_new_tokens=1, ignore_eos=True)
    prompts = [[i * 20 + t for t in range(13)] for i in range(3)]  # 12 aligned + 1 token
    held = [page_hashes(p[:12], PS, eng.namespace) for p in prompts]
    eng.generate(prompts[0], sp)
    assert eng.cache.drain_events() == [stored("device", held[0])]
    eng.generate(prompts[1], sp)  # 3 cached + 4 needed > 6: the first prompt is evicted
    events = eng.cache.drain_events()
    assert events[0] == removed("device", held[0])  # the whole leaf goes at once
    assert events[1:] == [stored("device", held[1])]
    eng.generate(prompts[2], sp)
    assert eng.cache.drain_events() == [removed("device", held[1]), stored("device", held[2])]
    eng.check_integrity()
    eng.close()


def test_eviction_counters_count_the_pages_each_tier_gave_up() -> None:
    """`cache_stats()` counts evicted pages per tier (the heartbeat and the router's
    `hicache_engine_evicted_*_pages` carry them): 6 device pages and 6 host pages, three
    3-page prompts written through; the third evicts the first from the host tier."""
    cfg = CacheConfig(
        page_size=PS, num_device_pages=6, enable_hierarchical_cache=True, hicache_ratio=1.0
    )
    eng = Engine(EngineConfig(cache=cfg))
    sp = SamplingParams(max_new_tokens=1, ignore_eos=True)
    prompts = [[i * 20 + t for t in range(13)] for i in range(3)]
    seen = []
    for p in prompts:
        eng.generate(p, sp)
        eng.cache.drain()
        s = eng.cache_stats()
        seen.append((s["evicted_device_pages"], s["evicted_host_pages"]))
    assert seen == [(0, 0), (3, 0), (6, 3)]
    eng.check_integrity()
    eng.close()
