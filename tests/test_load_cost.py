"""A slow-tier hit is loaded only when loading looks cheaper than recomputing it."""

from __future__ import annotations

import pytest

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.cache.load_cost import LoadCostModel
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams

SP = SamplingParams(max_new_tokens=4, ignore_eos=True)
PROMPT = list(range(40, 90))


def test_cost_model_estimates() -> None:
    m = LoadCostModel(alpha=0.5)
    assert m.worth_loading(10**9, 1)  # nothing measured: load
    m.observe_load(1000, 1.0)
    m.observe_load(3000, 1.0)
    assert m.load_bytes_per_s == pytest.approx(2000.0)  # EMA with alpha 0.5
    assert m.worth_loading(10**6, 1)  # prefill not measured yet
    m.observe_prefill(100, 1.0)
    assert m.load_seconds(4000) == pytest.approx(2.0)
    assert m.recompute_seconds(50) == pytest.approx(0.5)
    assert not m.worth_loading(4000, 50)
    assert m.worth_loading(4000, 500)


def host_hit_engine(policy: str) -> Engine:
    cfg = CacheConfig(
        page_size=4,
        num_device_pages=128,
        enable_hierarchical_cache=True,
        hicache_load_policy=policy,
    )  # type: ignore[arg-type]
    eng = Engine(EngineConfig(cache=cfg))
    eng.generate(PROMPT, SP)
    eng.cache.drain()
    eng.cache.evict_device(eng.cache.tree.num_device_pages)
    return eng


@pytest.mark.parametrize(("policy", "host"), [("always", 48), ("cost", 0)])
def test_a_slow_load_is_recomputed_under_the_cost_policy(policy: str, host: int) -> None:
    cold = Engine(EngineConfig(cache=CacheConfig(page_size=4, enable_radix_cache=False)))
    want = cold.generate(PROMPT, SP).output_ids
    eng = host_hit_engine(policy)
    assert eng.cache.cost.prefill_tokens_per_s is not None  # measured by the first request
    eng.cache.cost.load_bytes_per_s = 1.0  # a host link of one byte per second
    out = eng.generate(PROMPT, SP)
    assert out.output_ids == want
    assert (out.cached.device, out.cached.host) == (0, host)
    assert eng.cache.stats.loads_skipped == (1 if policy == "cost" else 0)
    eng.cache.drain()
    eng.check_integrity()


def test_loads_feed_the_bandwidth_estimate() -> None:
    eng = host_hit_engine("cost")
    assert eng.cache.cost.load_bytes_per_s is None
    assert eng.generate(PROMPT, SP).cached.host == 48  # nothing measured yet: load
    assert eng.cache.cost.load_bytes_per_s is not None and eng.cache.cost.load_bytes_per_s > 0
