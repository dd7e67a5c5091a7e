"""Agreement under stress, and the rank consensus checker (issue 8, acceptance 2).

A TP2 x PP2 engine with injected transfer delays that differ per rank and per transfer
(so ranks see different ACKs ready at the same logical point) serves 2,000 requests over
shared prefixes, with flushes and device pressure pushing prefixes to the host tier, with
the checker on and `--hicache-load-policy cost` (each load decided from rank 0's timings,
sent as commands). No divergence may be reported, and every output must equal a TP1
engine's.

Then the agreement is switched off by the test hooks, once for `pp_sync` (each stage
consumes its own ready count) and once for the TP MIN (each PP0 rank consumes its own): the
checker must report a divergence, name the first unequal entry (the ACK count consumed,
whose parameters differ), and `hicache-mesh consensus DIR` must print the same from the
per-rank logs.
"""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from multirank import WorldFailed, run_world

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.cache.transfer import DelayInjection
from gpu_worker.consensus.records import load_logs
from gpu_worker.engine.engine import DebugHooks, Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.scheduler.scheduler import SchedulerConfig

PAGE = 4
NUM_REQUESTS = 2000
WAVE = 100  # requests submitted together
FLUSH_EVERY = 5  # waves


def make_requests(seed: int = 5) -> list[tuple[list[int], SamplingParams]]:
    """2,000 prompts over 24 shared prefixes (some extending others), mixed lengths."""
    rng = random.Random(seed)
    roots = [[rng.randrange(256) for _ in range(rng.randint(8, 40))] for _ in range(8)]
    prefixes = [r + [rng.randrange(256) for _ in range(rng.randint(0, 12))] for r in roots * 3]
    reqs = []
    for _ in range(NUM_REQUESTS):
        prompt = rng.choice(prefixes) + [rng.randrange(256) for _ in range(rng.randint(1, 9))]
        sp = SamplingParams(max_new_tokens=rng.randint(1, 4), ignore_eos=True)
        reqs.append((prompt, sp))
    return reqs


def stress(engine: Engine, reqs: list[tuple[list[int], SamplingParams]]) -> dict[str, object]:
    outputs: list[list[int]] = []
    host_hits = flushes = 0
    for wave, start in enumerate(range(0, len(reqs), WAVE)):
        batch = [engine.submit(p, sp) for p, sp in reqs[start : start + WAVE]]
        for out in engine.run(batch):
            outputs.append(out.output_ids)
            host_hits += out.cached.host
        if wave % FLUSH_EVERY == FLUSH_EVERY - 1:
            assert engine.flush_cache()
            flushes += 1
    result: dict[str, object] = {"outputs": outputs, "host_hits": host_hits, "flushes": flushes}
    if engine.consensus is not None:  # let the checker compare the last records too
        deadline = time.monotonic() + 30
        while engine.consensus.checked < len(engine.consensus.records):
            assert time.monotonic() < deadline, "the checker fell behind"
            time.sleep(0.05)
        result["checked"] = engine.consensus.checked
        result["divergence"] = engine.consensus.divergence
    return result


def stress_config(disable: str = "none") -> EngineConfig:
    cache = CacheConfig(
        page_size=PAGE,
        num_device_pages=160,  # a few waves' worth: prefixes are evicted to the host
        enable_hierarchical_cache=True,
        hicache_ratio=4.0,
        transfer_delay=DelayInjection(max_ms=4.0, seed=1),
        hicache_load_policy="cost",  # rank 0's measured figures, sent to every rank
    )
    return EngineConfig(
        model="tiny-tp",
        cache=cache,
        scheduler=SchedulerConfig(chunked_prefill_size=256),
        parallel=ParallelConfig(2, 2),
        debug=DebugHooks(disable_agreement=disable),
    )


def checker_env(log_dir: Path) -> dict[str, str]:
    return {"HICACHE_RANK_CONSENSUS": "1", "HICACHE_RANK_CONSENSUS_DIR": str(log_dir)}


def test_stress_tp2_pp2_no_divergence_and_equal_to_tp1(tmp_path: Path) -> None:
    reqs = make_requests()
    config = stress_config()
    single = Engine(dataclasses.replace(config, parallel=ParallelConfig()))
    want = stress(single, reqs)
    single.close()
    got = run_world(config, stress, reqs, env=checker_env(tmp_path))
    assert got["divergence"] is None
    assert isinstance(got["checked"], int) and got["checked"] > 4 * NUM_REQUESTS
    assert got["outputs"] == want["outputs"]
    assert got["flushes"] == NUM_REQUESTS // WAVE // FLUSH_EVERY
    assert isinstance(got["host_hits"], int) and got["host_hits"] > 0  # the host tier served
    logs = load_logs(tmp_path)
    assert sorted(logs) == [f"rank{r} PP{r // 2}/TP{r % 2}" for r in range(4)]
    assert len({len(records) for records in logs.values()}) == 1  # all ranks logged alike


@pytest.mark.parametrize("disable", ["pp_sync", "tp_min"])
def test_checker_reports_divergence_without_agreement(tmp_path: Path, disable: str) -> None:
    with pytest.raises(WorldFailed) as failed:
        run_world(stress_config(disable), stress, make_requests(), env=checker_env(tmp_path))
    text = str(failed.value)
    assert "RankDivergenceError" in text and "Found rank divergence at entry" in text
    assert "the parameters differ" in text
    assert "Scheduler.consume_acks" in text.split("Found rank divergence")[-1].splitlines()[1]

    cli = [sys.executable, "-m", "services.cli", "consensus", str(tmp_path)]
    report = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert report.returncode == 1, report.stderr
    first = report.stdout.splitlines()[0]
    assert first.startswith("Found rank divergence at entry") and "parameters differ" in first
    assert first in text  # the offline report names the same entry as the live one
    assert "Scheduler.consume_acks" in report.stdout.splitlines()[1]
