"""Admission counts a sharded CP pool's gather scratch (issue 22, build 4).

A CP2 sharded engine whose `--cp-gather-buffer-mb` holds the gathers of about three of
the workload's requests runs nine of them submitted together: the scheduler runs fewer at
a time than the same engine with the default budget (the batch is split), its two scratch
buffers never grow past the budget (the unsplit run's do), and the greedy outputs and
float64 logits equal a CP1 engine's bit for bit. A request whose gather alone is over the
budget fails with a clear error, and the engine goes on serving.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from multirank import run_world, shared_prefix_prompts
from test_multirank_consensus import checker_env

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.consensus.records import first_divergence, load_logs
from gpu_worker.engine.engine import DebugHooks, Engine, EngineConfig
from gpu_worker.memory.sharded_pool import ShardedDeviceKVPool
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.scheduler.gather_budget import GatherBudget
from gpu_worker.scheduler.scheduler import SchedulerConfig
from services.engine import flags
from services.engine.config import engine_config_from_args

PAGE = 4
# tiny preset, float64: one layer's K/V of a page is 2 x 4 x 2 x 16 x 8 = 2 KiB, so one
# scratch page in both buffers is 4 KiB; 40 of them hold about three requests' gathers
BUDGET_MB = 40 * 4096 / 2**20
SAMPLING = SamplingParams(max_new_tokens=4, ignore_eos=True)
PROMPTS = shared_prefix_prompts(11, (16, 24), (4, 12))


def config(cp: int, budget_mb: float = 1024.0) -> EngineConfig:
    return EngineConfig(
        model="tiny",
        cache=CacheConfig(page_size=PAGE, num_device_pages=256),
        scheduler=SchedulerConfig(chunked_prefill_size=32, cp_gather_buffer_mb=budget_mb),
        # the budget is the all-gather's scratch (transport shm has none: no budget)
        parallel=ParallelConfig(
            cp_size=cp,
            kv_sharding=cp > 1,
            cp_gather_transport="collective" if cp > 1 else "auto",
        ),
        debug=DebugHooks(gather_reads=True, poison_kv=cp > 1),
        batch_invariant=True,  # a row's logits do not depend on what it is batched with
    )


def budgeted_run(engine: Engine, prompts: list[list[int]], big: list[int]) -> dict[str, object]:
    """The prompts as one batch, stepped by hand to see how many run at once; then `big`
    alone (an error if it never fits) and the first prompt again."""
    reqs = [engine.submit(p, SAMPLING) for p in prompts]
    for r in reqs:
        r.logits_trace = []
    most_running = 0
    while any(r.finish_reason is None for r in reqs):
        engine.step()
        most_running = max(most_running, len(engine.scheduler.running))
    pool = engine.cache.device_pool
    big_req = engine.submit(big, SAMPLING)
    engine.run([big_req])
    after = engine.generate(prompts[0], SAMPLING)
    return {
        "outputs": [r.output_ids for r in reqs],
        "logits": [torch.stack(r.logits_trace or []) for r in reqs],
        "most_running": most_running,
        "scratch_bytes": pool.scratch_bytes() if isinstance(pool, ShardedDeviceKVPool) else 0,
        "big": (big_req.finish_reason, big_req.error and big_req.error.message),
        "after": after.output_ids,
    }


def test_gather_budget_splits_the_batch_outputs_unchanged(tmp_path: Path) -> None:
    big = [7] * 160  # 41 pages with its outputs: over 40 scratch pages alone
    env = checker_env(tmp_path)
    small = run_world(config(2, BUDGET_MB), budgeted_run, PROMPTS, big, env=env)
    unsplit = run_world(config(2), budgeted_run, PROMPTS, big)
    single = Engine(config(1))
    try:
        want = budgeted_run(single, PROMPTS, big)
    finally:
        single.close()

    assert isinstance(small["most_running"], int) and isinstance(unsplit["most_running"], int)
    assert unsplit["most_running"] == len(PROMPTS)  # the default budget admits them all
    assert 1 < small["most_running"] < len(PROMPTS)  # the budget split the batch
    assert isinstance(small["scratch_bytes"], int) and isinstance(unsplit["scratch_bytes"], int)
    assert 0 < small["scratch_bytes"] <= BUDGET_MB * 2**20 < unsplit["scratch_bytes"]

    for got in (small, unsplit):
        assert got["outputs"] == want["outputs"] and got["after"] == want["after"]
        for a, b in zip(got["logits"], want["logits"], strict=True):  # type: ignore[call-overload]
            assert torch.equal(a, b)
    reason, message = small["big"]  # type: ignore[misc]
    assert reason == "error" and "--cp-gather-buffer-mb" in message
    assert unsplit["big"] == want["big"] == ("length", None)

    logs = load_logs(tmp_path)  # every decision, as each CP rank took it
    assert sorted(logs) == ["rank0 PP0/CP0/TP0", "rank1 PP0/CP1/TP0"]
    assert first_divergence(logs) is None
    fits = [r.results for r in logs["rank0 PP0/CP0/TP0"] if r.call == "Admission._gather_fits"]
    assert "False" in fits and "True" in fits


def test_budget_bound_covers_every_plan_of_a_decode_and_prefill_mix() -> None:
    """The bound's arithmetic on a case worked by hand: CP2, page 4, chunk 32."""
    budget = GatherBudget(100, 2, 4, 32, 1.0)
    # one request of 10 pages alone: 2 * 5 gathered + min(10, 32 // 4 + 1) staged + trash
    assert budget.alone(10) == 10 + 9 + 1
    # a running request on pages 0..5 and a new one sharing pages 0, 1 with 4 fresh pages
    # (path positions 2..5: owner classes 0, 1, 0, 1): union 10 pages, 5 per class
    need = budget.with_request([[0, 1, 2, 3, 4, 5]], 1, [0, 1], 4)
    assert need == 2 * 5 + min(10, 8 + 2) + 1
    # with the shared pages counted once: not 2 * 6 from 12 pages
    assert budget.with_request([[0, 1, 2, 3, 4, 5]], 1, [0, 1], 0) == 2 * 3 + 6 + 1


def test_the_flag_reaches_the_scheduler_and_up_forwards_it() -> None:
    parser = argparse.ArgumentParser()
    flags.add_engine_args(parser)
    argv = ["--cp-size", "2", "--enable-kv-cache-sharding", "--cp-gather-buffer-mb", "0.5"]
    args = parser.parse_args(argv)
    assert engine_config_from_args(args).scheduler.cp_gather_buffer_mb == 0.5
    assert flags.engine_argv(args) == argv  # what `up` passes on to each engine
    assert engine_config_from_args(parser.parse_args([])).scheduler == SchedulerConfig()
    for bad in ("0", "-1", "nan"):
        with pytest.raises(ValueError, match="--cp-gather-buffer-mb must be positive"):
            engine_config_from_args(parser.parse_args(["--cp-gather-buffer-mb", bad]))
