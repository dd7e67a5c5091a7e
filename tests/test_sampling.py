"""Sampling: seeded draws repeat, top-p narrows, stop tokens and EOS end a request."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingError, SamplingParams, sample, step_generator

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
    runs: dict[int, list[list[int]]] = {}
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


# --------------------------------------------------------------- every accepted value is safe

LOGITS = torch.tensor([0.5, 2.0, 1.9, -3.0, 0.0], dtype=torch.float64)
TEMPERATURES = (0.0, 5e-324, 1e-320, 1e-310, 1e-300, 1e-6, 1e-5, 1.0, 1e300, 1.7976931348623157e308)
TOP_PS = (5e-324, 1e-300, 0.5, 1.0 - 1e-16, 1.0)
SEEDS = (None, 0, 1, 2**63 - 1, -1, -(2**63))


def test_tiny_temperatures_are_greedy() -> None:
    for t in (5e-324, 1e-320, 1e-310, 1e-300, 1e-6, 9.99e-6):
        assert SamplingParams(temperature=t).greedy
        assert sample(LOGITS, SamplingParams(temperature=t), torch.Generator()) == 1
    assert not SamplingParams(temperature=1e-5).greedy


def test_every_accepted_value_samples_a_valid_token() -> None:
    """The cross product of the extremes the API accepts: each gives a token id in range."""
    for t in TEMPERATURES:
        for p in TOP_PS:
            for seed in SEEDS:
                sp = SamplingParams(temperature=t, top_p=p, seed=seed)
                gen = None if seed is None else step_generator(seed, 0)
                for logits in (LOGITS, LOGITS.float(), LOGITS * 1e300, LOGITS.to(torch.bfloat16)):
                    token = sample(logits, sp, gen)
                    assert 0 <= token < len(LOGITS), (t, p, seed, token)


def test_tiny_top_p_keeps_only_the_most_likely_token() -> None:
    for p in (5e-324, 1e-300):
        sp = SamplingParams(temperature=1.0, top_p=p)
        assert {sample(LOGITS, sp, torch.Generator().manual_seed(s)) for s in range(20)} == {1}


def test_huge_temperature_is_near_uniform_not_nan() -> None:
    sp = SamplingParams(temperature=1e300)
    draws = {sample(LOGITS, sp, torch.Generator().manual_seed(s)) for s in range(200)}
    assert draws == set(range(len(LOGITS)))


def test_nan_and_inf_logits() -> None:
    nan, inf = math.nan, math.inf
    hot = SamplingParams(temperature=1.0)
    with_nan = torch.tensor([nan, 1.0, nan, 0.5], dtype=torch.float64)
    assert sample(with_nan, SamplingParams(), None) == 1  # argmax would pick the NaN
    assert {sample(with_nan, hot, torch.Generator().manual_seed(s)) for s in range(30)} <= {1, 3}
    with_inf = torch.tensor([inf, 1.0, inf, -inf], dtype=torch.float64)
    draws = {sample(with_inf, hot, torch.Generator().manual_seed(s)) for s in range(30)}
    assert draws == {0, 2}
    assert sample(with_inf, SamplingParams(), None) == 0
    one_finite = torch.tensor([-inf, -inf, 3.0, nan], dtype=torch.float64)
    for sp in (SamplingParams(), hot, SamplingParams(temperature=1e-4, top_p=0.1)):
        assert sample(one_finite, sp, torch.Generator()) == 2
    for hopeless in ([nan, nan], [-inf, nan], [-inf, -inf]):
        for sp in (SamplingParams(), hot):
            with pytest.raises(SamplingError):
                sample(torch.tensor(hopeless, dtype=torch.float64), sp, torch.Generator())


def test_step_generator_takes_any_integer_seed() -> None:
    for seed in SEEDS[1:]:
        a = torch.rand(3, generator=step_generator(seed, 0))
        b = torch.rand(3, generator=step_generator(seed, 0))
        assert torch.equal(a, b)
    assert not torch.equal(
        torch.rand(3, generator=step_generator(0, 0)), torch.rand(3, generator=step_generator(0, 1))
    )


def test_engine_serves_poison_sampling_values() -> None:
    """The reported crash: temperature 1e-320 on the engine (it raised in multinomial)."""
    engine = Engine(EngineConfig())
    greedy = engine.generate(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True))
    for t in (1e-320, 1e-310):
        sp = SamplingParams(max_new_tokens=4, temperature=t, ignore_eos=True)
        assert engine.generate(PROMPT, sp).output_ids == greedy.output_ids
    for t, p, seed in ((1e300, 5e-324, 2**63 - 1), (1e-5, 1e-300, 0), (1e300, 1.0, None)):
        sp = SamplingParams(max_new_tokens=4, temperature=t, top_p=p, seed=seed, ignore_eos=True)
        out = engine.generate(PROMPT, sp)
        assert len(out.output_ids) == 4
        assert all(0 <= i < engine.model_config.vocab_size for i in out.output_ids)
    engine.check_integrity()


# --------------------------------------------------------------- the other parameters

from gpu_worker.model.sampling import sample_with_logprobs  # noqa: E402

BASE = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0], dtype=torch.float64)


def draws(params: SamplingParams, logits: torch.Tensor = BASE, **history: object) -> set[int]:
    return {
        sample(logits, params, torch.Generator().manual_seed(s), **history)  # type: ignore[arg-type]
        for s in range(60)
    }


def test_top_k_and_min_p_cut_the_draw() -> None:
    hot = SamplingParams(temperature=10.0)
    assert len(draws(hot)) == 6
    assert draws(SamplingParams(temperature=10.0, top_k=2)) == {0, 1}
    assert draws(SamplingParams(temperature=10.0, top_k=1)) == {0}
    # at T=1, p(i)/p(0) = e^-(0.5 i): min_p 0.5 keeps ids 0 and 1 (e^-0.5 = 0.61 >= 0.5)
    assert draws(SamplingParams(temperature=1.0, min_p=0.5)) == {0, 1}
    assert draws(SamplingParams(temperature=1.0, min_p=1.0)) == {0}


def test_logit_bias_moves_the_greedy_choice() -> None:
    assert sample(BASE, SamplingParams(), None) == 0
    assert sample(BASE, SamplingParams(logit_bias=((5, 100.0),)), None) == 5
    assert sample(BASE, SamplingParams(logit_bias=((0, -100.0), (1, -100.0))), None) == 2
    assert sample(BASE, SamplingParams(logit_bias=((999, 100.0),)), None) == 0  # no such id


def test_repetition_presence_and_frequency_penalties() -> None:
    # repetition (HF): a seen token's positive logit is divided: 2.0 / 2.5 = 0.8 < 1.5
    rep = SamplingParams(repetition_penalty=2.5)
    assert sample(BASE, rep, None, prompt_ids=[0]) == 1
    assert sample(BASE, rep, None, output_ids=[0, 1]) == 2  # 1.5 / 2.5 = 0.6 < 1.0
    assert sample(BASE, rep, None) == 0  # nothing seen
    # presence (OpenAI): minus 0.6 once for each output token seen: 2.0 - 0.6 < 1.5
    assert sample(BASE, SamplingParams(presence_penalty=0.6), None, output_ids=[0]) == 1
    assert sample(BASE, SamplingParams(presence_penalty=0.6), None, prompt_ids=[0]) == 0
    # frequency: minus 0.3 per occurrence: once 1.7 > 1.5, twice 1.4 < 1.5
    freq = SamplingParams(frequency_penalty=0.3)
    assert sample(BASE, freq, None, output_ids=[0]) == 0
    assert sample(BASE, freq, None, output_ids=[0, 0]) == 1


def test_logprobs_are_the_model_log_softmax() -> None:
    got = sample_with_logprobs(BASE, SamplingParams(logprobs=3, logit_bias=((5, 100.0),)), None)
    want = torch.log_softmax(BASE, dim=-1)
    assert got.token == 5  # the biased choice, with the model's own logprob
    assert got.logprob == pytest.approx(float(want[5]))
    assert [t for t, _ in got.top_logprobs] == [0, 1, 2]
    assert [lp for _, lp in got.top_logprobs] == pytest.approx(want[:3].tolist())
    assert sample_with_logprobs(BASE, SamplingParams(), None).logprob is None
    assert sample_with_logprobs(BASE, SamplingParams(logprobs=0), None).top_logprobs == ()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", -1),
        ("top_k", 1.5),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", math.inf),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("logit_bias", ((1, 101.0),)),
        ("logit_bias", ((-1, 1.0),)),
        ("logprobs", 21),
    ],
)
def test_out_of_range_values_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field.split("_")[0]):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_penalties_and_logprobs_through_the_engine() -> None:
    engine = Engine(EngineConfig())
    plain = engine.generate(PROMPT, SamplingParams(max_new_tokens=12, ignore_eos=True))
    strong = SamplingParams(max_new_tokens=12, ignore_eos=True, repetition_penalty=50.0)
    penalised = engine.generate(PROMPT, strong).output_ids
    assert penalised != plain.output_ids  # the history reaches the sampler
    assert not set(penalised) & set(PROMPT)  # a huge penalty avoids every token seen
    assert len(set(penalised)) == len(penalised)
    req = engine.submit(PROMPT, SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=2))
    req.logits_trace = []
    engine.run([req])
    assert len(req.logprobs) == 5 and len(req.logits_trace) == 5
    for token, (lp, top), logits in zip(
        req.output_ids, req.logprobs, req.logits_trace, strict=True
    ):
        want = torch.log_softmax(logits.double(), dim=-1)
        assert lp == pytest.approx(float(want[token]))
        assert top[0][0] == token  # greedy: the chosen token is the most likely
