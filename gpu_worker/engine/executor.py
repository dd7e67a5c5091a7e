"""One forward pass of this rank's model shard, and the sampled tokens every rank receives.

Single rank: run the model, sample. Tensor parallel: every TP rank runs its shard (the
row-parallel all_reduces sit inside the model) and samples the same logits with the same
per-(seed, step) generator, so they draw the same token without a broadcast. Pipeline
parallel: the first stage embeds; each stage receives the previous stage's hidden states
(T, hidden) from the rank with its TP index, runs its layers and sends them on; the last
stage computes logits and samples, and sends the outcomes to the other stages, which wait
for them (the next step's schedule depends on them). Every stage then applies the same
outcomes at the same logical point.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from gpu_worker.model.forward_batch import ForwardBatch, KVCache
from gpu_worker.model.llama import LlamaModel
from gpu_worker.model.sampling import SamplingParams, sample, step_generator
from gpu_worker.parallel.groups import ParallelGroups
from gpu_worker.parallel.sync import (
    TAG_HIDDEN,
    TAG_OUTCOMES,
    Sends,
    decode_object,
    encode_object,
)


@dataclass(frozen=True, slots=True)
class SampleSpec:
    """How to sample one batch row: its request's sampling, which output token this is."""

    sampling: SamplingParams
    step: int  # index of the output token being sampled
    trace: bool = False  # keep the logits (the cache oracle's hook)


@dataclass(frozen=True, slots=True)
class SampleOutcome:
    token: int | None  # None when sampling failed
    error: str | None = None
    logits: torch.Tensor | None = None  # (vocab,) when traced


class ModelExecutor:
    def __init__(self, model: LlamaModel, groups: ParallelGroups, device: torch.device) -> None:
        self.model = model
        self.groups = groups
        self.device = device
        self.sends = Sends()

    def run(
        self, batch: ForwardBatch, pool: KVCache, specs: list[SampleSpec | None]
    ) -> list[SampleOutcome | None]:
        """Forward `batch`; an outcome for every row whose spec is not None."""
        g = self.groups
        hidden = None
        if not g.first_stage:
            hidden = torch.empty(
                (len(batch.input_ids), self.model.config.hidden_size),
                dtype=self.model.rotary.cos.dtype,
                device=self.device,
            )
            dist.recv(hidden, g.stage_peer(g.pp_rank - 1), group=g.world, tag=TAG_HIDDEN)
        with torch.inference_mode():
            out = self.model(batch, pool, hidden)
        if not g.last_stage:
            self.sends.send(out, g.stage_peer(g.pp_rank + 1), g.world, TAG_HIDDEN)
            return self._receive_outcomes()
        outcomes = [None if s is None else _sample(out[i], s) for i, s in enumerate(specs)]
        if g.config.pp_size > 1:
            self._send_outcomes(outcomes)
        return outcomes

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
    """Sample one row (vocab,). An error here is this request's alone (a 500 for it): odd
    logits or a torch error on odd values never stop the batch."""
    traced = logits.detach().clone().cpu() if spec.trace else None
    seed = spec.sampling.seed
    try:
        gen = None if seed is None else step_generator(seed, spec.step)
        return SampleOutcome(sample(logits, spec.sampling, gen), logits=traced)
    except Exception as e:  # the request fails, with the reason; the engine keeps going
        return SampleOutcome(None, f"sampling failed: {e}", traced)
