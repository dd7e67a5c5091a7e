"""Ordered ACKs (DESIGN.md section 3, invariant 3).

Copies may finish in any order; bookkeeping changes only when ACKs are consumed, strictly in
submission order; and no attention reads a page whose load ACK was not consumed.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from gpu_worker.cache.hicache import CacheConfig, PrefixCache
from gpu_worker.cache.stats import RECENT_ACKS
from gpu_worker.cache.transfer import (
    COMPLETION_LOG_LEN,
    DelayInjection,
    TransferEngine,
    TransferKind,
)
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.kernels.page_transfer import PageView
from gpu_worker.memory.allocator import PageId
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.scheduler.admission import Admission
from gpu_worker.scheduler.request import Req, ReqState

CPU = torch.device("cpu")
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, dtype=torch.float64)


def pools(num_pages: int = 16) -> tuple[PageView, PageView, torch.Tensor, torch.Tensor]:
    src = torch.randn(2, 2, num_pages * 4, 2, 4, dtype=torch.float64)
    dst = torch.zeros(num_pages, 2, 2, 4, 2, 4, dtype=torch.float64)
    return PageView.layer_first(src, 4), PageView.page_first(dst), src, dst


def test_out_of_order_completion_is_consumed_in_order() -> None:
    engine = TransferEngine(CPU, num_workers=4, delay=DelayInjection(max_ms=30, seed=3))
    src, dst, _, _ = pools()
    for i in range(12):
        engine.submit(TransferKind.BACKUP, [(src, dst)], [i], [i], op=i)
    consumed: list[int] = []
    deadline = time.monotonic() + 10
    while len(consumed) < 12 and time.monotonic() < deadline:
        ready = engine.num_ready()
        with engine._lock:
            finished = set(engine.completion_log)
        # num_ready is exactly the finished prefix of what is still queued
        prefix = 0
        while len(consumed) + prefix < 12 and len(consumed) + prefix in finished:
            prefix += 1
        assert ready <= prefix
        consumed += [ack.op for ack in engine.pop(ready)]  # type: ignore[misc]
        time.sleep(0.002)
    assert consumed == list(range(12))
    assert sorted(engine.completion_log) == list(range(12))
    assert list(engine.completion_log) != list(range(12)), "delays should reorder completions"
    assert engine.num_completed == 12
    engine.close()


def test_completion_log_stays_bounded() -> None:
    """A long-running engine must not keep one entry per transfer forever (issue 7, defect 9):
    the completion log is a window over the latest transfers, beside a counter."""
    cfg = CacheConfig(page_size=4, num_device_pages=8, enable_hierarchical_cache=True)
    cache = PrefixCache(cfg, SPEC, CPU)
    assert cache.transfers is not None and cache.host_pool is not None
    device, host = cache.device_pool.page_view(), cache.host_pool.page_view()
    n = 3 * max(COMPLETION_LOG_LEN, RECENT_ACKS)
    for i in range(n):
        cache.transfers.submit(TransferKind.BACKUP, [(device, host)], [i % 8], [i % 8], op=None)
        cache.transfers.pop(1)
    assert len(cache.transfers.completion_log) == COMPLETION_LOG_LEN
    assert cache.transfers.num_completed == n
    assert list(cache.transfers.completion_log) == list(range(n - COMPLETION_LOG_LEN, n))
    cache.close()


def test_consumed_acks_stay_bounded() -> None:
    """The consumed-ACK record is a window too; the count of consumed ACKs stays exact."""
    cfg = CacheConfig(page_size=4, num_device_pages=8, enable_hierarchical_cache=True)
    cache = PrefixCache(cfg, SPEC, CPU)
    rounds = RECENT_ACKS + 40
    for i in range(rounds):  # each insert backs up one new page (write_through): one ACK
        pages = cache.alloc(1)
        assert pages is not None
        cache.insert([i, 1, 2, 3], pages, cached_len=0)
        cache.drain()
        cache.evict_device(1)
    assert len(cache.stats.consumed_acks) == RECENT_ACKS
    assert cache.stats.num_consumed_acks == rounds
    assert list(cache.stats.consumed_acks) == list(range(rounds - RECENT_ACKS, rounds))
    cache.check_integrity()
    cache.close()


def test_pop_waits_for_unfinished_copies() -> None:
    engine = TransferEngine(CPU, num_workers=1, delay=DelayInjection(max_ms=50, seed=0))
    src, dst, src_t, dst_t = pools()
    engine.submit(TransferKind.BACKUP, [(src, dst)], [1, 2], [5, 6], op=None)
    (ack,) = engine.pop(1)  # a later PP stage told by PP0 to consume 1 ACK does this
    assert ack.completion.done()
    assert torch.equal(dst_t[5, :, 0], src_t[:, 0, 4:8])
    with pytest.raises(ValueError):
        engine.pop(1)
    engine.close()


def test_one_transfer_moves_every_pair_under_one_ack() -> None:
    """A pool group's copy (the target's pools, later a draft's) is one operation: every
    (source, destination) pair moves the same pages, and its one ACK completes after all."""
    engine = TransferEngine(CPU, num_workers=2, delay=DelayInjection(max_ms=20, seed=2))
    src_a, dst_a, src_ta, dst_ta = pools()
    src_b, dst_b, src_tb, dst_tb = pools()
    engine.submit(TransferKind.BACKUP, [(src_a, dst_a), (src_b, dst_b)], [1, 2], [5, 6], op=0)
    assert len(engine) == 1
    (ack,) = engine.pop(1)
    assert ack.completion.done() and ack.completion.wait() is None and ack.num_pages == 2
    assert torch.equal(dst_ta[5, :, 0], src_ta[:, 0, 4:8])
    assert torch.equal(dst_tb[6, :, 1], src_tb[:, 1, 8:12])
    with pytest.raises(ValueError, match="at least one pair"):
        engine.submit(TransferKind.BACKUP, [], [1], [1], op=None)
    engine.close()


def test_backup_bookkeeping_changes_only_on_consume() -> None:
    cfg = CacheConfig(
        page_size=4,
        num_device_pages=32,
        enable_hierarchical_cache=True,
        transfer_workers=3,
        transfer_delay=DelayInjection(max_ms=20, seed=1),
    )
    cache = PrefixCache(cfg, SPEC, CPU)
    nodes = []
    for i in range(4):  # four disjoint sequences: four backups in flight (write_through)
        pages = cache.alloc(2)
        assert pages is not None
        nodes.append(cache.insert([i] * 8, pages, cached_len=0).last_node)
    assert cache.num_queued_acks == 4
    time.sleep(0.2)  # every copy has finished by now...
    assert cache.host is not None and cache.host.num_ready_acks() == 4
    # ...but nothing is on the host until its ACK is consumed
    assert [n.on_host for n in nodes] == [False] * 4
    assert all(n.backup_pending and n.lock_ref == 1 for n in nodes)
    assert cache.tree.num_host_pages == 0
    for k in range(1, 5):
        cache.host.consume(1)
        assert [n.on_host for n in nodes] == [True] * k + [False] * (4 - k)
        assert cache.tree.num_host_pages == 2 * k
    assert list(cache.stats.consumed_acks) == [0, 1, 2, 3]
    assert all(n.lock_ref == 0 for n in nodes)
    cache.check_integrity()
    cache.close()


def test_read_guard_rejects_pending_pages() -> None:
    cfg = CacheConfig(page_size=4, num_device_pages=8, check_reads=True)
    cache = PrefixCache(cfg, SPEC, CPU)
    pool = cache.device_pool
    pool.mark_pending([PageId(3)], True)
    pool.get_kv(0, torch.arange(0, 12))  # pages 0-2: fine
    with pytest.raises(RuntimeError, match="load has not completed"):
        pool.get_kv(0, torch.arange(8, 16))
    pool.mark_pending([PageId(3)], False)
    pool.get_kv(0, torch.arange(8, 16))
    # decode's in-place reads of runs of slots are guarded alike
    pool.mark_pending([PageId(5)], True)
    pool.kv_slice(0, 0, 20)  # pages 0-4: fine
    for start, end in ((20, 24), (18, 21), (23, 30)):
        with pytest.raises(RuntimeError, match="load has not completed"):
            pool.kv_slice(0, start, end)


def host_hit_engine(max_ms: float) -> Engine:
    cfg = CacheConfig(
        page_size=4,
        num_device_pages=64,
        enable_hierarchical_cache=True,
        transfer_workers=3,
        transfer_delay=DelayInjection(max_ms=max_ms, seed=5),
        check_reads=True,
    )
    return Engine(EngineConfig(cache=cfg))


def test_loads_with_delays_keep_outputs_and_order() -> None:
    prompt = list(range(40, 90))
    sampling = SamplingParams(max_new_tokens=5, ignore_eos=True)
    eng = host_hit_engine(max_ms=40)
    first = eng.generate(prompt, sampling)
    eng.cache.drain()
    eng.cache.evict_device(eng.cache.tree.num_device_pages)
    again = eng.generate(prompt, sampling)  # waits for its load ACK before prefill
    assert again.output_ids == first.output_ids
    assert again.cached.host == 48 and again.cached.device == 0
    acks = list(eng.cache.stats.consumed_acks)
    assert acks == sorted(acks) and acks == list(range(acks[0], acks[0] + len(acks)))
    eng.close()


def test_prefill_before_load_consumed_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard can fail: a scheduler that skipped waiting for the load would read early."""
    prompt = list(range(40, 90))
    sampling = SamplingParams(max_new_tokens=2, ignore_eos=True)
    eng = host_hit_engine(max_ms=300)
    eng.generate(prompt, sampling)
    eng.cache.drain()
    eng.cache.evict_device(eng.cache.tree.num_device_pages)

    def eager(self: Admission, running: list[Req]) -> None:  # broken: prefill without the ACK
        for req in running:
            if req.state is ReqState.LOADING:
                req.state = ReqState.PREFILL

    monkeypatch.setattr(Admission, "finish_loads", eager)
    with pytest.raises(RuntimeError, match="load has not completed"):
        eng.generate(prompt, sampling)
    eng.close()


def test_a_request_waits_for_pages_that_backups_in_flight_hold() -> None:
    """Nothing running, but a backup's ACK still locks the pages it copies: a request that
    needs them waits for the ACK instead of crashing the engine with "does not fit" (the
    P/D mesh test's decode engine died so after a failed host load, now and then)."""
    seed = next(s for s in range(1000) if random.Random(s).uniform(0, 1000) > 600)
    cfg = CacheConfig(
        page_size=4,
        num_device_pages=16,
        enable_hierarchical_cache=True,
        transfer_delay=DelayInjection(max_ms=1000, seed=seed),  # the first copy: > 0.6 s
    )
    eng = Engine(EngineConfig(cache=cfg))
    sampling = SamplingParams(max_new_tokens=4, ignore_eos=True)
    eng.generate(list(range(1, 21)), SamplingParams(max_new_tokens=1))  # 5 pages to back up
    assert eng.cache.num_queued_acks > 0  # its backup is in flight: those pages are locked
    assert eng.cache.num_available_device_pages < 15
    big = list(range(30, 86))  # 56 + 4 tokens: 15 of the 16 pages
    out = eng.generate(big, sampling)
    cold_eng = Engine(EngineConfig(cache=CacheConfig(page_size=4, enable_radix_cache=False)))
    assert out.output_ids == cold_eng.generate(big, sampling).output_ids
    eng.cache.check_integrity()
    eng.close()
