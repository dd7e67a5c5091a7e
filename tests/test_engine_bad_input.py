"""Bad input to the engine API raises a clear error and leaves the pools exactly as they were."""

from __future__ import annotations

import math
from typing import Any

import pytest

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import Engine, EngineConfig, InvalidRequestError, sampling_from
from gpu_worker.model.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine() -> Engine:
    cfg = CacheConfig(page_size=4, num_device_pages=64, enable_hierarchical_cache=True)
    eng = Engine(EngineConfig(cache=cfg, context_len=200))
    eng.generate(list(range(30)), SamplingParams(max_new_tokens=3))  # something cached
    eng.cache.drain()
    return eng


def snapshot(eng: Engine) -> tuple[Any, ...]:
    c = eng.cache
    assert c.host_pool is not None
    return (
        c.num_free_device_pages,
        c.tree.num_device_pages,
        c.tree.num_host_pages,
        c.host_pool.allocator.num_free,
        len(eng.scheduler.waiting),
        len(eng.scheduler.running),
        c.tree._clock,
        len(list(c.tree.iter_nodes())),
    )


OK = SamplingParams(max_new_tokens=4)

BAD_PROMPTS = [
    ([], OK, "empty"),
    ([1, 2, 260], OK, r"\[0, 260\)"),
    ([1, -1], OK, r"\[0, 260\)"),
    ([1, 2.5], OK, "integers"),
    ([1, "a"], OK, "integers"),
    ([True, 2], OK, "integers"),
    (list(range(100)) * 2, OK, "context length"),
    ([1] * 150, SamplingParams(max_new_tokens=60), "context length"),
]


@pytest.mark.parametrize(("prompt", "sampling", "message"), BAD_PROMPTS)
def test_bad_prompt_changes_nothing(
    engine: Engine, prompt: list[Any], sampling: SamplingParams, message: str
) -> None:
    before = snapshot(engine)
    with pytest.raises(InvalidRequestError, match=message):
        engine.generate(prompt, sampling)
    with pytest.raises(InvalidRequestError, match=message):
        engine.generate_batch([list(range(10)), prompt], sampling)
    assert snapshot(engine) == before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": -1}, ">= 0"),
        ({"max_new_tokens": 2, "temperature": math.nan}, "finite"),
        ({"max_new_tokens": 2, "temperature": math.inf}, "finite"),
        ({"max_new_tokens": 2, "temperature": -0.5}, ">= 0"),
        ({"max_new_tokens": 2, "top_p": 0.0}, "top_p"),
        ({"max_new_tokens": 2, "top_p": 1.5}, "top_p"),
        ({"max_new_tokens": 2.5}, "integer"),
    ],
)
def test_bad_sampling_is_rejected(engine: Engine, kwargs: dict[str, Any], message: str) -> None:
    before = snapshot(engine)
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
    with pytest.raises(InvalidRequestError, match=message):
        sampling_from(**kwargs)
    assert snapshot(engine) == before


def test_pool_too_small_for_request() -> None:
    """A request reserves pages for every token it may write: the device pool bounds the
    context length, and the error says so."""
    eng = Engine(EngineConfig(cache=CacheConfig(page_size=4, num_device_pages=4)))
    assert eng.context_len == 16
    with pytest.raises(InvalidRequestError, match=r"context length 16 \(its device pool: 4 pages"):
        eng.generate(list(range(20)), OK)
    assert eng.cache.num_free_device_pages == 4


def test_good_request_after_bad_ones(engine: Engine) -> None:
    out = engine.generate(list(range(30)), SamplingParams(max_new_tokens=3))
    assert len(out.output_ids) <= 3 and out.cached.total > 0
    assert engine.generate(list(range(5)), SamplingParams(max_new_tokens=0)).output_ids == []
    engine.cache.drain()
    engine.check_integrity()
