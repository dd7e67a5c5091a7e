"""L3 under host pressure (issue 19, defect 3): a full host pool is no reason to lose a hit.

The host pool here holds 40 pages and every request's stored prefix 15, so a few queued
requests' reads and the pages just written fill it. Two things kept prefetches from the room
that eviction could have made: the pages read for a request still waiting for device room
were held outside the tree (uncounted), or attached unpinned and then evicted by the next
request's read; and a write to the store pinned its pages until the store took them. Each
test fills the host pool with cache (40 of 40 pages) first; every stored request must then
read its whole hit from the store, and give the cold run's tokens and logits. The fall-back
to a shorter prefix when pins leave too little room is test_storage_grant_fallback.py's.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from test_engine_oracle import Cold, assert_matches_cold

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.scheduler.request import CachedTokens
from gpu_worker.scheduler.scheduler import SchedulerConfig
from gpu_worker.storage import FileBackend, base

PAGE = 4
DEVICE_PAGES = 32
HOST_PAGES = 40  # the prefetch budget is half of it: 20 pages
SP = SamplingParams(max_new_tokens=4, ignore_eos=True)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


STORED = [tokens(i, 61) for i in range(3)]  # 15 whole pages before the last token each
HIT = 60
FILLERS = [tokens(100 + i, 40) for i in range(6)]  # 10 pages each: 60 > the host's 40
BLOCKER = tokens(99, 40)  # runs 60 steps on 25 of the 32 device pages


def config(directory: Path, backend: str = "file", **cache: object) -> EngineConfig:
    kw: dict[str, object] = dict(
        page_size=PAGE,
        num_device_pages=DEVICE_PAGES,
        enable_hierarchical_cache=True,
        hicache_ratio=HOST_PAGES / DEVICE_PAGES,
        hicache_storage_backend=backend,
        hicache_storage_dir=str(directory),
        hicache_storage_prefetch_policy="wait_complete",
        storage_batch_pages=4,
    )
    kw.update(cache)
    return EngineConfig(
        model="tiny",
        cache=CacheConfig(**kw),  # type: ignore[arg-type]
        scheduler=SchedulerConfig(max_running_requests=8),
        batch_invariant=True,  # logits are compared bit for bit with the cold run
    )


@pytest.fixture(scope="module")
def cold() -> list[Cold]:
    eng = Engine(
        EngineConfig(
            model="tiny",
            cache=CacheConfig(page_size=PAGE, enable_radix_cache=False),
            batch_invariant=True,
        )
    )
    reqs = [eng.submit(p, SP) for p in STORED]
    for r in reqs:
        r.logits_trace = []
    eng.run(reqs)
    eng.close()
    return [Cold(r.output().output_ids, _stack(r.logits_trace)) for r in reqs]


def write_stored(directory: Path) -> None:
    """Another engine computed the stored prompts: the store holds their pages."""
    eng = Engine(config(directory, hicache_ratio=4.0))
    eng.run([eng.submit(p, SP) for p in STORED])
    eng.drain()
    eng.close()


def fill_host(eng: Engine) -> None:
    """Unrelated prompts, one by one, until the host pool is full of their pages."""
    for p in FILLERS:
        eng.run([eng.submit(p, SP)])


def test_queued_requests_read_their_whole_hit_from_a_full_host_pool(
    tmp_path: Path, cold: list[Cold]
) -> None:
    """Three stored requests queue behind one that holds the device: their reads need 45
    pages, more than the budget (20) and than the host pool can give them while the first
    one waits. Each must still get all 15 pages from the store: the later ones wait for
    room, the first one's pages stay its own until it is admitted."""
    write_stored(tmp_path)
    eng = Engine(config(tmp_path))
    fill_host(eng)
    eng.drain()
    host = eng.cache.host_pool
    assert host is not None and host.num_pages == HOST_PAGES
    assert host.allocator.num_free == 0  # full of cache ...
    assert all(n.host_ref == 0 for n in eng.cache.tree.iter_nodes())  # ... none of it pinned
    blocker = eng.submit(BLOCKER, SamplingParams(max_new_tokens=60, ignore_eos=True))
    reqs = [eng.submit(p, SP) for p in STORED]
    for r in reqs:
        r.logits_trace = []
    eng.run([blocker, *reqs])
    for req, want in zip(reqs, cold, strict=True):
        out = req.output()
        assert out.cached == CachedTokens(device=0, host=0, storage=HIT), out.cached
        assert_matches_cold(out, _stack(req.logits_trace), want)
    eng.drain()
    eng.cache.check_integrity()
    storage = eng.cache.storage
    assert storage is not None and storage.held_pages == 0 and not storage.prefetches
    assert eng.cache.stats.storage_reads_short == 0
    eng.close()


class GatedPuts(FileBackend):
    """A slow store: every put waits for `gate` (reads and queries go through)."""

    gate = threading.Event()

    def put(self, keys: Sequence[str], data: Sequence[bytes | memoryview]) -> int:
        assert GatedPuts.gate.wait(60), "the test never opened the gate"
        return super().put(keys, data)


@pytest.fixture
def gated_puts(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[GatedPuts]]:
    GatedPuts.gate = threading.Event()
    monkeypatch.setitem(base.BACKENDS, "gated-puts", lambda c: GatedPuts(c))
    yield GatedPuts
    GatedPuts.gate.set()


def test_writes_to_a_slow_store_leave_the_host_pool_evictable(
    tmp_path: Path, cold: list[Cold], gated_puts: type[GatedPuts]
) -> None:
    """The store takes none of this engine's writes yet: the pages it wrote are copied out
    for the store and may be evicted meanwhile, so a stored request still finds room for
    its whole hit."""
    write_stored(tmp_path)
    eng = Engine(config(tmp_path, backend="gated-puts"))
    fill_host(eng)
    assert eng.cache.tree.num_host_pages >= HOST_PAGES - 10  # the fillers' last pages
    req = eng.submit(STORED[0], SP)
    req.logits_trace = []
    eng.run([req])
    out = req.output()
    assert out.cached == CachedTokens(device=0, host=0, storage=HIT), out.cached
    assert_matches_cold(out, _stack(req.logits_trace), cold[0])
    gated_puts.gate.set()
    eng.drain()  # now every write reaches the store
    eng.cache.check_integrity()
    assert eng.cache.stats.storage_pages_written >= len(FILLERS) * 10
    eng.close()


def _stack(trace: list[torch.Tensor] | None) -> torch.Tensor:
    return torch.stack(trace or [])
