"""One forward pass of this rank's model shard, and the sampled tokens every rank receives.

Single rank: run the model, sample. Tensor parallel: every TP rank runs its shard (the
row-parallel all_reduces sit inside the model) and samples the same logits with the same
per-(seed, step) generator, so they draw the same token without a broadcast. Pipeline
parallel: the first stage embeds; each stage receives the previous stage's hidden states
(T, hidden) from the rank with its TP index, runs its layers and sends them on; the last
stage computes logits and samples, and sends the outcomes to the other stages, which wait
for them (the next step's schedule depends on them). Every stage then applies the same
outcomes at the same logical point.

Speculative decoding (`logits`): the same pipeline without sampling; the last stage gets
the logits and an earlier one nothing, and the decision is broadcast by `SpecDecoder`.

Context parallel: every CP rank of a stage runs the same batch; under a prefill split
(`--cp-split`, set on the model here) each runs its share of the rows and sends its own
rows' hidden states to the rank with its TP and CP index in the next stage (the split
depends only on the batch, so that rank runs the same rows); the last stage's CP ranks
gather the last rows inside the model and sample the same logits.

Guards: before the hidden states, a stage sends the batch's shape (tokens, requests), and
the next stage refuses a batch it did not plan itself (`StageMismatchError`) instead of
receiving a tensor of another size; with the rank consensus checker on, the TP (and CP)
ranks of a stage also compare their batch shapes before the forward, and with CP the
tokens they sampled after it (CP ranks compute apart). Ranks that diverged
then fail in Python, so the checker can report the decision that diverged first rather
than a later crash.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from gpu_worker.model.config import ModelConfig
from gpu_worker.model.cp_split import CPSplitConfig
from gpu_worker.model.forward_batch import ForwardBatch, KVCache
from gpu_worker.model.llama import LlamaModel
from gpu_worker.model.sampling import sample_with_logprobs, step_generator
from gpu_worker.model.shard import ModelShard
from gpu_worker.parallel.groups import ParallelGroups
from gpu_worker.parallel.sync import (
    TAG_EXPORT,
    TAG_HIDDEN,
    TAG_HIDDEN_SHAPE,
    TAG_OUTCOMES,
    Sends,
    decode_object,
    encode_object,
)
from gpu_worker.scheduler.executor import SampleOutcome, SampleSpec


class StageMismatchError(RuntimeError):
    """Ranks of one engine planned different batches: their states diverged."""


class ModelExecutor:
    def __init__(
        self,
        model: LlamaModel,
        groups: ParallelGroups,
        device: torch.device,
        model_config_whole: ModelConfig,
        guard_tp: bool = False,
    ) -> None:
        """`model_config_whole`: the whole model's config (`model` is this rank's shard).
        `guard_tp`: compare batch shapes across the TP group before each forward (one small
        collective per step; on with the consensus checker)."""
        self.model = model
        self.model_config_whole = model_config_whole
        self.groups = groups
        self.device = device
        self.guard_tp = guard_tp and groups.stage_cpu is not None
        self.sends = Sends()
        cfg = groups.config
        if cfg.cp_size > 1 and cfg.cp_split != "none":
            model.set_cp_split(CPSplitConfig(cfg.cp_split, groups.cp_rank, cfg.cp_size, groups.cp))

    def run(
        self, batch: ForwardBatch, pool: KVCache, specs: list[SampleSpec | None]
    ) -> list[SampleOutcome | None]:
        """Forward `batch`; for every row whose spec is not None, an outcome with the tokens
        appended to its request (one, sampled at the row's last position)."""
        g = self.groups
        out = self._forward(batch, pool)
        if out is None:
            outcomes = self._receive_outcomes()
            if len(outcomes) != len(specs):
                raise StageMismatchError(
                    f"the last stage sampled {len(outcomes)} rows, this rank planned {len(specs)}"
                )
            return outcomes
        outcomes = [None if s is None else _sample(out[i], s) for i, s in enumerate(specs)]
        if self.guard_tp and g.config.cp_size > 1:
            self._check_sampled(outcomes)
        if g.config.pp_size > 1:
            self._send_outcomes(outcomes)
        return outcomes

    def logits(self, batch: ForwardBatch, pool: KVCache) -> torch.Tensor:
        """Forward `batch` and return the logits of `batch.logit_rows` (every request's last
        row when None), unsampled: speculative decoding samples its draft's proposals and
        verifies them from these. Every rank of the world calls it with the same batch (the
        draft and the verify run through the pipeline as a step does); only the last stage
        computes logits, so an earlier stage gets none back (an empty (0, vocab) tensor):
        the decision is made on the last stage and broadcast (`SpecDecoder`)."""
        out = self._forward(batch, pool)
        if out is None:
            return torch.empty((0, self.model_config_whole.vocab_size), dtype=torch.float64)
        return out

    def _forward(self, batch: ForwardBatch, pool: KVCache) -> torch.Tensor | None:
        """This rank's part of the pipeline over `batch`: the logits on the last stage;
        None on an earlier one, after it sent its hidden states on."""
        g = self.groups
        shape = (len(batch.input_ids), batch.batch_size)
        if self.guard_tp:
            self._check_tp_shape(shape)
        hidden = None
        if not g.first_stage:
            self._check_stage_shape(shape)
            hidden = torch.empty(  # this rank's rows: all, or its share under a CP split
                (self.model.num_rows(batch), self.model.config.hidden_size),
                dtype=self.model.rotary.cos.dtype,
                device=self.device,
            )
            dist.recv(hidden, g.stage_peer(g.pp_rank - 1), group=g.world, tag=TAG_HIDDEN)
        with torch.inference_mode():
            out = self.model(batch, pool, hidden)
        if not g.last_stage:
            dst = g.stage_peer(g.pp_rank + 1)
            self.sends.send(
                torch.tensor(shape, dtype=torch.int64), dst, g.cpu_world, TAG_HIDDEN_SHAPE
            )
            self.sends.send(out, dst, g.world, TAG_HIDDEN)
            return None
        return out

    def _check_stage_shape(self, shape: tuple[int, int]) -> None:
        g = self.groups
        sent = torch.empty(2, dtype=torch.int64)
        dist.recv(sent, g.stage_peer(g.pp_rank - 1), group=g.cpu_world, tag=TAG_HIDDEN_SHAPE)
        if tuple(sent.tolist()) != shape:
            raise StageMismatchError(
                f"stage {g.pp_rank - 1} sent a batch of {int(sent[0])} tokens in "
                f"{int(sent[1])} requests; {g.describe()} planned {shape[0]} in {shape[1]}"
            )

    def _check_tp_shape(self, shape: tuple[int, int]) -> None:
        g = self.groups
        t = torch.tensor([shape[0], shape[1], -shape[0], -shape[1]], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=g.stage_cpu)
        if int(t[0]) != -int(t[2]) or int(t[1]) != -int(t[3]):
            raise StageMismatchError(
                f"TP/CP ranks of stage {g.pp_rank} planned different batches "
                f"({int(t[0])}..{-int(t[2])} tokens); {g.describe()} planned {shape[0]}"
            )

    def _check_sampled(self, outcomes: list[SampleOutcome | None]) -> None:
        """Every CP rank samples every row itself, and only rank 0's tokens
        reach a client: a CP rank whose KV went wrong would sample other tokens and drift
        unseen. Its stage compares a checksum of the sampled tokens (checker on only)."""
        g = self.groups
        toks = torch.tensor([s.token for o in outcomes if o for s in o.tokens], dtype=torch.int64)
        mine = torch.stack([toks.sum(), (toks * torch.arange(1, len(toks) + 1)).sum()])
        t = torch.cat([mine, -mine])
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=g.stage_cpu)
        if not torch.equal(t[:2], -t[2:]):
            raise StageMismatchError(
                f"ranks of stage {g.pp_rank} sampled different tokens; {g.describe()} "
                f"sampled {toks.tolist()}"
            )

    def collect_export(
        self,
        staging: torch.Tensor,
        cp_pages: Sequence[int] = (),
        model: ModelConfig | None = None,
    ) -> tuple[tuple[int, ...], tuple[torch.Tensor, ...]]:
        """P/D prefill: this rank's packed KV of a finished request in the unified order,
        (num_pages, its KV heads, its layers, num_kv, page, 1, kv_head_dim). Rank 0 gets
        the shards of `ParallelConfig.kv_ranks` (every rank's, or for MLA's replicated
        latent one per stage), in rank order, with their ranks; the others send theirs to
        it if it is one of those, and get only their own back. Every rank calls it at the
        same logical point: when the request finishes. Replicated CP: only CP rank 0's
        shards go, and the ranks returned are of `ParallelConfig.kv_layout` (the CP1
        layout the wire and a decode engine know). Sharded CP: each rank's shard holds only
        the pages its CP rank owns, `cp_pages[cp_rank]` of them (maybe none). `model`: the
        whole config of the model whose KV this is, when not this executor's (a
        speculative draft's KV, exported after the target's)."""
        g = self.groups
        whole = model or self.model_config_whole
        ranks = g.config.kv_ranks(whole.mla)
        wire = tuple(g.config.kv_rank(r) for r in ranks)
        if g.world_size == 1:
            return wire, (staging,)
        if g.rank != 0:
            if g.rank in ranks and staging.numel():  # a CP rank owning none sends nothing
                self.sends.send(staging.contiguous(), 0, g.cpu_world, TAG_EXPORT)
            return (g.config.kv_rank(g.rank),), (staging,)
        out = [staging]
        for rank in ranks[1:]:
            shard = ModelShard.of(whole, g.config, rank).local_config(whole)
            pages, page = staging.shape[0], staging.shape[4]
            if cp_pages:
                pages = cp_pages[g.config.coords(rank).cp]
            shape = (
                pages,
                shard.num_kv_heads,
                shard.num_layers,
                shard.num_kv,
                page,
                1,
                shard.kv_head_dim,
            )
            part = torch.empty(shape, dtype=staging.dtype)
            if part.numel():
                dist.recv(part, rank, group=g.cpu_world, tag=TAG_EXPORT)
            out.append(part)
        return wire, tuple(out)

    def _send_outcomes(self, outcomes: list[SampleOutcome | None]) -> None:
        g = self.groups
        data = encode_object(outcomes)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        for stage in range(g.config.pp_size - 1):
            dst = g.stage_peer(stage)
            self.sends.send(size, dst, g.cpu_world, TAG_OUTCOMES)
            self.sends.send(data, dst, g.cpu_world, TAG_OUTCOMES)

    def _receive_outcomes(self) -> list[SampleOutcome | None]:
        g = self.groups
        src = g.stage_peer(g.config.pp_size - 1)
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src, group=g.cpu_world, tag=TAG_OUTCOMES)
        data = torch.empty(int(size[0]), dtype=torch.uint8)
        dist.recv(data, src, group=g.cpu_world, tag=TAG_OUTCOMES)
        outcomes: list[SampleOutcome | None] = decode_object(data)
        return outcomes

    def close(self) -> None:
        self.sends.flush()


def _sample(logits: torch.Tensor, spec: SampleSpec) -> SampleOutcome:
    """Sample one token from one row's logits (vocab,): an outcome that appends one token. An error here is this request's alone (a 500 for it): odd
    logits or a torch error on odd values never stop the batch."""
    traced = logits.detach().clone().cpu() if spec.trace else None
    seed = spec.sampling.seed
    try:
        gen = None if seed is None else step_generator(seed, spec.step)
        s = sample_with_logprobs(logits, spec.sampling, gen, spec.prompt_ids, spec.output_ids)
        return SampleOutcome.one(s, traced)
    except Exception as e:  # the request fails, with the reason; the engine keeps going
        return SampleOutcome((), f"sampling failed: {e}", () if traced is None else (traced,))
