"""Multi-rank engines give TP1's outputs (issue 8, acceptance 1; DESIGN.md invariant 1).

Each case launches a real world of rank processes (`tests/multirank.py`: rank 0 in a fresh
process, the other ranks as its children over gloo, as the engine service does) and runs
one scripted workload on it: a cold batch over shared prefixes, the same batch again (device
hits), the device cache evicted (host hits), a second turn that extends the first's outputs,
and a flush. The same workload runs in-process on a TP1 engine of the same config. Tokens
and cached-token counts per tier must be equal at every phase; float64 logits must be
bit-identical under pure PP (the same operations run, split over stages) and within 1e-10
under TP (a row-parallel all_reduce sums its halves in another order). Each phase's hits
are asserted to happen, so a case where nothing is cached cannot pass by accident.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from multirank import Run, run_world, shared_prefix_prompts, traced_batch

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.scheduler.scheduler import SchedulerConfig

PAGE = 4
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)
PHASES = ("cold", "device", "host", "turn2", "flushed")


def make_prompts(seed: int = 11) -> list[list[int]]:
    return shared_prefix_prompts(seed, shared=(13, 30), tail=(2, 11))


def workload(engine: Engine, prompts: list[list[int]]) -> Run:
    """The scripted phases (see the module doc); runs on rank 0 or on a TP1 engine."""
    run = traced_batch(engine, "cold", prompts, GREEDY)
    run += traced_batch(engine, "device", prompts, GREEDY)
    engine.evict_device(engine.cache.tree.num_device_pages)  # drains the backups first
    run += traced_batch(engine, "host", prompts, GREEDY)
    second = [p + out + [7, 9] for p, (_, out, *_rest) in zip(prompts, run, strict=False)]
    run += traced_batch(engine, "turn2", second, GREEDY)
    assert engine.flush_cache()
    run += traced_batch(engine, "flushed", prompts[:3], GREEDY)
    engine.drain()  # on every rank (rank 0's queue alone must never be drained)
    engine.check_integrity()
    return run


def config(tp: int, pp: int, policy: str, layout: str = "layer_first") -> EngineConfig:
    cache = CacheConfig(
        page_size=PAGE,
        num_device_pages=96,
        enable_hierarchical_cache=True,
        hicache_ratio=4.0,
        hicache_write_policy=policy,  # type: ignore[arg-type]
        hicache_mem_layout=layout,  # type: ignore[arg-type]
        write_through_threshold=1,
    )
    return EngineConfig(
        model="tiny-tp",
        cache=cache,
        scheduler=SchedulerConfig(chunked_prefill_size=24),
        parallel=ParallelConfig(tp, pp),
        batch_invariant=True,
    )


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts()


# every layout under every write policy, host layouts alternating
CASES = [
    (tp, pp, policy, ("layer_first", "page_first")[(i + j) % 2])
    for i, (tp, pp) in enumerate([(2, 1), (1, 2), (2, 2)])
    for j, policy in enumerate(["write_through", "write_through_selective", "write_back"])
]


@pytest.mark.parametrize(("tp", "pp", "policy", "layout"), CASES)
def test_multirank_equals_tp1(
    prompts: list[list[int]], tp: int, pp: int, policy: str, layout: str
) -> None:
    multi_config = config(tp, pp, policy, layout)
    single = Engine(dataclasses.replace(multi_config, parallel=ParallelConfig()))
    want = workload(single, prompts)
    single.close()
    got = run_world(multi_config, workload, prompts)

    hits = {phase: [0, 0] for phase in PHASES}
    for (phase, w_out, w_dev, w_host, w_logits), (_, out, dev, host, logits) in zip(
        want, got, strict=True
    ):
        assert out == w_out, f"{phase}: tokens differ from TP1"
        assert (dev, host) == (w_dev, w_host), f"{phase}: cached tokens per tier differ"
        assert logits.shape == w_logits.shape == (GREEDY.max_new_tokens, 260)
        if tp == 1:
            assert torch.equal(logits, w_logits), f"{phase}: PP logits are not bit-identical"
        else:
            diff = (logits - w_logits).abs().max().item()
            assert diff < 1e-10, f"{phase}: TP logits differ by {diff:.3g}"
        hits[phase][0] += dev
        hits[phase][1] += host
    assert hits["cold"] == [0, 0] and hits["flushed"] == [0, 0]
    assert hits["device"][0] > 0 and hits["host"][1] > 0 and sum(hits["turn2"]) > 0
    assert len({tuple(out) for _, out, *_ in want}) > len(prompts) // 2  # varied outputs
