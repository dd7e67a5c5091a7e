"""Speculative decoding is lossless, and its draft state survives a device prefix hit.

The float64 oracle of `test_engine_oracle.py`, with speculation on: greedy outputs and the
target's logits at every emitted position (`Req.logits_trace`) must equal speculation off
bit for bit (the batch-invariant path makes a verify extend of K+1 rows compute each row as
a decode step would), cold and on a second turn served from the device cache, with the
`self` draft (an exact copy: every proposal is accepted) and `tiny-draft` (another shape:
proposals are rejected). On the hit, the draft's KV comes from the pool group's draft
member under the same page ids: the accepted counts of every verify round equal the cold
run's, and a test switch that zeroes the draft's rows of a hit breaks that. The
all-accepted trap: without feeding the last accepted proposal through the draft, the exact
copy stops accepting everything. Stop tokens, logprobs and penalties inside an accepted run
give exactly what speculation off gives.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import DebugHooks, Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.scheduler.request import Req
from gpu_worker.scheduler.scheduler import SchedulerConfig
from gpu_worker.scheduler.spec_config import SpecConfig

PAGE = 4
GREEDY = SamplingParams(max_new_tokens=14, ignore_eos=True)


def make_engine(
    draft: str | None, radix: bool = True, debug: DebugHooks | None = None, steps: int = 4
) -> Engine:
    spec = SpecConfig() if draft is None else SpecConfig("standalone", draft, steps)
    return Engine(
        EngineConfig(
            cache=CacheConfig(page_size=PAGE, num_device_pages=256, enable_radix_cache=radix),
            scheduler=SchedulerConfig(chunked_prefill_size=8),  # prompts prefill in chunks
            batch_invariant=True,
            spec=spec,
            debug=debug or DebugHooks(),
        )
    )


def run_traced(
    eng: Engine, prompts: Sequence[list[int]], sampling: SamplingParams = GREEDY
) -> list[Req]:
    """Run `prompts` together, keeping the logits of every emitted token."""
    reqs = [eng.submit(p, sampling) for p in prompts]
    for req in reqs:
        req.logits_trace = []
    eng.run(reqs)
    eng.check_integrity()
    return reqs


def assert_same(got: Sequence[Req], want: Sequence[Req]) -> None:
    """Same tokens, finish reasons, logprobs, and bit-identical float64 logits per token."""
    for g, w in zip(got, want, strict=True):
        assert g.output_ids == w.output_ids and g.finish_reason == w.finish_reason
        assert g.logprobs == w.logprobs
        assert g.logits_trace is not None and w.logits_trace is not None
        assert len(g.logits_trace) == len(g.output_ids)
        a, b = torch.stack(g.logits_trace), torch.stack(w.logits_trace)
        assert a.dtype == torch.float64 and torch.equal(a, b), (a - b).abs().max()


def make_prompts(seed: int = 3) -> list[list[int]]:
    """2 groups x 2 prompts sharing an unaligned prefix."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(2):
        shared = [rng.randrange(256) for _ in range(rng.randint(13, 21))]
        for _ in range(2):
            prompts.append(shared + [rng.randrange(256) for _ in range(rng.randint(3, 9))])
    return prompts


def second_turn(prompts: Sequence[list[int]], first: Sequence[Req]) -> list[list[int]]:
    """Each conversation's next turn: prompt, answer and a few new tokens (a device hit over
    KV the first turn computed in prefill and in speculative decode rounds)."""
    return [p + r.output_ids + [7, 8, 9] for p, r in zip(prompts, first, strict=True)]


@pytest.fixture(scope="module")
def cold() -> tuple[list[list[int]], list[Req], list[Req]]:
    """Speculation off, radix cache off: both turns' reference."""
    prompts = make_prompts()
    eng = make_engine(None, radix=False)
    first = run_traced(eng, prompts)
    second = run_traced(eng, second_turn(prompts, first))
    eng.close()
    return prompts, first, second


def rounds(reqs: Sequence[Req]) -> list[list[tuple[int, int]]]:
    return [list(r.spec_rounds) for r in reqs]


@pytest.mark.parametrize("draft", ["self", "tiny-draft"])
def test_greedy_is_lossless_cold_and_on_device_hits(
    draft: str, cold: tuple[list[list[int]], list[Req], list[Req]]
) -> None:
    prompts, want1, want2 = cold
    spec_cold = make_engine(draft, radix=False)
    ref1 = run_traced(spec_cold, prompts)
    ref2 = run_traced(spec_cold, second_turn(prompts, ref1))
    spec_cold.close()
    eng = make_engine(draft)
    first = run_traced(eng, prompts)
    second = run_traced(eng, second_turn(prompts, first))
    eng.close()
    for got in (ref1, first):
        assert_same(got, want1)
    for got in (ref2, second):
        assert_same(got, want2)
    assert all(r.cached.device > 0 for r in second)  # the second turn hit the device cache
    # restored draft state is exact: each verify round accepts what the cold run's did
    assert rounds(first) == rounds(ref1) and rounds(second) == rounds(ref2)
    proposed = sum(r.spec_proposed for r in [*first, *second])
    accepted = sum(r.spec_accepted for r in [*first, *second])
    assert proposed > 0
    if draft == "self":  # an exact copy: every proposal accepted, hits included
        assert accepted == proposed
    else:  # another model: rejections happen, and the output is still the target's
        assert accepted < proposed


def test_zeroed_draft_rows_of_a_hit_lose_acceptance(
    cold: tuple[list[list[int]], list[Req], list[Req]],
) -> None:
    """The switch the restored-state test must catch: the draft's rows of every device hit
    read as zeros. Outputs stay the target's; the accepted counts no longer match."""
    prompts, want1, want2 = cold
    eng = make_engine("self", debug=DebugHooks(spec_zero_draft_hits=True))
    first = run_traced(eng, prompts)
    second = run_traced(eng, second_turn(prompts, first))
    eng.close()
    assert_same(first, want1)
    assert_same(second, want2)
    assert sum(r.spec_accepted for r in second) < sum(r.spec_proposed for r in second)


def test_all_accepted_round_feeds_its_last_proposal_through_the_draft(
    cold: tuple[list[list[int]], list[Req], list[Req]],
) -> None:
    """The trap: when every proposal is accepted, the last one's draft KV is still
    missing. Skipping that feed (the switch) leaves a hole the exact copy then reads."""
    prompts, want1, _ = cold
    eng = make_engine("self", radix=False, debug=DebugHooks(spec_skip_final_draft_feed=True))
    first = run_traced(eng, prompts)
    eng.close()
    assert_same(first, want1)  # lossless all the same: the target decides
    assert sum(r.spec_accepted for r in first) < sum(r.spec_proposed for r in first)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_new_tokens=14, ignore_eos=True, logprobs=3),
        SamplingParams(
            max_new_tokens=14, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5
        ),
        SamplingParams(max_new_tokens=7, ignore_eos=True),  # rounds shrink to what is left
    ],
    ids=["logprobs", "penalties", "short"],
)
@pytest.mark.parametrize("steps", [1, 3])
def test_sampling_parameters_inside_accepted_runs(sampling: SamplingParams, steps: int) -> None:
    prompts = make_prompts(11)
    off = make_engine(None, radix=False)
    want = run_traced(off, prompts, sampling)
    off.close()
    eng = make_engine("self", steps=steps)
    got = run_traced(eng, prompts, sampling)
    eng.close()
    assert_same(got, want)
    assert all(p <= steps for r in got for p, _ in r.spec_rounds)
    assert all(len(r.output_ids) == sampling.max_new_tokens for r in got)


def test_a_stop_token_inside_an_accepted_run_cuts_the_output_there() -> None:
    """The stop token is the 3rd output of the cold run: inside the first verify round
    (outputs 1..5 with 4 proposals), whose later accepted tokens must be dropped."""
    prompts = make_prompts(5)[:1]
    off = make_engine(None, radix=False)
    plain = run_traced(off, prompts)[0]
    stop = plain.output_ids[2]
    first = plain.output_ids.index(stop)
    sampling = replace(GREEDY, stop_token_ids=(stop,))
    want = run_traced(off, prompts, sampling)
    off.close()
    assert want[0].output_ids == plain.output_ids[: first + 1] and first < 5
    eng = make_engine("self")
    got = run_traced(eng, prompts, sampling)
    again = run_traced(eng, prompts, sampling)  # the cut request's KV in the tree is sound
    eng.close()
    assert_same(got, want)
    assert_same(again, want)
    assert got[0].finish_reason == "stop" and got[0].spec_rounds[0] == (4, 4)
