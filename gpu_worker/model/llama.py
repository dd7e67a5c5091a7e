"""A Llama/Qwen2-style decoder that reads and writes KV through a `KVCache`.

All linear layers run once over the concatenated new tokens of the batch (T, hidden);
attention runs per request, its new queries over the request's whole cached sequence.

With `batch_invariant` (SGLang's `--enable-deterministic-inference`), every row's result is
bit-identical whatever else is in the batch: torch's CPU matmul and SDPA pick kernels by
shape, so a token computed in a 1-row decode step and in a 64-row prefill chunk differ in
the last bits. The float64 cache oracle needs that invariance to demand identical logits
from a cache hit and a cold run; it costs speed and is off by default.
Module names follow Hugging Face (`layers.{i}.self_attn.q_proj`, ...) so that a checkpoint
maps onto this model by dropping the `model.` prefix.

A tensor- or pipeline-parallel rank runs a shard of this model (`gpu_worker/model/shard.py`):
its `ModelConfig` has the rank's own head counts and MLP width, `layers` are its stage's
(numbered from 0 locally: the KV pool holds only them), only the first stage embeds and only
the last one normalises and computes logits; the row-parallel outputs (`o_proj`,
`down_proj`) are partial sums that `tp_reduce` (an all_reduce over the TP group) completes.

A context-parallel rank under a prefill split (`cp_split.py`, `--cp-split`) runs only its
rows of a batch: the embedding, projections, norms and MLP see those rows; each attention
layer all-gathers the new K/V over the CP group before writing them, so every rank writes
and attends the whole chunk's K/V; the last requests' hidden states are gathered before the
LM head, so every rank samples from the same logits.

A config with `kv_lora_rank > 0` swaps GQA for `MLAttention`, a simplified multi-head latent
attention (DeepSeek-V2 style, without query compression or weight absorption).

The parts live beside this module: `layers.py` (linear layers, norms, rotary embedding,
MLP), `attention_plan.py` (what attention reads, planned once per pass), `attention.py`
(GQA, with the in-place decode path) and `mla.py`. Before each layer the model calls the
KV cache's `before_attention` hook (`forward_batch.KVReader`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.model.attention import Attention
from gpu_worker.model.attention_plan import AttentionPlan
from gpu_worker.model.config import ModelConfig
from gpu_worker.model.cp_split import CPSplit, CPSplitConfig
from gpu_worker.model.forward_batch import ForwardBatch, KVCache
from gpu_worker.model.layers import (
    MLP,
    Embedding,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    TPReduce,
    batch_invariant_linear,
    can_prepack,
    pack_weight,
    packed_linear,
)
from gpu_worker.model.mla import MLAttention


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = (MLAttention if config.mla else Attention)(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        plan: AttentionPlan,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """h (T, hidden) -> (T, hidden)."""
        h = h + self.self_attn(self.input_layernorm(h), rope, plan, kv_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LayerProgress:
    """Decoder layers a model instance has run (read from other threads: an int is atomic)."""

    __slots__ = ("layers_run",)

    def __init__(self) -> None:
        self.layers_run = 0


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and lm_head (maybe tied).

    `first_stage` / `last_stage`: which ends of the model this instance holds. A middle or
    last pipeline stage takes hidden states instead of token ids; a first or middle stage
    returns hidden states instead of logits. A whole model is both.
    """

    def __init__(
        self, config: ModelConfig, first_stage: bool = True, last_stage: bool = True
    ) -> None:
        super().__init__()
        self.config = config
        self.first_stage, self.last_stage = first_stage, last_stage
        tied = config.tie_word_embeddings
        self.embed_tokens: Embedding | None = None
        if first_stage or (last_stage and tied):
            self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm: RMSNorm | None = None
        # Tied: the logits reuse `embed_tokens.weight`, so there is no second parameter
        # whose sharing a device move or `to_empty` could silently break.
        self.lm_head: Linear | None = None
        if last_stage:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            if not tied:
                self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.rope_dim, config.context_len, config.rope_theta)
        self.batch_invariant = False  # set_batch_invariant()
        self.cp_split: CPSplitConfig | None = None  # set_cp_split()
        self._split_of: tuple[ForwardBatch, CPSplit | None] | None = None  # the last batch's
        # prepack_weights(): a packed copy of the tied embedding for the logits (the lookup
        # needs the plain one); not a parameter, so checkpoints and shards never see it.
        self.packed_logits: torch.Tensor | None = None
        # decoder layers run so far: grows within a long forward, so a watcher on another
        # thread (the engine service) tells a slow prefill from a hung one. Counted in a
        # plain object: `+=` on a Module attribute goes through `Module.__setattr__` (its
        # parameter/buffer/module checks), which cost ~3 us a layer in every decode step.
        self.progress = LayerProgress()

    @property
    def num_layers(self) -> int:
        """Layers this instance runs (its stage's, under pipeline parallelism)."""
        return self.config.num_layers

    def set_batch_invariant(self, enabled: bool) -> None:
        """Make every row's result independent of the batch around it (see the module doc)."""
        self.batch_invariant = enabled
        if enabled:
            self.unpack_weights()
        for module in self.modules():
            if isinstance(module, Linear | Attention | MLAttention):
                module.batch_invariant = enabled

    def prepack_weights(self) -> int:
        """Reorder every float32 CPU linear weight (and a tied LM head's) for oneDNN, once
        the weights are final: loaded, sharded and not batch-invariant. Returns how many
        were packed (0 on a GPU, in float64 or without oneDNN)."""
        packed = sum(m.prepack() for m in self.modules() if isinstance(m, Linear))
        embed = self.embed_tokens if self.last_stage and self.lm_head is None else None
        if embed is not None and not self.batch_invariant and can_prepack(embed.weight):
            self.packed_logits = pack_weight(embed.weight)  # the tied LM head
            packed += 1
        return packed

    def unpack_weights(self) -> None:
        """Undo `prepack_weights` (the batch-invariant path needs plain weights)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.unpack()
        self.packed_logits = None

    def set_tp_reduce(self, reduce: TPReduce | None) -> None:
        """Complete the row-parallel outputs with `reduce` (an all_reduce over TP)."""
        for module in self.modules():
            if isinstance(module, Attention | MLAttention | MLP):
                module.tp_reduce = reduce

    @property
    def num_kv_heads(self) -> int:
        """KV heads this model instance stores per layer (what the KV pool must hold)."""
        return self.config.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    def forward(
        self, batch: ForwardBatch, kv_cache: KVCache, hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run the batch's new tokens through this instance's layers, writing their K/V.

        The first stage embeds `batch.input_ids`; a later one starts from `hidden` (T,
        hidden_size), the previous stage's output. Returns hidden states (T, hidden_size) on
        a stage that is not the last, else logits (batch_size, vocab_size) of each request's
        last new token, in the model dtype. Under a CP split (`set_cp_split`) this rank runs
        its rows of the batch only (`hidden` and the hidden states returned are those rows),
        and the logits are every request's, the same on every rank of the CP group."""
        split = self.split_of(batch)
        plan = AttentionPlan.build(batch, self.config.context_len, not self.batch_invariant, split)
        ids, positions = batch.input_ids, batch.positions
        if split is not None:  # this rank's rows only (T_local of them)
            ids, positions = ids.index_select(0, split.rows), positions.index_select(0, split.rows)
        rope = self.rotary(positions)  # cos, sin: (T, 1, rope_dim)
        if self.first_stage:
            assert self.embed_tokens is not None
            h = self.embed_tokens(ids)  # (T, hidden)
        else:
            if hidden is None or hidden.shape != (len(ids), self.config.hidden_size):
                raise ValueError("a later pipeline stage needs the previous stage's hidden states")
            h = hidden
        for layer_id, layer in enumerate(self.layers):
            kv_cache.before_attention(layer_id, batch)
            h = layer(h, rope, plan, kv_cache)
            self.progress.layers_run += 1
        kv_cache.after_layers(batch)
        if not self.last_stage:
            return h  # (T, hidden)
        assert self.norm is not None
        if batch.logit_rows is not None:  # speculative verify: never under a CP split
            assert split is None, "logit rows under a CP split"
            return self.compute_logits(self.norm(h[batch.logit_rows]))
        last = h[plan.last_rows] if split is None else split.last_hidden(h)
        return self.compute_logits(self.norm(last))  # (batch_size, hidden) -> logits

    def set_cp_split(self, split: CPSplitConfig | None) -> None:
        """Split prefill tokens over the CP group as `split` says (None: every token here)."""
        self.cp_split = split
        self._split_of = None

    def split_of(self, batch: ForwardBatch) -> CPSplit | None:
        """This rank's share of `batch` under the CP split (None: it computes every row),
        built once per batch object (the executor sizes a stage's hidden states with it)."""
        if self.cp_split is None:
            return None
        if self._split_of is None or self._split_of[0] is not batch:
            self._split_of = (batch, self.cp_split.build(batch.extend_lens, batch.input_ids.device))
        return self._split_of[1]

    def num_rows(self, batch: ForwardBatch) -> int:
        """Rows of `batch` this rank runs: its hidden states' length at a stage boundary."""
        split = self.split_of(batch)
        return len(batch.input_ids) if split is None else split.num_rows

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Normed hidden states (n, hidden) -> logits (n, vocab_size)."""
        if self.lm_head is None:
            assert self.embed_tokens is not None
            if self.batch_invariant:
                return batch_invariant_linear(h, self.embed_tokens.weight, None)
            if self.packed_logits is not None:
                return packed_linear(h, self.packed_logits, None)
            return F.linear(h, self.embed_tokens.weight)
        return self.lm_head(h)


def _materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give every meta parameter and buffer uninitialised storage on `device` in `dtype`
    (what `.to(dtype).to_empty(device)` does, without the meta-tensor reference kernels that
    import torch's symbolic-shape machinery: most of a second at every process start)."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                data = torch.empty(param.shape, dtype=dtype, device=device)
                module._parameters[name] = nn.Parameter(data, requires_grad=False)
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = torch.empty(buf.shape, dtype=dtype, device=device)


def create_model(
    config: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    batch_invariant: bool = False,
    first_stage: bool = True,
    last_stage: bool = True,
) -> LlamaModel:
    """An inference-only model on `device` in `dtype` whose parameters are NOT initialised:
    the caller must fill every parameter (see `weights.py`). Nothing is allocated twice."""
    with torch.device("meta"):
        model = LlamaModel(config, first_stage, last_stage)
    _materialize(model, torch.device(device), dtype)
    model.rotary.reset_tables()
    model.set_batch_invariant(batch_invariant)
    return model.eval().requires_grad_(False)
