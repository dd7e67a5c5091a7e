"""PrefixCache-level rules that the tree alone cannot enforce."""

from __future__ import annotations

import torch

from gpu_worker.cache.hicache import CacheConfig, PrefixCache
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.memory.pool_group import PoolGroup

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, page_size=1, dtype=torch.float32)


def test_backup_with_a_full_host_pool_keeps_the_host_set_prefix_closed() -> None:
    """Making room for a backup must not evict the host copy of the path it extends."""
    cfg = CacheConfig(
        page_size=1,
        num_device_pages=4,
        enable_hierarchical_cache=True,
        hicache_ratio=0.25,
        hicache_write_policy="write_through",
    )
    cache = PrefixCache(cfg, SPEC, torch.device("cpu"))
    first = cache.alloc(1)
    assert first is not None
    cache.insert([1], first, cached_len=0)  # backs [1] up into the only host page
    cache.drain()
    assert cache.tree.num_host_pages == 1
    second = cache.alloc(1)
    assert second is not None
    cache.insert([1, 2], first + second, cached_len=1)  # no host room for [2]: no backup
    cache.drain()
    cache.check_integrity()
    assert cache.tree.match_prefix([1]).last_node.on_host
    cache.close()


def test_the_cache_moves_its_pool_groups_rows_between_the_tiers() -> None:
    """The cache takes its pools from the group it is given: the device pool the model
    writes is the group's, the host tier attaches the group's host pool, and a backup and a
    load move the group's rows of a page, flushed stats included."""
    cpu = torch.device("cpu")
    group = PoolGroup.target_only(SPEC, 4, cpu)
    cfg = CacheConfig(page_size=1, num_device_pages=4, enable_hierarchical_cache=True)
    cache = PrefixCache(cfg, SPEC, cpu, pools=group)
    assert cache.device_pool is group.device and cache.host_pool is group.host is not None
    pages = cache.alloc(2)
    assert pages is not None
    rows = torch.randn(2, 1, 8)
    group.device.set_kv(0, torch.tensor(pages), rows, -rows)
    cache.insert([5, 6], pages, cached_len=0)  # backs [5, 6] up (write_through)
    cache.drain()
    cache.evict_device(2)  # the host copy stays
    stats = cache.stats
    assert stats.num_backups == 1 and stats.evicted_device_pages == 2
    match = cache.match([5, 6, 7])
    assert match.device_len == 0 and match.host_len == 2
    cache.lock(match.last_device_node)
    ticket = cache.start_load(match)
    assert ticket is not None
    cache.drain()
    assert ticket.done and not ticket.failed
    k, v = group.device.get_kv(0, torch.tensor(ticket.page_ids))
    assert torch.equal(k, rows) and torch.equal(v, -rows)
    cache.unlock(match.last_device_node)
    cache.flush()
    assert cache.stats is stats and stats.num_backups == 0 and stats.num_loads == 0
    cache.check_integrity()
    cache.close()
