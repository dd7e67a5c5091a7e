"""Context-parallel engines give CP1's outputs (issue 22, first slice of acceptance 1).

Each case launches a real world of rank processes (`tests/multirank.py`, gloo on CPU) with
`--cp-size` 2 or 4, replicated (every CP rank holds every page) or sharded
(`--enable-kv-cache-sharding`: each rank holds its own pages and all-gathers a layer's
pages before attending), and runs one scripted workload on it: a cold batch over shared
prefixes under device-pool pressure, the same batch again (device hits), a second turn that
extends the first's outputs (a shared prefix of another length), the device cache evicted
(recompute into reused pages of other owners; with a host tier, host hits loaded back: a
sharded rank backs up and loads only its own pages, under each write policy), and a flush.
The same workload runs on a CP1 engine of the same model and TP layout. Each CP rank
computes its zigzag share of a prefill's tokens (`--cp-split`, the default), yet tokens,
cached-token counts and float64 logits must be equal, bit for bit. A sharded engine reads
KV by slot gathers (its pool has no in-place runs), so its
reference is a CP1 engine that reads by gathers too (`DebugHooks.gather_reads`); a
replicated one is compared with the plain CP1 engine. Sharded pools are poisoned: rows no
rank wrote and fresh gather buffers are NaN, so a read of a row that was not gathered shows
in the logits.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from pathlib import Path

import pytest
import test_compose
import test_multirank_consensus
import torch
from multirank import Run, WorldFailed, run_world, shared_prefix_prompts, traced_batch
from test_multirank_consensus import checker_env, stress

from gpu_worker.cache.hicache import CacheConfig, WritePolicy
from gpu_worker.consensus.records import load_logs
from gpu_worker.engine.engine import DebugHooks, Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.scheduler.scheduler import SchedulerConfig
from services.engine import flags
from services.engine.config import engine_config_from_args
from services.launch.buckets import LaunchBucket, parse_bucket

PAGE = 4
NUM_PAGES = 72  # the logical pool: a batch of all prompts does not fit at once
GREEDY = SamplingParams(max_new_tokens=5, ignore_eos=True)


def make_prompts(seed: int = 22) -> list[list[int]]:
    return shared_prefix_prompts(seed, shared=(9, 26), tail=(2, 9))


def workload(engine: Engine, prompts: list[list[int]]) -> tuple[Run, int, set[int]]:
    """The phases (see the module doc) on rank 0 or a CP1 engine; with them, rank 0's
    device pool rows and the owner classes (page % cp_size) of the pages the tree held."""
    run = traced_batch(engine, "cold", prompts, GREEDY)
    run += traced_batch(engine, "device", prompts, GREEDY)
    held = {p for n in engine.cache.tree.iter_nodes() for p in (n.device_page_ids or [])}
    second = [p + out + [7, 9] for p, (_, out, *_rest) in zip(prompts, run, strict=False)]
    run += traced_batch(engine, "turn2", second[:6], GREEDY)
    if engine.config.cache.enable_hierarchical_cache:
        engine.evict_device(engine.cache.tree.num_device_pages)  # drains the backups first
        run += traced_batch(engine, "host", prompts[:6], GREEDY)
    else:
        engine.evict_device(engine.cache.tree.num_device_pages)
        run += traced_batch(engine, "evicted", prompts[3:], GREEDY)
    assert engine.flush_cache()
    run += traced_batch(engine, "flushed", prompts[:3], GREEDY)
    engine.drain()  # on every rank
    engine.check_integrity()
    owners = {p % engine.config.parallel.cp_size for p in held}
    return run, engine.cache.device_pool.kv.shape[2], owners


def config(
    cp: int,
    sharded: bool,
    tp: int = 1,
    pp: int = 1,
    host: WritePolicy | None = None,
    gather: bool = False,
    split: str = "zigzag",  # --cp-split; `none` and `interleave`: tests/test_cp_split.py
    transport: str = "auto",  # --cp-gather-transport: auto is shm on these CPU ranks
) -> EngineConfig:
    """`host`: the host tier's write policy, None for no host tier."""
    cache = CacheConfig(
        page_size=PAGE,
        num_device_pages=NUM_PAGES,
        enable_hierarchical_cache=host is not None,
        hicache_ratio=4.0,
        hicache_write_policy=host or "write_through",
        write_through_threshold=1,
    )
    return EngineConfig(
        model="tiny-tp" if tp > 1 else "tiny",
        cache=cache,
        scheduler=SchedulerConfig(chunked_prefill_size=24),
        parallel=ParallelConfig(tp, pp, cp, sharded, split, transport),
        batch_invariant=True,
        debug=DebugHooks(gather_reads=gather, poison_kv=sharded),
    )


@functools.cache
def reference(tp: int, host: WritePolicy | None, gather: bool) -> Run:
    """The CP1 run (TP1: in this process; TP2: a TP2 world, whose logits differ from TP1's
    in the last bits)."""
    cfg = config(1, False, tp=tp, host=host, gather=gather)
    if tp == 1:
        engine = Engine(cfg)
        try:
            return workload(engine, make_prompts())[0]
        finally:
            engine.close()
    return run_world(cfg, workload, make_prompts())[0]


# (cp, sharded, tp, pp, host, --cp-gather-transport): sharded cases gather with shm (auto
# on CPU), but one with the all-gather
CASES: list[tuple[int, bool, int, int, WritePolicy | None, str]] = [
    (2, True, 1, 1, None, "collective"),
    (2, False, 1, 1, None, "auto"),
    (4, True, 1, 1, None, "auto"),
    (4, False, 1, 1, None, "auto"),
    (2, True, 2, 1, None, "auto"),
    (2, True, 1, 2, None, "auto"),
    # replicated CP: each rank holds every page and moves every page as a CP1 rank does
    # (the write policies' CP1 tests cover it); the sharded cases below take each policy
    (2, False, 1, 1, "write_through", "auto"),
    # sharded CP: each rank backs up and loads its own pages, in its own host rows
    (2, True, 1, 1, "write_through_selective", "auto"),
    (4, True, 1, 1, "write_back", "auto"),
    (4, True, 1, 1, "write_through", "auto"),
]


@pytest.mark.parametrize(("cp", "sharded", "tp", "pp", "host", "transport"), CASES)
def test_cp_engine_equals_cp1(
    tmp_path: Path,
    cp: int,
    sharded: bool,
    tp: int,
    pp: int,
    host: WritePolicy | None,
    transport: str,
) -> None:
    """With the checker on, the stage also compares the tokens its ranks sampled: a
    replicated CP rank's own KV shows in no output of rank 0's."""
    want = reference(tp, host, gather=sharded)
    cfg = config(cp, sharded, tp, pp, host, transport=transport)
    got, rows, owners = run_world(cfg, workload, make_prompts(), env=checker_env(tmp_path))

    hits = {phase: 0 for phase, *_ in want}
    host_hits = 0
    for (phase, w_out, w_dev, w_host, w_logits), (g_phase, out, dev, host_hit, logits) in zip(
        want, got, strict=True
    ):
        assert phase == g_phase
        assert out == w_out, f"{phase}: tokens differ from CP1"
        assert (dev, host_hit) == (w_dev, w_host), f"{phase}: cached tokens per tier differ"
        assert logits.shape == w_logits.shape == (GREEDY.max_new_tokens, 260)
        assert not logits.isnan().any(), f"{phase}: a row no rank wrote was read"
        assert torch.equal(logits, w_logits), f"{phase}: logits are not bit-identical to CP1"
        hits[phase] += dev + host_hit
        host_hits += host_hit
    assert hits["cold"] == 0 and hits["flushed"] == 0
    assert hits["device"] > 0 and hits["turn2"] > 0
    assert hits.get("evicted", 0) == 0
    assert host is None or host_hits > 0  # served from the host tier after the eviction
    assert len({tuple(out) for _, out, *_ in want}) > 4  # varied outputs
    # rank 0's pool: 1/N of the logical pages plus a trash page when sharded, else all
    assert rows == ((-(-NUM_PAGES // cp) + 1) * PAGE if sharded else NUM_PAGES * PAGE)
    assert owners == set(range(cp))  # the tree held pages of every rank


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    flags.add_engine_args(parser)
    return parser.parse_args(list(argv))


def test_cp_flags_and_refusals() -> None:
    config_ = engine_config_from_args(_args("--cp-size", "4", "--enable-kv-cache-sharding"))
    assert config_.parallel == ParallelConfig(1, 1, 4, True)
    assert config_.parallel.world_size == 4
    assert flags.engine_argv(_args("--cp-size", "2", "--enable-kv-cache-sharding")) == [
        "--cp-size",
        "2",
        "--enable-kv-cache-sharding",
    ]
    assert engine_config_from_args(_args("--context-parallel-size", "2")).parallel.cp_size == 2
    for bad in ("0", "-2"):
        with pytest.raises(ValueError, match="--cp-size must be a positive integer"):
            engine_config_from_args(_args("--cp-size", bad))
    with pytest.raises(SystemExit):  # argparse: not an integer
        _args("--cp-size", "two")
    with pytest.raises(ValueError, match="needs --cp-size 2 or more"):
        engine_config_from_args(_args("--enable-kv-cache-sharding"))
    sharded = ("--cp-size", "2", "--enable-kv-cache-sharding")
    host = engine_config_from_args(_args(*sharded, "--enable-hierarchical-cache"))
    assert host.cache.enable_hierarchical_cache and host.parallel.kv_sharding
    storage = ("--enable-hierarchical-cache", "--hicache-storage-backend", "file")
    with_l3 = engine_config_from_args(_args(*sharded, *storage))  # tests/test_cp_storage.py
    assert with_l3.cache.hicache_storage_backend == "file" and with_l3.parallel.kv_sharding
    assert engine_config_from_args(_args("--cp-size", "2", *storage)).parallel.cp_size == 2
    sharded_pd = engine_config_from_args(_args(*sharded, "--disaggregation-mode", "prefill"))
    assert sharded_pd.parallel.kv_sharding  # sharded CP serves P/D too (test_cp_pd.py)
    pd = engine_config_from_args(_args("--cp-size", "2", "--disaggregation-mode", "decode"))
    assert pd.parallel == ParallelConfig(cp_size=2)  # replicated CP serves P/D
    # replicated CP keeps the host tier
    replicated = engine_config_from_args(_args("--cp-size", "2", "--enable-hierarchical-cache"))
    assert replicated.cache.enable_hierarchical_cache and not replicated.parallel.kv_sharding
    with pytest.raises(ValueError, match="needs --cp-size 2"):
        dataclasses.replace(replicated.parallel, kv_sharding=True, cp_size=1)
    # `up` buckets take cp= like tp= and pp=
    assert parse_bucket("long:tp=2,cp=2,engines=1") == LaunchBucket("long", 2, None, 2, None, 1)
    with pytest.raises(ValueError, match="cp must be a positive integer"):
        parse_bucket("long:cp=0")


# ---------------------------------------------------------------- agreement across CP

NUM_STRESS = 200


def stress_config(disable: str = "none", sharded: bool = False) -> EngineConfig:
    """CP2 with a host tier and per-rank transfer delays: the ranks see different ACKs
    ready at the same logical point, and only the agreement over the stage's TP x CP ranks
    (TP is 1 here: no TP group at all) keeps their trees alike. Sharded, each rank's copies
    move only its own pages (a rank may own none of a backup's), under the same ACKs."""
    base = test_multirank_consensus.stress_config(disable)
    cache = dataclasses.replace(base.cache, num_device_pages=96)
    debug = dataclasses.replace(base.debug, gather_reads=sharded, poison_kv=sharded)
    parallel = ParallelConfig(cp_size=2, kv_sharding=sharded)
    return dataclasses.replace(base, model="tiny", cache=cache, parallel=parallel, debug=debug)


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "sharded"])
def test_cp_ranks_agree_on_acks_under_delays(tmp_path: Path, sharded: bool) -> None:
    reqs = test_multirank_consensus.make_requests(num_requests=NUM_STRESS)
    config = stress_config(sharded=sharded)
    got = run_world(config, stress, reqs, env=checker_env(tmp_path))
    assert got["divergence"] is None
    assert isinstance(got["checked"], int) and got["checked"] > 4 * NUM_STRESS
    assert isinstance(got["host_hits"], int) and got["host_hits"] > 0  # ACKs were consumed
    single = Engine(dataclasses.replace(config, parallel=ParallelConfig()))
    try:
        assert got["outputs"] == stress(single, reqs)["outputs"]
    finally:
        single.close()
    assert sorted(load_logs(tmp_path)) == ["rank0 PP0/CP0/TP0", "rank1 PP0/CP1/TP0"]


def test_checker_reports_cp_ranks_that_consume_their_own_counts(tmp_path: Path) -> None:
    """The same world with the stage MIN switched off (`tp_min`): each CP rank consumes its
    own ready count, and the checker names the ACK count consumed."""
    reqs = test_multirank_consensus.make_requests(num_requests=NUM_STRESS)
    with pytest.raises(WorldFailed) as failed:
        run_world(stress_config("tp_min"), stress, reqs, env=checker_env(tmp_path))
    text = str(failed.value)
    assert "RankDivergenceError" in text and "the parameters differ" in text
    assert "Scheduler.consume_acks" in text.split("Found rank divergence")[-1].splitlines()[1]


def test_compose_engines_take_cp_size_from_the_environment() -> None:
    """CP_SIZE sets the colocated, P/D and NATS-cluster compose engines' --cp-size (1 when
    unset); the buckets file's engines have their own layouts and none."""
    for path in test_compose.COMPOSE_FILES:
        for name, svc in test_compose.services(path).items():
            cmd = svc.get("command", [])
            if cmd[:3] != ["python", "-m", "services.engine"]:
                continue
            if path.name in (
                "docker-compose.yml",
                "docker-compose.pd.yml",
                "docker-compose.nats-cluster.yml",
            ):
                assert cmd[cmd.index("--cp-size") + 1] == "${CP_SIZE:-1}", name
            else:
                assert "--cp-size" not in cmd, (path.name, name)


# ---------------------------------------------------------------- replicated CP and L3


def write_then_read(engine: Engine, prompts: list[list[int]]) -> dict[str, object]:
    """Compute `prompts` (written through to the store), flush, serve them from the store."""
    first = [o.output_ids for o in engine.run([engine.submit(p, GREEDY) for p in prompts])]
    engine.drain()
    assert engine.flush_cache()
    outs = engine.run([engine.submit(p, GREEDY) for p in prompts])
    engine.drain()
    engine.check_integrity()
    return {
        "first": first,
        "outputs": [o.output_ids for o in outs],
        "storage": sum(o.cached.storage for o in outs),
        "objects": engine.cache_stats()["storage_objects"],
    }


def storage_config(directory: Path, cp: int, scheme: str) -> EngineConfig:
    cache = CacheConfig(
        page_size=PAGE,
        num_device_pages=NUM_PAGES,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(directory),
        hicache_storage_key_scheme=scheme,  # type: ignore[arg-type]
        storage_batch_pages=2,
    )
    return EngineConfig(model="tiny", cache=cache, parallel=ParallelConfig(cp_size=cp))


@pytest.mark.parametrize("scheme", ["rank-suffix", "unified"])
def test_replicated_cp_shares_the_store_with_cp1(tmp_path: Path, scheme: str) -> None:
    """Replicated CP2 writes each object once (CP rank 0; as many objects as CP1 writes),
    serves the prompts back from the store like CP1, and a CP1 engine reads what it wrote."""
    prompts = make_prompts()[:4]
    got = run_world(storage_config(tmp_path / "cp2", 2, scheme), write_then_read, prompts)
    cp1 = Engine(storage_config(tmp_path / "cp1", 1, scheme))
    try:
        want = write_then_read(cp1, prompts)
    finally:
        cp1.close()
    assert got["first"] == want["first"] == got["outputs"] == want["outputs"]
    assert got["storage"] == want["storage"] and isinstance(want["storage"], int)
    assert want["storage"] > 0 and got["objects"] == want["objects"]
    reader = Engine(storage_config(tmp_path / "cp2", 1, scheme))  # CP2's store
    try:
        assert reader.flush_cache()
        outs = reader.run([reader.submit(p, GREEDY) for p in prompts])
        assert [o.output_ids for o in outs] == want["outputs"]
        assert sum(o.cached.storage for o in outs) == want["storage"]
    finally:
        reader.close()
