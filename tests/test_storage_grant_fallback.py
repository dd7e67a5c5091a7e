"""L3 under host pressure (issue 19, defect 3): the fall-back to a shorter prefix.

A storage prefetch that cannot get host room for its whole hit waits for pins to clear at
most `GRANT_PATIENCE` grant attempts in a row that free nothing, then reads the shorter
page-aligned prefix it was granted. Every rank must fall back at the same step and to the
same length: the attempts are counted on replicated state, never on a rank's own view.

The case, in a TP2 world (gloo, the rank consensus checker on):
- the store holds the pages of A = S + 2 pages and P = S + 10 pages (+ one token each);
- the host pool (24 pages, a prefetch budget of 12) holds S's 14 pages, the device none;
- a blocker (S's first 8 pages + 3 tokens) is loaded from the host and then holds the
  device for 85 steps, so A and P wait for admission behind it. Each copy between the tiers
  sleeps a random time that differs per rank (`DelayInjection`, up to 0.3 s), so while the
  blocker's load runs, one rank sees its copy done steps before the other does; storage
  reads and hit queries are slow by a random amount per rank too;
- A's and P's prefetches pin S on the host from their start; A reads its 2 pages and keeps
  them while it waits. P's budget allows its whole hit (10 <= 12 - 2), but the pool has
  only 24 - 14 - 2 = 8 pages it can free: P takes them, then gets nothing for
  GRANT_PATIENCE attempts (A's pages clear only once the blocker ends), and reads those 8.
P must be served 8 pages from the store (of the 10 it hit), its output equal to a cold
run's, bit for bit in float64, and the checker must find no divergence: a rank that counted
its attempts from its own view (say, only while no copy of its own runs) would start P's
read at another step than its peer, which the checker reports.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch
from multirank import run_world

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.cache.storage_io import StorageFaults
from gpu_worker.cache.storage_tier import GRANT_PATIENCE
from gpu_worker.cache.transfer import DelayInjection
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.scheduler.request import GenerateOutput
from gpu_worker.scheduler.scheduler import SchedulerConfig

pytestmark = pytest.mark.timeout(300)

PAGE = 4
DEVICE_PAGES = 32
HOST_PAGES = 24  # the prefetch budget is half of it: 12 pages
SP = SamplingParams(max_new_tokens=4, ignore_eos=True)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


S_PAGES, A_PAGES, P_PAGES = 14, 2, 10
S = tokens(1, S_PAGES * PAGE)  # on the host, pinned by A's and P's prefetches
A = S + tokens(2, A_PAGES * PAGE + 1)  # its 2 stored pages are read first, and kept
P = S + tokens(3, P_PAGES * PAGE + 1)  # 10 stored pages; room for 8
ROOM = HOST_PAGES - S_PAGES - A_PAGES  # the pages P can get: 8
# S's first 8 pages, loaded from the host, + 3 tokens + 85 generated: 30 of 32 device pages
BLOCKER = S[: 8 * PAGE] + tokens(4, 3)
BLOCKER_SP = SamplingParams(max_new_tokens=85, ignore_eos=True)


def config(directory: Path) -> EngineConfig:
    return EngineConfig(
        model="tiny",
        cache=CacheConfig(
            page_size=PAGE,
            num_device_pages=DEVICE_PAGES,
            enable_hierarchical_cache=True,
            hicache_ratio=HOST_PAGES / DEVICE_PAGES,
            hicache_storage_backend="file",
            hicache_storage_dir=str(directory),
            hicache_storage_prefetch_policy="wait_complete",
            storage_batch_pages=1,
            storage_faults=StorageFaults(read_delay_ms=20.0, query_delay_ms=20.0, seed=7),
            # each rank's copies sleep their own random time: ranks see them done apart
            transfer_delay=DelayInjection(max_ms=300.0, seed=1),
        ),
        scheduler=SchedulerConfig(max_running_requests=8),
        parallel=ParallelConfig(2, 1),
        batch_invariant=True,  # logits are compared bit for bit with the cold run
    )


def _traced(engine: Engine, prompt: list[int], salt: str) -> tuple[GenerateOutput, torch.Tensor]:
    req = engine.submit(prompt, SP, cache_salt=salt)
    req.logits_trace = []
    out = engine.run([req])[0]
    return out, torch.stack(req.logits_trace)


def fall_back(engine: Engine) -> dict[str, object]:
    """The case of the module doc, on rank 0 of the world; what it saw, and a cold run."""
    cache = engine.cache
    host = cache.host_pool
    assert host is not None and host.num_pages == HOST_PAGES
    # The store gets A's and P's pages (written through; a drain after each, so A's write no
    # longer pins its pages when P's are backed up), then only S goes back to the host.
    for prompt in (A, P):
        engine.run([engine.submit(prompt, SP)])
        engine.drain()
    assert engine.flush_cache()
    engine.run([engine.submit([*S, 7], SP)])
    engine.drain()
    engine.evict_device(DEVICE_PAGES)  # S stays on the host only
    assert cache.tree.host_prefix(S).host_len == len(S), "S is on the host"  # (reads only)
    assert cache.tree.num_device_pages == 0
    assert all(n.host_ref == 0 for n in cache.tree.iter_nodes())

    blocker = engine.submit(BLOCKER, BLOCKER_SP)
    ra, rp = engine.submit(A, SP), engine.submit(P, SP)
    rp.logits_trace = []
    outs = engine.run([blocker, ra, rp])
    pf = rp.prefetch
    assert pf is not None
    result: dict[str, object] = {
        "cached": [o.cached for o in outs],
        "output": outs[2].output_ids,
        "logits": torch.stack(rp.logits_trace),
        "hit_pages": pf.hit_pages,
        "read_pages": len(pf.host_page_ids),
        "stalled_grants": pf.stalled_grants,
        "reads_short": cache.stats.storage_reads_short,
    }
    # the cold run: the same world, a salt no cached page carries
    cold, cold_logits = _traced(engine, P, salt="cold")
    result["cold"] = (cold.cached, cold.output_ids, cold_logits)
    if engine.consensus is not None:
        deadline = time.monotonic() + 30
        while engine.consensus.checked < len(engine.consensus.records):
            assert time.monotonic() < deadline, "the checker fell behind"
            time.sleep(0.05)
        result["divergence"] = engine.consensus.divergence
        result["checked"] = engine.consensus.checked
    engine.drain()
    cache.check_integrity()
    storage = cache.storage
    assert storage is not None and storage.held_pages == 0 and not storage.prefetches
    return result


def test_a_prefetch_without_room_falls_back_to_the_same_shorter_prefix_on_every_rank(
    tmp_path: Path,
) -> None:
    env = {"HICACHE_RANK_CONSENSUS": "1", "HICACHE_RANK_CONSENSUS_DIR": str(tmp_path / "log")}
    got = run_world(config(tmp_path / "store"), fall_back, env=env, timeout_s=180)
    assert got["divergence"] is None
    assert isinstance(got["checked"], int) and got["checked"] > 0
    cached_blocker, cached_a, cached_p = got["cached"]
    assert cached_blocker.host == 8 * PAGE  # its load was the copy in flight
    assert cached_a.storage == A_PAGES * PAGE  # A read its whole hit
    # P hit all 10 stored pages and took the 8 page-aligned ones it had room for
    assert got["hit_pages"] == P_PAGES
    storage = cached_p.storage
    assert storage % PAGE == 0 and 0 < storage < P_PAGES * PAGE, cached_p
    assert storage == ROOM * PAGE, cached_p
    assert cached_p.device + cached_p.host == len(S)
    assert got["read_pages"] == ROOM and got["reads_short"] == 1
    # ... after GRANT_PATIENCE attempts in a row that freed nothing
    assert got["stalled_grants"] == GRANT_PATIENCE
    cold_cached, cold_output, cold_logits = got["cold"]
    assert cold_cached.device == cold_cached.host == cold_cached.storage == 0
    assert got["output"] == cold_output
    logits = got["logits"]
    assert isinstance(logits, torch.Tensor) and logits.dtype == torch.float64
    assert torch.equal(logits, cold_logits), (logits - cold_logits).abs().max()
    # and a TP1 engine with no cache at all gives the same tokens, the logits within 1e-10
    # (TP sums the halves of a row-parallel layer in another order)
    eng = Engine(
        EngineConfig(
            model="tiny",
            cache=CacheConfig(page_size=PAGE, enable_radix_cache=False),
            batch_invariant=True,
        )
    )
    tp1, tp1_logits = _traced(eng, P, salt="")
    eng.close()
    assert tp1.output_ids == got["output"]
    assert torch.allclose(logits, tp1_logits, rtol=0.0, atol=1e-10)
