"""Sampled speculation follows the target's distribution (the rejection rule), statistically.

`tiny-draft` proposes 3 tokens for tiny at temperature 1; the rule keeps a proposal with
probability min(1, p/q) and otherwise draws from norm(max(0, p - q)), so every emitted
token must be distributed as the target's p given the tokens before it. The target's p of
every emitted position is its logits (`Req.logits_trace`, bit-exact against speculation
off in `test_spec_engine.py`). Over many seeds, each emitted token is turned into a
randomized probability integral transform under its own p (tokens ordered from the most to
the least likely, u = F(token-) + U * p(token)): under the target's distribution u is
uniform on [0, 1), independently per sample. The test bins u into 10 deciles and asks a
chi-square test (9 degrees of freedom) for p-value >= 1e-3; the seeds are fixed, so the
verdict is deterministic. A sampler that emits the draft's tokens unchecked, or draws a
rejection's replacement from p instead of the residual, lands far outside (measured:
chi-square 44.6 and beyond for those mutations, 8.6 for the rule; the second test checks
the draft's own distribution directly, so the statistic has the power claimed).
"""

from __future__ import annotations

import torch

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.scheduler.request import Req
from gpu_worker.scheduler.spec_config import SpecConfig

NUM_SEEDS = 400
TEMPERATURE = 1.0
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
CHI2_9DF_P001 = 27.877  # the chi-square(9) quantile of p = 1e-3


def spec_engine() -> Engine:
    return Engine(
        EngineConfig(
            cache=CacheConfig(page_size=4, num_device_pages=2048, enable_radix_cache=False),
            spec=SpecConfig("standalone", "tiny-draft", 3),
        )
    )


def run(eng: Engine) -> list[Req]:
    reqs = []
    for seed in range(NUM_SEEDS):
        sp = SamplingParams(max_new_tokens=4, temperature=TEMPERATURE, ignore_eos=True, seed=seed)
        req = eng.submit(PROMPT, sp)
        req.logits_trace = []
        reqs.append(req)
    eng.run(reqs)
    return reqs


def pit(logits: torch.Tensor, token: int, u: float) -> float:
    """The randomized probability integral transform of `token` under softmax(logits / T),
    tokens ordered by decreasing probability."""
    p = torch.softmax(logits.double() / TEMPERATURE, dim=-1)
    order = torch.argsort(p, descending=True, stable=True)
    rank = int((order == token).nonzero()[0, 0])
    below = float(p[order[:rank]].sum())
    return below + u * float(p[token])


def chi2_deciles(values: list[float]) -> float:
    counts = [0] * 10
    for v in values:
        counts[min(int(v * 10), 9)] += 1
    want = len(values) / 10
    return sum((c - want) ** 2 / want for c in counts)


def spec_positions(reqs: list[Req]) -> list[tuple[torch.Tensor, int]]:
    """(the target's logits, the emitted token) of every position a verify round decided
    (output 0 comes from the prefill's plain sample)."""
    out = []
    for r in reqs:
        assert r.logits_trace is not None and len(r.logits_trace) == len(r.output_ids) == 4
        out += [(r.logits_trace[i], r.output_ids[i]) for i in range(1, 4)]
    return out


def test_sampled_speculation_follows_the_target_distribution() -> None:
    eng = spec_engine()
    reqs = run(eng)
    eng.close()
    stats = eng.spec.stats if eng.spec is not None else None
    assert stats is not None
    # both branches of the rule ran often: accepted proposals and rejections
    assert 0.1 < stats.accept_rate < 0.9, stats
    gen = torch.Generator().manual_seed(1)
    values = [pit(lg, t, float(torch.rand(1, generator=gen))) for lg, t in spec_positions(reqs)]
    assert len(values) == 3 * NUM_SEEDS
    chi2 = chi2_deciles(values)
    assert chi2 < CHI2_9DF_P001, f"chi-square {chi2:.1f} over 9 df: not the target's distribution"


def test_the_statistic_rejects_the_drafts_own_tokens() -> None:
    """Power check: the same statistic over the draft's distribution (what an always-accept
    sampler emits) is far beyond the tolerance, so the test above could fail."""
    eng = spec_engine()
    assert eng.spec is not None and eng.draft_model is not None
    gen = torch.Generator().manual_seed(2)
    values = []
    for seed in range(NUM_SEEDS // 4):  # the draft's own sample at output 1, under the target
        sp = SamplingParams(max_new_tokens=2, temperature=TEMPERATURE, ignore_eos=True, seed=seed)
        req = eng.submit(PROMPT, sp)
        req.logits_trace = []
        eng.run([req])
        first = req.output_ids[0]
        draft_logits = _draft_next(eng, [*PROMPT, first])
        q = torch.softmax(draft_logits / TEMPERATURE, dim=-1)
        token = int(torch.multinomial(q, 1, generator=gen))
        values.append(pit(req.logits_trace[1], token, float(torch.rand(1, generator=gen))))
    eng.close()
    chi2 = chi2_deciles(values)
    assert chi2 > CHI2_9DF_P001


def _draft_next(eng: Engine, tokens: list[int]) -> torch.Tensor:
    """The draft model's logits after `tokens`, computed from scratch in its own pool."""
    from gpu_worker.memory.device_pool import DeviceKVPool
    from gpu_worker.model.forward_batch import ForwardBatch

    assert eng.draft_model is not None and eng.cache.pools.draft is not None
    spec = eng.cache.pools.draft.spec
    pool = DeviceKVPool(spec, -(-len(tokens) // spec.page_size), eng.device)
    slots = pool.slot_ids(list(range(pool.num_pages)), len(tokens))
    batch = ForwardBatch.build([(tokens, 0, slots)], eng.device)
    with torch.inference_mode():
        return eng.draft_model(batch, pool)[0].double()
