"""Engine failure paths (DESIGN.md 7a): a request's own failure fails that request alone;
a dead step loop stops heartbeats, fails everything it held and exits non-zero; SIGTERM
stops an engine while NATS is unreachable."""

from __future__ import annotations

import math

import torch

from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.scheduler.request import ReqState

POISON = 7  # an embedding row set to NaN: a prompt holding it yields NaN logits


def nan_engine() -> Engine:
    engine = Engine(EngineConfig())
    with torch.no_grad():
        engine.model.embed_tokens.weight[POISON] = math.nan
    return engine


def test_a_request_that_fails_in_sampling_fails_alone() -> None:
    """NaN logits for one request of a batch: it ends with a 500, the others finish with the
    same tokens as alone, its pages go back, and the engine keeps serving."""
    sp = SamplingParams(max_new_tokens=6, temperature=0.7, seed=3, ignore_eos=True)
    good = [list(range(20, 33)), list(range(40, 49))]
    alone = [nan_engine().generate(p, sp).output_ids for p in good]
    engine = nan_engine()
    free_before = engine.cache.num_free_device_pages
    bad = engine.submit([1, 2, POISON, 4, 5], sp)
    reqs = [engine.submit(p, sp) for p in good]
    outs = engine.run([*reqs, bad])
    assert bad.error is not None and bad.error[1] == 500
    assert "sampling failed" in bad.error[0]
    assert bad.state is ReqState.FINISHED and bad.output_ids == []
    assert [o.output_ids for o in outs[:2]] == alone
    assert all(o.finish_reason == "length" for o in outs[:2])
    engine.check_integrity()
    engine.cache.drain()
    assert engine.cache.num_free_device_pages + engine.cache.tree.num_device_pages == free_before
    assert engine.generate(good[0], sp).output_ids == alone[0]  # still serving
    engine.check_integrity()
