"""An engine rank's L3 storage: which backend it writes to, and which stored objects hold
its part of a page."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.cache.storage_codec import DraftObjects, PageShare, StorageLayout
from gpu_worker.engine.config import EngineConfig
from gpu_worker.memory.pool_group import HostRows, PoolMember
from gpu_worker.model.config import ModelConfig
from gpu_worker.model.shard import ModelShard
from gpu_worker.model.weights import weights_digest
from gpu_worker.scheduler.spec_config import SELF_DRAFT
from gpu_worker.storage import StorageBackend, StorageConfig, default_storage_dir, make_backend
from gpu_worker.storage.layout import StorageNamespace, shard_cells, shard_names


def storage_layout(
    config: EngineConfig, mc: ModelConfig, rank: int, draft: PoolMember | None = None
) -> StorageLayout:
    """Which stored objects hold world rank `rank`'s part of a page of model `mc` (a
    clear error, naming the flag, when the unified grid does not fit the rank's shard).

    A speculative draft (`draft`, the pool group's member; single-rank engines only):
    packed, the target's objects carry the draft's layers too (rank-suffix: the tag names
    the draft; unified: the namespace's model names it and its layers follow the target's,
    so they are their own layer range on the grid); sidecar, each page gets the draft's own
    objects beside the target's (`DraftObjects`: a `.draft-{id}` tag, or a namespace of
    the draft's shape whose model names it), and the target's objects are the ones an
    engine without speculation writes and reads.

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
    tag = draft_tag(config) if draft is not None else ""
    packed = draft is not None and draft.host_rows is HostRows.PACKED
    sidecar = draft if draft is not None and draft.host_rows is HostRows.SIDECAR else None
    extra = draft.spec.num_layers if draft is not None and packed else 0
    if cc.hicache_storage_key_scheme != "unified":
        writes = (tp_rank == 0 or not mc.mla) and writer
        shard = f"{names.shard}.packed-draft-{tag}" if packed else names.shard
        beside = DraftObjects(f"{names.shard}.draft-{tag}") if sidecar else None
        return StorageLayout(shard, layout=names.layout, writes=writes, share=share, draft=beside)
    namespace = StorageNamespace(
        model=f"{config.model}+packed-draft:{tag}" if packed else config.model,
        kv_dtype=config.dtype,
        page_size=cc.page_size,
        replication="mla_replicated" if mc.mla else "mha_sharded",
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.kv_head_dim,
        num_layers=mc.num_layers + extra,
        layer_partition=cc.storage_layer_partition or mc.num_layers + extra,
        head_partition=cc.storage_head_partition,
    )
    model_shard = ModelShard.of(mc, par, rank)
    heads = model_shard.kv_heads(mc)
    cells = shard_cells(
        namespace,
        (model_shard.layers.start, model_shard.layers.stop + extra),
        (heads.start, heads.stop),
        tp_rank,
    )
    if not writer:
        cells = dataclasses.replace(cells, writes=False)
    beside = None
    if sidecar is not None:
        d = sidecar.spec
        draft_ns = StorageNamespace(
            model=f"{config.model}.draft:{tag}",
            kv_dtype=config.dtype,
            page_size=cc.page_size,
            replication="mha_sharded",
            num_kv_heads=d.num_kv_heads,
            head_dim=d.head_dim,
            num_layers=d.num_layers,
            layer_partition=d.num_layers,  # one object per page, every head one group:
            head_partition=d.num_kv_heads,  # the sidecar host pool's own layout
        )
        draft_cells = shard_cells(draft_ns, (0, d.num_layers), (0, d.num_kv_heads), 0)
        beside = DraftObjects(names.shard, draft_ns, draft_cells)
    return StorageLayout(names.shard, namespace, cells, names.layout, share=share, draft=beside)


def draft_tag(config: EngineConfig) -> str:
    """16 hex characters naming the draft whose KV a packed object or a sidecar object
    holds: its weights (`weights_digest`, as the page-hash namespace names the target's) and
    its re-quantization. Another draft (or none) never reads these objects."""
    spec = config.spec
    assert spec.draft_model is not None
    name = config.model if spec.draft_model == SELF_DRAFT else spec.draft_model
    text = f"{weights_digest(name, config.seed)}|{spec.draft_quantization}"
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


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
