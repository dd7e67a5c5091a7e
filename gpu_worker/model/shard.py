"""A rank's shard of the model: its pipeline stage's layers and its tensor-parallel slices.

Megatron-style tensor parallelism, as SGLang and vLLM do it for Llama:
- column-parallel `q_proj`, `k_proj`, `v_proj` (whole heads: rank `t` of `n` takes query
  heads `[t * H / n, (t + 1) * H / n)` and the KV heads they read, so GQA groups stay
  together), `gate_proj` and `up_proj` (a slice of the intermediate width);
- row-parallel `o_proj` and `down_proj` (the matching input columns): their outputs are
  partial sums that one all_reduce over the TP group completes;
- embedding and LM head replicated (the models here are small; a vocab-parallel head would
  need an all_gather of logits every step), as are the norms.
So each rank's KV pool holds only its own KV heads of its own stage's layers.

MLA (`ModelConfig.mla`): the query heads, the K and V up-projections (`k_b_proj`,
`v_b_proj`: column-parallel by whole heads) and `o_proj` (row-parallel) split the same way;
the latent projection (`kv_a_proj`) and its norm are replicated, so every TP rank of a stage
computes and caches the same latent rows (its one "KV head", `kv_heads` = range(0, 1)).

The shard is cut from the whole model's weights, so a TP/PP engine computes with exactly
the weights a single-rank engine has (seeded random weights are drawn for the whole model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.model.config import ModelConfig
from gpu_worker.model.llama import LlamaModel, create_model
from gpu_worker.parallel.config import ParallelConfig, check_tp_divides, stage_layers


@dataclass(frozen=True, slots=True)
class ModelShard:
    """Which part of the model one rank runs."""

    layers: range  # the global layer ids of its stage
    num_layers_total: int
    tp_rank: int = 0
    tp_size: int = 1

    @classmethod
    def of(cls, config: ModelConfig, parallel: ParallelConfig, rank: int) -> ModelShard:
        """The shard of world rank `rank`; a clear error when the model does not split."""
        check_tp_divides(
            config.num_heads,
            config.num_kv_heads,
            config.intermediate_size,
            parallel.tp_size,
            kv_replicated=config.mla,
        )
        where = parallel.coords(rank)
        layers = stage_layers(config.num_layers, parallel.pp_size, where.pp)
        return cls(layers, config.num_layers, where.tp, parallel.tp_size)

    @property
    def first_stage(self) -> bool:
        return self.layers.start == 0

    @property
    def last_stage(self) -> bool:
        return self.layers.stop == self.num_layers_total

    @property
    def whole(self) -> bool:
        return self.tp_size == 1 and self.first_stage and self.last_stage

    def kv_heads(self, config: ModelConfig) -> range:
        """The global KV heads this rank holds (whole GQA groups, in TP order; MLA's one
        latent "head" on every rank)."""
        if config.mla:
            return range(config.num_kv_heads)
        per = config.num_kv_heads // self.tp_size
        return range(self.tp_rank * per, (self.tp_rank + 1) * per)

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The shard's own sizes: its heads, its MLP width, its layers."""
        n = self.tp_size
        return config.replace(
            num_heads=config.num_heads // n,
            num_kv_heads=len(self.kv_heads(config)),
            intermediate_size=config.intermediate_size // n,
            num_layers=len(self.layers),
        )


def _tp_slice(name: str, full: torch.Tensor, shard: ModelShard) -> torch.Tensor:
    """The part of the whole model's tensor `name` (local parameter name) this rank holds."""
    t, n = shard.tp_rank, shard.tp_size
    if n == 1:
        return full
    column_parallel = (
        ".q_proj.",
        ".k_proj.",
        ".v_proj.",
        ".k_b_proj.",  # MLA's per-head up-projections
        ".v_b_proj.",
        ".gate_proj.",
        ".up_proj.",
    )
    if any(part in name for part in column_parallel):  # output rows (and bias) split
        rows = full.shape[0] // n
        return full[t * rows : (t + 1) * rows]
    if ".o_proj." in name or ".down_proj." in name:  # input columns split
        cols = full.shape[1] // n
        return full[:, t * cols : (t + 1) * cols]
    return full  # embedding, norms, LM head, MLA's latent projection: replicated


def _global_name(name: str, shard: ModelShard) -> str:
    """`layers.{j}.x` of the shard is `layers.{start + j}.x` of the whole model."""
    if not name.startswith("layers."):
        return name
    _, j, rest = name.split(".", 2)
    return f"layers.{shard.layers.start + int(j)}.{rest}"


@torch.no_grad()
def shard_model(
    full: LlamaModel, shard: ModelShard, device: torch.device | str, dtype: torch.dtype
) -> LlamaModel:
    """A new model on `device` holding `shard`'s part of `full`'s weights (copied)."""
    config = shard.local_config(full.config)
    model = create_model(
        config,
        device,
        dtype,
        full.batch_invariant,
        first_stage=shard.first_stage,
        last_stage=shard.last_stage,
    )
    source = dict(full.named_parameters())
    for name, param in model.named_parameters():
        param.copy_(_tp_slice(name, source[_global_name(name, shard)], shard))
    return model
