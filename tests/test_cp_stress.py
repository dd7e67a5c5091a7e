"""A sharded CP4 engine under load (issue 22, first part of acceptance 4).

TP1 x CP4 with `--enable-kv-cache-sharding` serves 1,000 requests over shared prefixes in
waves, with flushes and a device pool small enough that prefixes are evicted (per owner
class: a path's pages stay on its owner cycle), with the rank consensus checker on and the pools
poisoned (rows no rank wrote read as NaN). No divergence may be reported, and every output
must equal a CP1 engine's (one that reads KV by gathers, as the sharded pool does). Per-rank
delays need the host tier, which a sharded engine refuses yet: the ranks' ACK agreement
under delays is `test_cp_engine.py`'s, on replicated CP.
"""

from __future__ import annotations

from pathlib import Path

from multirank import run_world
from test_multirank_consensus import WAVE, checker_env, make_requests, stress

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.consensus.records import load_logs
from gpu_worker.engine.engine import DebugHooks, Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.scheduler.scheduler import SchedulerConfig

NUM_REQUESTS = 1000
FLUSH_EVERY = 5  # test_multirank_consensus's waves per flush


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
        debug=DebugHooks(gather_reads=True, poison_kv=cp > 1),
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
