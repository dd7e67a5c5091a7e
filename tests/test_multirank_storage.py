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


def config(directory: Path, **cache: object) -> EngineConfig:
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
        parallel=ParallelConfig(2, 2),  # type: ignore[arg-type]
    )


def write_then_read(engine: Engine, reqs: list[list[int]]) -> dict[str, object]:
    """Compute `reqs` (written through), flush, then serve them from the store."""
    first = [o.output_ids for o in engine.run([engine.submit(p, GREEDY) for p in reqs])]
    engine.drain()
    assert engine.flush_cache()
    outs = engine.run([engine.submit(p, GREEDY) for p in reqs])
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


def test_slow_reads_and_cut_prefetches_agree_on_every_rank(tmp_path: Path) -> None:
    reqs = prompts()
    faults = StorageFaults(read_delay_ms=30.0, query_delay_ms=10.0, seed=4)
    timeout = PrefetchTimeout(base_s=0.02, per_ki_token_s=0.0)  # cuts some reads short
    cfg = config(tmp_path, storage_faults=faults, prefetch_timeout=timeout)
    env = {"HICACHE_RANK_CONSENSUS": "1", "HICACHE_RANK_CONSENSUS_DIR": str(tmp_path / "log")}
    got = run_world(cfg, write_then_read, reqs, env=env)
    want = tp1_outputs(reqs)
    assert got["first"] == want and got["outputs"] == want
    assert got["divergence"] is None and isinstance(got["checked"], int) and got["checked"] > 0
    storage = got["storage"]
    assert isinstance(storage, list) and all(s % PAGE == 0 for s in storage)


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
