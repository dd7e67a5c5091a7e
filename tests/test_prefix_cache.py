"""PrefixCache-level rules that the tree alone cannot enforce."""

from __future__ import annotations

import torch

from gpu_worker.cache.hicache import CacheConfig, PrefixCache
from gpu_worker.memory.kv_spec import KVSpec

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
