"""A sharded CP4 engine under load (issue 22, first part of acceptance 4).

TP1 x CP4 with `--enable-kv-cache-sharding` serves 1,000 requests over shared prefixes in
waves, with flushes and a device pool small enough that prefixes are evicted (per owner
class: a path's pages stay on its owner cycle), with the rank consensus checker on and the pools
poisoned (rows no rank wrote read as NaN). Every rank sleeps a random time before each
decoder layer, drawn per rank (`DebugHooks.rank_layer_delay_max_s`), so the ranks reach
each layer's gather, and start the next layer's, at different and changing times. No
divergence may be reported, and every output must equal a CP1 engine's (one that reads KV
by gathers, as the sharded pool does). The ranks' ACK agreement under per-rank transfer
delays, with the sharded host tier, is `test_cp_engine.py::test_cp_ranks_agree_on_acks_under_delays`.

Then one rank rotates owners differently (`DebugHooks.perturb_owner_rotation_rank`: its
requests' new pages start one owner class off their prefix's cycle): the checker must
report a divergence and name the first unequal entry, that rank's owner rotation of the
first request admitted, live and in `hicache-mesh consensus DIR`'s report of the logs.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from multirank import WorldFailed, run_world
from test_multirank_consensus import WAVE, checker_env, make_requests, stress

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.consensus.records import load_logs
from gpu_worker.engine.engine import DebugHooks, Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.scheduler.scheduler import SchedulerConfig

NUM_REQUESTS = 1000
FLUSH_EVERY = 5  # test_multirank_consensus's waves per flush
LAYER_DELAY_MAX_S = 0.003  # each rank, before each of the tiny preset's 4 layers
PERTURBED_RANK = 2


def stress_and_evictions(
    engine: Engine, reqs: list[tuple[list[int], SamplingParams]]
) -> dict[str, object]:
    """`stress`, then one more wave after its last flush (which resets the cache's
    counters), with the device pages that wave evicted."""
    result = stress(engine, reqs)
    result["last"] = [o.output_ids for o in engine.run([engine.submit(*r) for r in reqs[:WAVE]])]
    result["evicted"] = engine.cache.stats.evicted_device_pages
    return result


def config(cp: int) -> EngineConfig:
    return EngineConfig(
        model="tiny",
        cache=CacheConfig(page_size=4, num_device_pages=80),  # a wave does not fit
        scheduler=SchedulerConfig(chunked_prefill_size=64),
        parallel=ParallelConfig(cp_size=cp, kv_sharding=cp > 1),
        debug=DebugHooks(
            gather_reads=True,
            poison_kv=cp > 1,
            rank_layer_delay_max_s=LAYER_DELAY_MAX_S if cp > 1 else 0.0,
        ),
    )


def test_sharded_cp4_stress_no_divergence_and_equal_to_cp1(tmp_path: Path) -> None:
    reqs = make_requests(num_requests=NUM_REQUESTS)
    got = run_world(config(4), stress_and_evictions, reqs, env=checker_env(tmp_path))
    assert got["divergence"] is None
    assert isinstance(got["checked"], int) and got["checked"] > 4 * NUM_REQUESTS
    assert got["flushes"] == NUM_REQUESTS // WAVE // FLUSH_EVERY
    assert isinstance(got["evicted"], int) and got["evicted"] > 0  # device pressure
    single = Engine(config(1))
    try:
        want = stress_and_evictions(single, reqs)
    finally:
        single.close()
    assert got["outputs"] == want["outputs"] and got["last"] == want["last"]
    # not as many: a sharded pool frees pages of the classes a path's cycle needs, a CP1
    # pool any page, so evictions differ; what is computed from the cache does not
    assert isinstance(want["evicted"], int) and want["evicted"] > 0
    logs = load_logs(tmp_path)
    assert sorted(logs) == [f"rank{r} PP0/CP{r}/TP0" for r in range(4)]
    assert len({len(records) for records in logs.values()}) == 1  # all ranks logged alike


def test_perturbed_owner_rotation_is_named_by_the_checker(tmp_path: Path) -> None:
    base = config(4)
    perturbed = dataclasses.replace(
        base, debug=dataclasses.replace(base.debug, perturb_owner_rotation_rank=PERTURBED_RANK)
    )
    reqs = make_requests(num_requests=WAVE)
    with pytest.raises(WorldFailed) as failed:
        run_world(perturbed, stress, reqs, env=checker_env(tmp_path))
    text = str(failed.value)
    assert "RankDivergenceError" in text and "Found rank divergence at entry" in text
    report = text.split("Found rank divergence")[-1].splitlines()
    assert "the results differ" in report[0]
    entries = [line for line in report[1:5] if "Admission._owner_rotation" in line]
    assert len(entries) == 4  # every rank's record of the entry, the perturbed one apart
    assert len({line.split("results=")[-1] for line in entries}) == 2
    assert any(f"rank{PERTURBED_RANK} " in line for line in entries)

    cli = [sys.executable, "-m", "services.cli", "consensus", str(tmp_path)]
    offline = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert offline.returncode == 1, offline.stderr
    first = offline.stdout.splitlines()[0]
    assert first.startswith("Found rank divergence at entry") and "results differ" in first
    assert first in text  # the offline report names the same entry as the live one
    assert "Admission._owner_rotation" in offline.stdout.splitlines()[1]


def test_rank_layer_delays_differ_per_rank_and_layer() -> None:
    hooks = DebugHooks(rank_layer_delay_max_s=LAYER_DELAY_MAX_S)
    draws = []
    for rank in range(4):
        delay = hooks.layer_delay(rank)
        assert delay is not None
        draws.append([delay() for _ in range(8)])
    assert all(0 <= d < LAYER_DELAY_MAX_S for ds in draws for d in ds)
    assert len({tuple(ds) for ds in draws}) == 4 and len(set(draws[0])) == 8
    assert DebugHooks().layer_delay(0) is None
