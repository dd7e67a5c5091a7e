"""Sampling: seeded draws repeat, top-p narrows, stop tokens and EOS end a request."""

from __future__ import annotations

import torch

from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams, sample

PROMPT = list(range(60, 90))


def test_sample_greedy_top_p_and_seed() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0], dtype=torch.float64)
    assert sample(logits, SamplingParams(), None) == 1
    tiny_p = SamplingParams(temperature=1.0, top_p=0.01)
    assert {sample(logits, tiny_p, torch.Generator().manual_seed(s)) for s in range(20)} == {1}
    hot = SamplingParams(temperature=5.0)
    draws = [sample(logits, hot, torch.Generator().manual_seed(s)) for s in range(40)]
    assert len(set(draws)) >= 3
    again = [sample(logits, hot, torch.Generator().manual_seed(s)) for s in range(40)]
    assert draws == again


def test_engine_seeded_sampling_repeats_and_differs_by_seed() -> None:
    engine = Engine(EngineConfig())
    runs = {}
    for seed in (1, 1, 2):
        sp = SamplingParams(max_new_tokens=12, temperature=1.5, seed=seed, ignore_eos=True)
        runs.setdefault(seed, []).append(engine.generate(PROMPT, sp).output_ids)
    assert runs[1][0] == runs[1][1]
    assert runs[1][0] != runs[2][0]


def test_stop_tokens_and_eos_end_the_request() -> None:
    engine = Engine(EngineConfig())
    free = engine.generate(PROMPT, SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert free.finish_reason == "length" and len(free.output_ids) == 10
    stop_at = free.output_ids[4]
    stopped = engine.generate(
        PROMPT, SamplingParams(max_new_tokens=10, stop_token_ids=(stop_at,), ignore_eos=True)
    )
    first = free.output_ids.index(stop_at)
    assert stopped.output_ids == free.output_ids[: first + 1]
    assert stopped.finish_reason == "stop"
