"""The draft model of speculative decoding: built beside the target, checked against it.

`--speculative-draft-model-path` names a preset, a GGUF file, a checkpoint directory, or
`self`: the target's own weights, built again (an exact copy: with the batch-invariant
float64 path it proposes the target's own tokens, so every proposal is accepted; the
tests' check that the draft's KV is complete and restored). With
`--speculative-draft-quantization` other than none, the draft is re-quantized by
`gpu_worker.model.quant.requantize` (the issue's measured choice for SmolLM2, which has no
smaller model of its vocabulary). The draft must share the target's vocabulary: its
proposals are the target's token ids.

On a TP/PP engine the draft is sharded like the target (`shard.py`): each rank holds the
draft's layers of its own stage and its own KV heads of them, in the pool group's draft
member, and the draft's forwards run through the pipeline and the TP all_reduces as the
target's do. So a draft's heads must split over the TP size as the target's do (`self`
always does; `tiny-draft`'s one KV head does not, `tiny-tp-draft` is its TP-ready sibling),
and a draft of fewer layers than PP stages is refused.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gpu_worker.engine.config import EngineConfig
from gpu_worker.engine.executor import ModelExecutor
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.memory.pool_group import (
    DRAFT,
    TARGET,
    HostRows,
    KVSharding,
    PoolGroup,
    PoolMember,
    draft_host_rows,
)
from gpu_worker.model.config import ModelConfig, parse_dtype
from gpu_worker.model.llama import LlamaModel
from gpu_worker.model.quant import requantize
from gpu_worker.model.shard import ModelShard
from gpu_worker.model.weights import build_model, model_config_of
from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.parallel.groups import ParallelGroups
from gpu_worker.scheduler.spec_config import SELF_DRAFT, SpecConfig
from gpu_worker.scheduler.spec_step import SpecDecoder

QUANT_GROUP_SIZE = 32


def pool_group(
    config: EngineConfig,
    target: ModelConfig,
    kv_spec: KVSpec,
    device: torch.device,
    num_owners: int,
    sharding: KVSharding | None,
    rank: int = 0,
) -> tuple[PoolGroup, LlamaModel | None, int]:
    """The engine's pool group: the target's pool, and with speculation on the draft's as a
    member over the same page ids (built here with the draft model: world rank `rank`'s
    shard of it). Returns the group, the draft model (None without one) and the longest
    context the draft allows."""
    members = [PoolMember(TARGET, kv_spec)]
    draft: LlamaModel | None = None
    context_len = target.context_len
    if config.spec.enabled:
        dtype = parse_dtype(config.dtype)
        draft_config, draft = build_draft(
            config.spec,
            config.model,
            target,
            device,
            dtype,
            config.seed,
            config.batch_invariant,
            config.context_len,
            config.parallel,
            rank,
        )
        context_len = draft_config.context_len
        c = ModelShard.of(draft_config, config.parallel, rank).local_config(draft_config)
        spec = KVSpec(
            c.num_layers, c.num_kv_heads, c.kv_head_dim, kv_spec.page_size, dtype, c.num_kv
        )
        rows = draft_host_rows(config.spec.draft_host_mode, kv_spec, spec)
        members.append(PoolMember(DRAFT, spec, rows, TARGET if rows is HostRows.SIDECAR else None))
    cache = config.cache
    pools = PoolGroup(
        members, cache.num_device_pages, device, cache.check_reads, num_owners, sharding
    )
    return pools, draft, context_len


def spec_decoder(
    config: EngineConfig,
    draft: LlamaModel | None,
    pools: PoolGroup,
    target: ModelExecutor,
    groups: ParallelGroups,
) -> SpecDecoder | None:
    """Speculative decoding's step over the draft's executor and pool (None when off)."""
    if draft is None:
        return None
    assert pools.draft is not None
    if groups.tp is not None:  # the draft's row-parallel layers complete over the TP group
        tp = groups.tp
        draft.set_tp_reduce(lambda t: _all_reduce(t, tp))
    executor = ModelExecutor(
        draft, groups, target.device, target.model_config_whole, guard_tp=target.guard_tp
    )
    return SpecDecoder(
        config.spec,
        executor,
        pools.draft,
        target,
        target.device,
        groups,
        zero_hits=config.debug.spec_zero_draft_hits,
        skip_final_feed=config.debug.spec_skip_final_draft_feed,
        perturb_accept=config.debug.spec_perturb_accept_rank == groups.rank,
    )


def _all_reduce(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    dist.all_reduce(t, group=group)
    return t


def build_draft(
    spec: SpecConfig,
    target_name: str,
    target: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    batch_invariant: bool,
    context_len: int | None,
    parallel: ParallelConfig | None = None,
    rank: int = 0,
) -> tuple[ModelConfig, LlamaModel]:
    """The draft model on `device` in the target's `dtype` (world rank `rank`'s shard of
    it under `parallel`); a clear error when it cannot draft for `target` (another
    vocabulary, heads or layers that do not split like the target's)."""
    assert spec.draft_model is not None
    name = target_name if spec.draft_model == SELF_DRAFT else spec.draft_model
    if parallel is not None and parallel.world_size > 1:
        check_draft_layout(spec, target_name, parallel, context_len)
    config, model = build_model(
        name,
        device,
        dtype,
        seed=seed,
        batch_invariant=batch_invariant,
        context_len=context_len,
        parallel=parallel,
        rank=rank,
    )
    if config.vocab_size != target.vocab_size:
        raise ValueError(
            f"the draft model {spec.draft_model!r} has a vocabulary of {config.vocab_size} "
            f"tokens, the target {target_name!r} {target.vocab_size}: a draft must share "
            "the target's vocabulary"
        )
    if config.mla:
        raise ValueError(f"the draft model {spec.draft_model!r} uses MLA: not supported as a draft")
    if spec.draft_quantization != "none":
        model = requantize(model, spec.draft_quantization, group_size=QUANT_GROUP_SIZE)
    return config, model


def check_draft_layout(
    spec: SpecConfig, target_name: str, parallel: ParallelConfig, context_len: int | None
) -> None:
    """A clear error, naming the draft, when it does not shard over `parallel` (the
    launcher asks before any rank process starts)."""
    assert spec.draft_model is not None
    draft = spec.draft_model
    name = target_name if draft == SELF_DRAFT else draft
    config = model_config_of(name, context_len)
    try:
        for rank in range(parallel.world_size):
            ModelShard.of(config, parallel, rank)
    except ValueError as e:
        raise ValueError(
            f"the draft model {draft!r} does not split over {parallel.describe()} as the "
            f"target does ({e}); a TP/PP engine's draft is sharded like its target: choose "
            "one whose heads divide by the TP size and with a layer per stage (e.g. "
            "tiny-tp-draft, or self)"
        ) from None
