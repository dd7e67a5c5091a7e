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

Three cheaper worlds cover what those cannot show (issue 19):
- PP3: a middle stage must forward PP0's counts, not its own ready count (with PP2 no stage
  both receives and forwards); the checker stays quiet and outputs equal TP1's;
- TP2: the agreement is the MIN, so PP0 never waits on a copy: with MAX every rank consumes
  the same counts (the checker sees nothing, outputs stay right), but a rank whose copy is
  still running waits for it, and the engine runs at its slowest rank's pace;
- TP2 with one rank missing a device page: its page ids, a call's results, differ while
  every call and parameter is the same; the checker must say the results differ.
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


def make_requests(
    seed: int = 5, num_requests: int = NUM_REQUESTS
) -> list[tuple[list[int], SamplingParams]]:
    """2,000 prompts over 24 shared prefixes (some extending others), mixed lengths."""
    rng = random.Random(seed)
    roots = [[rng.randrange(256) for _ in range(rng.randint(8, 40))] for _ in range(8)]
    prefixes = [r + [rng.randrange(256) for _ in range(rng.randint(0, 12))] for r in roots * 3]
    reqs = []
    for _ in range(num_requests):
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


# ---------------------------------------------------------------- issue 19: cheaper worlds

NUM_SMALL = 300  # requests of the PP3 and TP2 worlds (3 waves)


def _single(config: EngineConfig, reqs: list[tuple[list[int], SamplingParams]]) -> object:
    single = Engine(dataclasses.replace(config, parallel=ParallelConfig()))
    try:
        return stress(single, reqs)["outputs"]
    finally:
        single.close()


def test_pp3_middle_stage_forwards_pp0s_counts(tmp_path: Path) -> None:
    """PP1 receives PP0's agreed counts and passes them to PP2, which consumes exactly
    those; forwarding PP1's own ready count instead diverges under the delays."""
    reqs = make_requests(num_requests=NUM_SMALL)
    config = dataclasses.replace(stress_config(), parallel=ParallelConfig(1, 3))
    got = run_world(config, stress, reqs, env=checker_env(tmp_path))
    assert got["divergence"] is None
    assert isinstance(got["checked"], int) and got["checked"] > 4 * NUM_SMALL
    assert isinstance(got["host_hits"], int) and got["host_hits"] > 0  # ACKs were consumed
    assert got["outputs"] == _single(config, reqs)
    logs = load_logs(tmp_path)
    assert sorted(logs) == [f"rank{r} PP{r}/TP0" for r in range(3)]
    assert len({len(records) for records in logs.values()}) == 1


def stress_and_waits(
    engine: Engine, reqs: list[tuple[list[int], SamplingParams]]
) -> dict[str, object]:
    """`stress`, and rank 0's counts: ACKs it consumed before their copy finished, and steps
    the agreement held it back because its TP peer was behind."""
    result = stress(engine, reqs)
    result["ack_waits"] = engine.scheduler.num_ack_waits
    result["held_back"] = engine.sync.num_held_back
    return result


def test_tp_ranks_agree_on_the_min_so_pp0_never_waits() -> None:
    """Copies of up to 20 ms (MAX, put back on purpose, made rank 0 wait on 104-128 of them
    in 300 requests; 4 ms delays on only 5-9)."""
    reqs = make_requests(num_requests=NUM_SMALL)
    base = stress_config()
    cache = dataclasses.replace(base.cache, transfer_delay=DelayInjection(max_ms=20.0, seed=1))
    config = dataclasses.replace(base, cache=cache, parallel=ParallelConfig(2, 1))
    got = run_world(config, stress_and_waits, reqs)
    assert got["outputs"] == _single(config, reqs)
    # rank 0 never consumed a copy of its own still running ...
    assert got["ack_waits"] == 0, got["ack_waits"]
    # ... though the delays made the ranks' ready counts differ, rank 0 often ahead
    assert isinstance(got["held_back"], int) and got["held_back"] > 0


def leak_a_page_then_serve(engine: Engine, reqs: list[tuple[list[int], SamplingParams]]) -> None:
    """Rank 0 loses one device page (as a leak would), then serves `reqs` until the checker
    stops the engine: rank 0's page ids now differ from rank 1's, and nothing else does."""
    assert engine.cache.device_pool.allocator.alloc(1) == [0]  # rank 0's alone
    for prompt, sp in reqs:
        engine.run([engine.submit(prompt, sp)])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        engine.step()  # raises RankDivergenceError once the checker found the divergence
        time.sleep(0.05)
    raise AssertionError("the checker found no divergence")


def test_checker_reports_ranks_that_differ_only_in_a_result(tmp_path: Path) -> None:
    config = EngineConfig(
        model="tiny-tp",
        cache=CacheConfig(page_size=PAGE, num_device_pages=64),
        parallel=ParallelConfig(2, 1),
    )
    with pytest.raises(WorldFailed) as failed:
        run_world(
            config, leak_a_page_then_serve, make_requests(num_requests=4), env=checker_env(tmp_path)
        )
    text = str(failed.value)
    assert "RankDivergenceError" in text
    report = text.split("Found rank divergence at entry")[-1].splitlines()
    assert report[0].endswith(": the results differ"), report
    rank0, rank1 = (line.split(": ", 1)[1] for line in report[1:3])
    call0, rest0 = rank0.split(" params=")
    call1, rest1 = rank1.split(" params=")
    assert call0 == call1 == "PrefixCache.alloc", report
    params0, results0 = rest0.split(" results=")
    params1, results1 = rest1.split(" results=")
    assert params0 == params1 and results0 != results1
    assert results0.startswith("[1") and results1.startswith("[0")  # rank 0 lost page 0
