"""The executor as the scheduler drives it: one forward pass per step, and what it samples.

The scheduler plans a batch and hands it to a `StepExecutor`; the engine's `ModelExecutor`
(`gpu_worker/engine/executor.py`, one floor up) implements it. The protocol and the
per-row sampling types live here, on the scheduler's floor, so the scheduler never imports
the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from gpu_worker.model.config import ModelConfig
from gpu_worker.model.forward_batch import ForwardBatch, KVCache
from gpu_worker.model.sampling import Sampled, SamplingParams
from gpu_worker.parallel.groups import ParallelGroups


@dataclass(frozen=True, slots=True)
class SampleSpec:
    """How to sample one batch row (at its last position): its request's sampling, which
    output token this is, and the tokens seen so far (read only by penalties; this rank's
    replica of them)."""

    sampling: SamplingParams
    step: int  # index of the output token being sampled
    trace: bool = False  # keep the logits (the cache oracle's hook)
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()


@dataclass(frozen=True, slots=True)
class SampleOutcome:
    """What a step appended to one request: n >= 0 sampled tokens, in order (a decode step
    one, a speculative one up to the proposals + 1), each with its logprobs when the request asked for them; or why sampling failed."""

    tokens: tuple[Sampled, ...] = ()
    error: str | None = None  # set when sampling failed (then `tokens` is empty)
    logits: tuple[torch.Tensor, ...] = ()  # when traced: (vocab,) per sampled position

    @staticmethod
    def one(sampled: Sampled, logits: torch.Tensor | None = None) -> SampleOutcome:
        """The outcome of a step that sampled one token (a decode step, a last chunk)."""
        return SampleOutcome((sampled,), None, () if logits is None else (logits,))


class StepExecutor(Protocol):
    """This rank's model shard, run once per step on the batch every rank planned alike."""

    @property
    def model_config_whole(self) -> ModelConfig:
        """The whole model's config (not this rank's shard of it)."""
        ...

    @property
    def groups(self) -> ParallelGroups:
        """The engine's parallel groups (this rank's place in the world)."""
        ...

    def run(
        self, batch: ForwardBatch, pool: KVCache, specs: list[SampleSpec | None]
    ) -> list[SampleOutcome | None]:
        """Forward `batch`; an outcome for every row whose spec is not None, the same on
        every rank."""
        ...

    def logits(self, batch: ForwardBatch, pool: KVCache) -> torch.Tensor:
        """Forward `batch` on every rank and return the logits (rows, vocab) of
        `batch.logit_rows`, unsampled (speculative decoding's draft and verify): on the last
        PP stage; earlier stages get an empty (0, vocab) tensor."""
        ...

    def collect_export(
        self,
        staging: torch.Tensor,
        cp_pages: Sequence[int] = (),
        model: ModelConfig | None = None,
    ) -> tuple[tuple[int, ...], tuple[torch.Tensor, ...]]:
        """P/D prefill: gather a finished request's packed KV shards on rank 0, with their
        ranks (`ModelExecutor.collect_export` says in which order and shape; `cp_pages`: the
        pages of each CP rank's shard under sharded CP; `model`: a draft's whole config when
        the KV is the draft's). Every rank calls it at the same logical point."""
        ...
