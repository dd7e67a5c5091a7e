"""External storage under TP x PP (issue 9, acceptance 2): every rank takes the same prefix.

A TP2 x PP2 engine writes its prompts through to a `file` store (each rank its own shard of
each page), flushes device and host, and serves the prompts again from the store, with the
rank consensus checker on and reads and hit queries that are slow by a random amount that
differs per rank and per call. With the `timeout` policy some prefetches are cut before
they finish, at points only rank 0's clock decides: every rank must still attach the same
pages, the checker must stay clean, and the outputs must equal a TP1 engine's.

Then one rank's reads fail from the 5th page of every read on: the agreed completed length
shrinks to 5 pages on every rank (the request is served 5 pages from storage, the rest
computed), and the outputs still equal TP1's.
"""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path

import pytest
from multirank import WorldFailed, run_world

from bus_schemas.page_hash import chain_hashes, root_hash
from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.cache.storage_io import StorageFaults
from gpu_worker.cache.storage_tier import PrefetchTimeout
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.parallel.config import ParallelConfig

pytestmark = pytest.mark.timeout(400)

PAGE = 4
GREEDY = SamplingParams(max_new_tokens=3, ignore_eos=True)


def prompts(seed: int = 3, shared_len: int = 24) -> list[list[int]]:
    """8 prompts of 33-54 tokens sharing their first `shared_len`."""
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(shared_len)]
    return [
        shared + [rng.randrange(256) for _ in range(rng.randint(33, 54) - shared_len)]
        for _ in range(8)
    ]


def config(directory: Path, parallel: tuple[int, int] = (2, 2), **cache: object) -> EngineConfig:
    kw: dict[str, object] = dict(
        page_size=PAGE,
        num_device_pages=128,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(directory),
        storage_batch_pages=2,
    )
    kw.update(cache)
    return EngineConfig(
        model="tiny-tp",
        cache=CacheConfig(**kw),
        parallel=ParallelConfig(*parallel),
    )


def write_then_read(engine: Engine, reqs: list[list[int]], rounds: int = 1) -> dict[str, object]:
    """Compute `reqs` (written through), then `rounds` times: flush, serve them from the
    store (the rounds' outputs and hits one after the other)."""
    first = [o.output_ids for o in engine.run([engine.submit(p, GREEDY) for p in reqs])]
    outs = []
    for _ in range(rounds):
        engine.drain()
        assert engine.flush_cache()
        outs += engine.run([engine.submit(p, GREEDY) for p in reqs])
    result: dict[str, object] = {
        "first": first,
        "outputs": [o.output_ids for o in outs],
        "storage": [o.cached.storage for o in outs],
        "host": [o.cached.host for o in outs],
    }
    if engine.consensus is not None:
        deadline = time.monotonic() + 30
        while engine.consensus.checked < len(engine.consensus.records):
            assert time.monotonic() < deadline, "the checker fell behind"
            time.sleep(0.05)
        result["divergence"] = engine.consensus.divergence
        result["checked"] = engine.consensus.checked
    engine.drain()
    engine.cache.check_integrity()
    return result


def tp1_outputs(reqs: list[list[int]]) -> list[list[int]]:
    eng = Engine(EngineConfig(model="tiny-tp", cache=CacheConfig(page_size=PAGE)))
    out = [eng.generate(p, GREEDY).output_ids for p in reqs]
    eng.close()
    return out


ROUNDS = 4  # flushes and reads of the cut-prefetch test


def test_slow_reads_and_cut_prefetches_agree_on_every_rank(tmp_path: Path) -> None:
    """Reads of 2 pages a batch, each batch 0-60 ms late on each rank (the slowest decides),
    against a deadline of 0.1 s from the read's start: reads are cut partway, at a point
    only rank 0's clock decides. A rank that judged the deadline by its own clock would
    attach another number of pages than its peers: the checker would object. The ranks'
    clocks differ by little at one step, so a deadline falls between them now and then:
    `ROUNDS` flushes and reads give it many chances (one round caught a rank's own clock
    in about 6 runs of 10)."""
    reqs = prompts(shared_len=0)  # each read from the store for itself: 8-13 pages
    faults = StorageFaults(read_delay_ms=60.0, query_delay_ms=10.0, seed=4)
    timeout = PrefetchTimeout(base_s=0.1, per_ki_token_s=0.0)
    cfg = config(tmp_path, storage_faults=faults, prefetch_timeout=timeout)
    env = {"HICACHE_RANK_CONSENSUS": "1", "HICACHE_RANK_CONSENSUS_DIR": str(tmp_path / "log")}
    got = run_world(cfg, write_then_read, reqs, ROUNDS, env=env)
    want = tp1_outputs(reqs)
    assert got["first"] == want and got["outputs"] == want * ROUNDS
    assert got["divergence"] is None and isinstance(got["checked"], int) and got["checked"] > 0
    storage = got["storage"]
    assert isinstance(storage, list) and all(s % PAGE == 0 for s in storage)
    full = [(len(p) - 1) // PAGE * PAGE for p in reqs] * ROUNDS
    assert any(0 < s < f for s, f in zip(storage, full, strict=True)), (storage, full)


def test_a_failing_read_on_one_rank_shrinks_the_hit_on_every_rank(tmp_path: Path) -> None:
    reqs = prompts(shared_len=0)[:3]  # each read from the store for itself
    faults = StorageFaults(fail_rank=3, fail_at_page=5)
    cfg = config(tmp_path, storage_faults=faults, hicache_storage_prefetch_policy="wait_complete")
    env = {"HICACHE_RANK_CONSENSUS": "1", "HICACHE_RANK_CONSENSUS_DIR": str(tmp_path / "log")}
    got = run_world(cfg, write_then_read, reqs, env=env)
    assert got["outputs"] == tp1_outputs(reqs)
    assert got["divergence"] is None
    # rank 3 (PP1/TP1) reads 5 pages of each prompt, the others all: every rank takes 5
    assert got["storage"] == [5 * PAGE] * len(reqs)
    # the same without the failure: the whole stored prefix
    whole = run_world(
        dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, storage_faults=None)),
        write_then_read,
        reqs,
    )
    assert whole["storage"] == [(len(p) - 1) // PAGE * PAGE for p in reqs]


def test_the_checker_objects_when_ranks_keep_their_own_counts(tmp_path: Path) -> None:
    """The test hook `disable_min`: each rank attaches what it read itself; the rank 3's
    shorter read must show as a divergence (this is what the MIN prevents)."""
    faults = StorageFaults(fail_rank=3, fail_at_page=5, disable_min=True)
    cfg = config(tmp_path, storage_faults=faults, hicache_storage_prefetch_policy="wait_complete")
    env = {"HICACHE_RANK_CONSENSUS": "1", "HICACHE_RANK_CONSENSUS_DIR": str(tmp_path / "log")}
    with pytest.raises(WorldFailed) as failed:
        run_world(cfg, write_then_read, prompts(shared_len=0)[:3], env=env)
    text = str(failed.value)
    assert "Found rank divergence at entry" in text
    assert "StorageTier.finish" in text.split("Found rank divergence")[-1], text[-2000:]


# ---------------------------------------------------------------- faults of one rank


def write_and_report(engine: Engine, reqs: list[list[int]]) -> dict[str, object]:
    """Compute `reqs` (written through), wait for the store, and return the storage KV
    events rank 0 would send."""
    engine.run([engine.submit(p, GREEDY) for p in reqs])
    engine.drain()
    events = [e.page_hashes for e in engine.cache.drain_events() if e.tier == "storage"]
    return {"events": events}


def objects(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*/*") if not p.name.startswith("."))


def test_a_write_one_rank_could_not_store_is_not_advertised(tmp_path: Path) -> None:
    """Rank 1's store takes none of its writes: rank 0 holds its half of every page, rank 1
    none, so no page is whole in the store and no storage KV event may name one (the index
    would send requests after pages no engine of this layout can read). Without the fault
    the events name every page written."""
    reqs = prompts(shared_len=0)[:2]
    cfg = config(tmp_path, (2, 1), storage_faults=StorageFaults(fail_write_rank=1))
    got = run_world(cfg, write_and_report, reqs)
    stored = objects(tmp_path)
    assert stored and all(name.endswith("_tp0of2pp0of1") for name in stored)
    assert got["events"] == []
    whole = run_world(config(tmp_path / "ok", (2, 1)), write_and_report, reqs)
    events = whole["events"]
    assert isinstance(events, list)
    pages = {name.split("_")[0] for name in objects(tmp_path / "ok")}
    assert {h for hashes in events for h in hashes} == pages


def serve_twice(engine: Engine, reqs: list[list[int]]) -> dict[str, object]:
    """Serve `reqs` (from the store, in a fresh world), then report like `write_then_read`'s
    second half."""
    outs = engine.run([engine.submit(p, GREEDY) for p in reqs])
    result: dict[str, object] = {
        "outputs": [o.output_ids for o in outs],
        "storage": [o.cached.storage for o in outs],
    }
    if engine.consensus is not None:
        deadline = time.monotonic() + 30
        while engine.consensus.checked < len(engine.consensus.records):
            assert time.monotonic() < deadline, "the checker fell behind"
            time.sleep(0.05)
        result["divergence"] = engine.consensus.divergence
    engine.drain()
    engine.cache.check_integrity()
    return result


def test_a_corrupt_object_on_one_rank_shortens_the_hit_on_every_rank(tmp_path: Path) -> None:
    """A TP2 world stored three prompts, each rank its half of every page. One byte of TP
    rank 1's object of page 5 of the first prompt flips on disk: a fresh world reads pages
    0-4 of that prompt on both ranks (rank 0's page 5 is fine, but the agreed count stops
    where rank 1's did), the rest whole; outputs are a TP1 engine's, the checker is silent,
    and the object is quarantined, never read again."""
    reqs = prompts(shared_len=0)[:3]
    cfg = config(tmp_path, (2, 1), hicache_storage_prefetch_policy="wait_complete")
    run_world(cfg, write_and_report, reqs)
    eng = Engine(EngineConfig(model="tiny-tp", cache=CacheConfig(page_size=PAGE)))
    namespace = eng.namespace
    eng.close()
    page5 = chain_hashes(root_hash(namespace, ""), reqs[0][: 6 * PAGE], PAGE)[5].hex()
    path = tmp_path / page5[:2] / f"{page5}_tp1of2pp0of1"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    env = {"HICACHE_RANK_CONSENSUS": "1", "HICACHE_RANK_CONSENSUS_DIR": str(tmp_path / "log")}
    got = run_world(cfg, serve_twice, reqs, env=env)
    assert got["outputs"] == tp1_outputs(reqs)
    assert got["divergence"] is None
    assert got["storage"] == [5 * PAGE] + [(len(p) - 1) // PAGE * PAGE for p in reqs[1:]]
    quarantined = [p.name for p in (tmp_path / ".quarantine").iterdir()]
    assert quarantined == [f"{page5}_tp1of2pp0of1.corrupt"]
    assert (tmp_path / page5[:2] / f"{page5}_tp0of2pp0of1").exists()  # rank 0's half stays
