"""Speculative decoding on TP and PP engines (issue 23 build 5; acceptance 1's TP2/PP2 arms).

Each case is a real world of rank processes over gloo (`tests/multirank.py`). The draft is
sharded like the target; every verify decision (the proposals and the accepted tokens) is
made once, by the last stage's first rank, and broadcast, so every rank applies the same
accepted counts to its draft and target state. The oracle: with the `self` draft (an exact
copy, float64, batch-invariant), greedy tokens and the target's logits at every emitted
position equal a speculation-off run of the same layout bit for bit, and its tokens equal
TP1's, cold and on a second turn served from the device cache, with every proposal accepted.
`tiny-tp-draft` (another shape, sharded the same way) is rejected at times and still gives
the same tokens. With the rank consensus checker on, a test switch that makes one rank
apply a different accepted count is named by the checker at that verify round. CP with
speculation, and a draft that does not shard like the target, are refused clearly.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from multirank import WorldFailed, run_world

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.config import DebugHooks
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.engine.rank import launch_engine
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.scheduler.scheduler import SchedulerConfig
from gpu_worker.scheduler.spec_config import SpecConfig

PAGE = 4
GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)
PROMPTS = [
    [5, 17, 99, 3, 41, 7, 250, 12, 8, 66, 31, 2, 90],
    [5, 17, 99, 3, 41, 7, 250, 12, 8, 11, 200],
    [140, 9, 9, 77, 61, 5, 180, 33],
]

# (tokens, float64 logits (steps, vocab), device-cached tokens, spec rounds) per request
Traced = list[tuple[list[int], torch.Tensor, int, list[tuple[int, int]]]]


def make_config(tp: int, pp: int, draft: str | None, **debug: Any) -> EngineConfig:
    spec = SpecConfig() if draft is None else SpecConfig("standalone", draft, 3)
    return EngineConfig(
        model="tiny",
        cache=CacheConfig(page_size=PAGE, num_device_pages=128),
        scheduler=SchedulerConfig(chunked_prefill_size=8),  # prompts prefill in chunks
        parallel=ParallelConfig(tp, pp),
        batch_invariant=True,
        spec=spec,
        debug=DebugHooks(**debug),
    )


def turns(engine: Engine) -> dict[str, Traced]:
    """A cold batch, then each conversation's second turn (a device hit over the KV the
    first computed in prefill and in speculative rounds). Runs on rank 0."""
    out: dict[str, Traced] = {}
    prompts = PROMPTS
    for phase in ("cold", "turn2"):
        reqs = [engine.submit(p, GREEDY) for p in prompts]
        for r in reqs:
            r.logits_trace = []
        outs = engine.run(reqs)
        out[phase] = [
            (o.output_ids, torch.stack(r.logits_trace or []), o.cached.device, list(r.spec_rounds))
            for o, r in zip(outs, reqs, strict=True)
        ]
        prompts = [p + o.output_ids + [7, 8] for p, o in zip(prompts, outs, strict=True)]
    engine.drain()
    engine.check_integrity()
    return out


@pytest.fixture(scope="module")
def tp1() -> dict[str, Traced]:
    engine = Engine(make_config(1, 1, None))
    try:
        return turns(engine)
    finally:
        engine.close()


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2pp2"])
def test_self_draft_is_lossless_on_tp_and_pp(tp: int, pp: int, tp1: dict[str, Traced]) -> None:
    off = run_world(make_config(tp, pp, None), turns)
    on = run_world(make_config(tp, pp, "self"), turns)
    for phase in ("cold", "turn2"):
        for (tokens, logits, cached, rounds), (w_tokens, w_logits, w_cached, _), (t1, *_) in zip(
            on[phase], off[phase], tp1[phase], strict=True
        ):
            assert tokens == w_tokens == t1, phase
            assert logits.shape == (GREEDY.max_new_tokens, 260) and logits.dtype == torch.float64
            assert torch.equal(logits, w_logits), (phase, (logits - w_logits).abs().max())
            assert cached == w_cached
            assert rounds and all(a == k for k, a in rounds), (phase, rounds)  # all accepted
    assert all(c == 0 for _, _, c, _ in on["cold"])
    assert all(c > 0 for _, _, c, _ in on["turn2"])  # the device hits happened


def test_a_sharded_draft_of_another_shape_gives_the_same_tokens(tp1: dict[str, Traced]) -> None:
    """`tiny-tp-draft` on TP2 x PP2: proposals rejected at times, tokens still TP1's."""
    on = run_world(make_config(2, 2, "tiny-tp-draft"), turns)
    rounds = [r for phase in on.values() for *_, rr in phase for r in rr]
    assert any(a < k for k, a in rounds) and any(a > 0 for _, a in rounds), rounds
    for phase in ("cold", "turn2"):
        assert [t for t, *_ in on[phase]] == [t for t, *_ in tp1[phase]], phase


def sampled(engine: Engine) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Seeded sampling at temperature 1 with logprobs: tokens and rounds per request."""
    params = [
        SamplingParams(max_new_tokens=10, temperature=1.0, seed=s, ignore_eos=True, logprobs=2)
        for s in (11, 12, 13)
    ]
    reqs = [engine.submit(p, sp) for p, sp in zip(PROMPTS, params, strict=True)]
    outs = engine.run(reqs)
    engine.drain()
    return [(o.output_ids, list(r.spec_rounds)) for o, r in zip(outs, reqs, strict=True)]


def test_seeded_sampling_on_pp2_draws_what_tp1_draws() -> None:
    """The rejection rule on PP2 (logits bit-identical to TP1's): proposals and accepts are
    drawn once, by the last stage, from the per-(seed, step) generators, so the tokens and
    every round's accepted count are TP1's, rejections included."""
    config = make_config(1, 2, "tiny-tp-draft")
    single = Engine(dataclasses.replace(config, parallel=ParallelConfig()))
    try:
        want = sampled(single)
    finally:
        single.close()
    got = run_world(config, sampled)
    assert got == want
    rounds = [r for _, rr in got for r in rr]
    assert any(a < k for k, a in rounds) and any(a > 0 for _, a in rounds), rounds


def test_checker_names_a_rank_that_accepts_another_count(tmp_path: Path) -> None:
    """TP2 with the checker on: rank 1 applies one accepted proposal fewer than the
    decision; the checker reports the verify round (`SpecDecoder._settle`) whose results
    differ, not a later symptom."""
    env = {"HICACHE_RANK_CONSENSUS": "1", "HICACHE_RANK_CONSENSUS_DIR": str(tmp_path)}
    config = make_config(2, 1, "self", spec_perturb_accept_rank=1)
    with pytest.raises(WorldFailed) as failed:
        run_world(config, turns, env=env)
    text = str(failed.value)
    assert "RankDivergenceError" in text and "the results differ" in text
    entry = text.split("Found rank divergence")[-1].splitlines()[1]
    assert "SpecDecoder._settle" in entry, text


def test_checker_finds_no_divergence_when_every_rank_applies_the_decision(
    tmp_path: Path,
) -> None:
    """The same world without the switch: the verify rounds and the draft's fed lengths
    are recorded on every rank and agree."""
    env = {"HICACHE_RANK_CONSENSUS": "1", "HICACHE_RANK_CONSENSUS_DIR": str(tmp_path)}
    run_world(make_config(2, 1, "self"), turns, env=env)
    from gpu_worker.consensus.records import first_divergence, load_logs

    logs = load_logs(tmp_path)
    assert first_divergence(logs) is None
    calls = {rec.call for rec in logs["rank1 PP0/TP1"]}
    assert {"SpecDecoder._settle", "SpecDecoder._feed"} <= calls, calls


def test_cp_and_drafts_that_do_not_shard_are_refused() -> None:
    spec = SpecConfig("standalone", "self")
    with pytest.raises(ValueError, match=r"CP > 1: the draft's KV over CP ranks"):
        EngineConfig(parallel=ParallelConfig(cp_size=2), spec=spec)
    EngineConfig(parallel=ParallelConfig(2, 2), spec=spec)  # TP and PP speculate
    bad = dataclasses.replace(make_config(2, 1, None), spec=SpecConfig("standalone", "tiny-draft"))
    with pytest.raises(ValueError, match=r"draft model 'tiny-draft' does not split over TP2"):
        launch_engine(bad)  # before any rank process starts
    too_deep = dataclasses.replace(
        make_config(1, 4, None), spec=SpecConfig("standalone", "tiny-tp-draft")
    )
    with pytest.raises(ValueError, match=r"'tiny-tp-draft' does not split over TP1/PP4"):
        launch_engine(too_deep)
