"""An engine rank's L3 storage: which backend it writes to, and which stored objects hold
its part of a page."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.cache.storage_codec import PageShare, StorageLayout
from gpu_worker.engine.config import EngineConfig
from gpu_worker.model.config import ModelConfig
from gpu_worker.model.shard import ModelShard
from gpu_worker.storage import StorageBackend, StorageConfig, default_storage_dir, make_backend
from gpu_worker.storage.layout import StorageNamespace, shard_cells, shard_names


def storage_layout(config: EngineConfig, mc: ModelConfig, rank: int) -> StorageLayout:
    """Which stored objects hold world rank `rank`'s part of a page of model `mc` (a
    clear error, naming the flag, when the unified grid does not fit the rank's shard).

    MLA's latent is replicated over TP: under either key scheme only TP rank 0 of each
    stage writes a page's objects, and every TP rank reads those (rank-suffix: all name
    them `tp0of{T}...`; unified: `mla_replicated` cells have no `_H`).

    Replicated CP is replication too: every CP rank holds what the rank of its stage and TP
    index holds at CP 1, so under either scheme it names that rank's objects (a CP1 engine
    of the same TP x PP layout shares them) and only CP rank 0 writes them.

    Sharded CP (`--enable-kv-cache-sharding`): a page is whole on its owner CP rank, so the
    objects are again those of the CP1 rank of its stage and TP index, byte for byte; each
    CP rank reads, writes and looks up only the pages it owns (`PageShare`), so every page
    object is written once, by its owner, and any topology reads it (unified scheme)."""
    cc, whole = config.cache, config.parallel
    where = whole.coords(rank)
    par = dataclasses.replace(whole, cp_size=1, kv_sharding=False)  # the CP1 layout
    rank, tp_rank = par.rank_of(where.pp, where.tp), where.tp
    writer = where.cp == 0 or whole.kv_sharding
    share = PageShare(where.cp, whole.cp_size) if whole.kv_sharding else None
    names = shard_names(par, rank, replicated=mc.mla)
    if cc.hicache_storage_key_scheme != "unified":
        writes = (tp_rank == 0 or not mc.mla) and writer
        return StorageLayout(names.shard, layout=names.layout, writes=writes, share=share)
    namespace = StorageNamespace(
        model=config.model,
        kv_dtype=config.dtype,
        page_size=cc.page_size,
        replication="mla_replicated" if mc.mla else "mha_sharded",
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.kv_head_dim,
        num_layers=mc.num_layers,
        layer_partition=cc.storage_layer_partition or mc.num_layers,
        head_partition=cc.storage_head_partition,
    )
    model_shard = ModelShard.of(mc, par, rank)
    heads = model_shard.kv_heads(mc)
    cells = shard_cells(
        namespace,
        (model_shard.layers.start, model_shard.layers.stop),
        (heads.start, heads.stop),
        tp_rank,
    )
    if not writer:
        cells = dataclasses.replace(cells, writes=False)
    return StorageLayout(names.shard, namespace, cells, names.layout, share=share)


def storage_backend(cc: CacheConfig) -> StorageBackend | None:
    """External storage for this rank, when a backend is configured."""
    if cc.hicache_storage_backend is None:
        return None
    return make_backend(
        StorageConfig(
            backend=cc.hicache_storage_backend,
            directory=Path(cc.hicache_storage_dir or default_storage_dir()),
            capacity_bytes=None
            if cc.hicache_storage_size_gb is None
            else int(cc.hicache_storage_size_gb * 1e9),
            key_file=Path(cc.hicache_storage_key_file) if cc.hicache_storage_key_file else None,
        )
    )
