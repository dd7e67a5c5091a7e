"""The draft model of speculative decoding: built beside the target, checked against it.

`--speculative-draft-model-path` names a preset, a GGUF file, a checkpoint directory, or
`self`: the target's own weights, built again (an exact copy: with the batch-invariant
float64 path it proposes the target's own tokens, so every proposal is accepted; the
tests' check that the draft's KV is complete and restored). With
`--speculative-draft-quantization` other than none, the draft is re-quantized by
`gpu_worker.model.quant.requantize` (the issue's measured choice for SmolLM2, which has no
smaller model of its vocabulary). The draft must share the target's vocabulary: its
proposals are the target's token ids.
"""

from __future__ import annotations

import torch

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
from gpu_worker.model.weights import build_model
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
) -> tuple[PoolGroup, LlamaModel | None, int]:
    """The engine's pool group: the target's pool, and with speculation on the draft's as a
    member over the same page ids (built here with the draft model). Returns the group, the
    draft model (None without one) and the longest context the draft allows."""
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
        )
        context_len = draft_config.context_len
        c = draft_config
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
    return SpecDecoder(
        config.spec,
        ModelExecutor(draft, groups, target.device, target.model_config_whole),
        pools.draft,
        target,
        target.device,
        zero_hits=config.debug.spec_zero_draft_hits,
        skip_final_feed=config.debug.spec_skip_final_draft_feed,
    )


def build_draft(
    spec: SpecConfig,
    target_name: str,
    target: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    batch_invariant: bool,
    context_len: int | None,
) -> tuple[ModelConfig, LlamaModel]:
    """The draft model on `device` in the target's `dtype`; a clear error when it cannot
    draft for `target` (another vocabulary, a shorter context)."""
    assert spec.draft_model is not None
    name = target_name if spec.draft_model == SELF_DRAFT else spec.draft_model
    config, model = build_model(
        name, device, dtype, seed=seed, batch_invariant=batch_invariant, context_len=context_len
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
        model = _requantize(model, spec.draft_quantization)
    return config, model


def _requantize(model: LlamaModel, scheme: str) -> LlamaModel:
    try:
        # S2's module (issue 23 build 2); until it lands, the scheme is refused clearly
        from gpu_worker.model import quant  # type: ignore[attr-defined,unused-ignore]
    except ImportError as e:
        raise ValueError(
            f"--speculative-draft-quantization {scheme} is not available: the re-quantizer "
            f"(gpu_worker.model.quant) is missing ({e})"
        ) from None
    requantized: LlamaModel = quant.requantize(model, scheme, group_size=QUANT_GROUP_SIZE)
    return requantized
