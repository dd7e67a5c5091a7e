"""P/D between engines of different TP x PP layouts, at the engine level (issue 10).

A prefill engine sends each rank's heads and layers of the KV past `decode_prefix_len` in the
unified order (one KV head per group); the decode engine's rank 0 collects every sender
rank's shard of a chunk, cuts from them the heads and layers each of its own ranks holds,
and every rank writes its own. Multi-rank sides are real worlds of rank processes
(`tests/multirank.py`). Two turns: the second reuses decode's own cache of the first and
receives only the rest. The oracle: the float64 logits of prefill's step 0 and decode's
steps 1.. equal a cold TP1 run with the cache off (bit for bit when no side splits heads;
within 1e-10 when one does, as TP's all_reduce adds in another order). A wrong head or layer
in the cut moves the logits by far more than that.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from multirank import run_world

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.driver import StepLoop
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.parallel.config import ParallelConfig

PAGE = 4
SP = SamplingParams(max_new_tokens=5, ignore_eos=True)
TURN1 = [(7 * i + 3) % 256 for i in range(41)]
TURN2 = [*TURN1, *((5 * i + 1) % 256 for i in range(17))]
DECODE_PREFIX = (0, 40)  # turn 2: decode's own cache holds turn 1's 41 tokens, 10 pages
CHUNK_PAGES = 3

# per turn: (each sender rank's staging bytes, token_start, token_end, first token, pages,
# prefill's step-0 logits)
Export = tuple[dict[int, bytes], int, int, int, int, torch.Tensor]  # shards by world rank


def config(tp: int, pp: int) -> EngineConfig:
    cache = CacheConfig(page_size=PAGE, num_device_pages=128, enable_hierarchical_cache=True)
    return EngineConfig(
        model="tiny-tp", cache=cache, parallel=ParallelConfig(tp, pp), batch_invariant=True
    )


def _step_until(engine: Engine, done: object, timeout_s: float = 60.0) -> None:
    deadline, loop = time.monotonic() + timeout_s, StepLoop(engine)
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, "the engine did not get there"
        loop.step_or_wait()


def prefill_turns(engine: Engine, turns: list[tuple[list[int], int]]) -> list[Export]:
    """Runs on a prefill engine (rank 0 of its world): export each turn from its prefix."""
    out = []
    for prompt, export_from in turns:
        p = engine.submit_prefill(prompt, SP, "", export_from=export_from)
        p.logits_trace = []
        _step_until(engine, lambda p=p: p.export is not None)
        e = p.export
        assert e is not None and e.token_start == export_from
        stagings = {
            r: s.contiguous().numpy().tobytes() for r, s in zip(e.ranks, e.stagings, strict=True)
        }
        step0 = torch.stack(p.logits_trace)
        out.append((stagings, e.token_start, e.token_end, e.first_token, e.num_pages, step0))
        _step_until(engine, lambda p=p: p.finish_reason is not None)
    return out


def decode_turns(
    engine: Engine, turns: list[tuple[list[int], Export]], sender: ParallelConfig
) -> list[tuple[int, list[int], torch.Tensor, int]]:
    """Runs on a decode engine: admit each turn, check its prefix, write the sender's chunks
    (rank by rank, as frames come), and generate. Returns (prefix, ids, logits, bytes)."""
    out = []
    for (prompt, (stagings, start, end, first, pages, _)), want_prefix in zip(
        turns, DECODE_PREFIX, strict=True
    ):
        d = engine.submit_decode(prompt, SP, reuse=True)
        d.logits_trace = []
        _step_until(engine, lambda d=d: d.remote is not None and d.remote.prefix_len >= 0)
        assert d.remote is not None and d.remote.prefix_len == want_prefix == start
        for lo in range(0, pages, CHUNK_PAGES):
            hi = min(lo + CHUNK_PAGES, pages)
            last = hi == pages
            for rank, staging in stagings.items():
                per_page = len(staging) // pages
                payload = staging[lo * per_page : hi * per_page]
                t0, t1 = start + lo * PAGE, min(start + hi * PAGE, end)
                engine.write_kv(d.rid, t0, t1, payload, first if last else None, rank, sender)
        _step_until(engine, lambda d=d: d.finish_reason is not None)
        assert d.remote is not None
        out.append((start, d.output_ids, torch.stack(d.logits_trace), d.remote.received_bytes))
    engine.drain()
    engine.check_integrity()
    return out


def on(parallel: ParallelConfig, workload: object, *args: object) -> object:
    """Run `workload` on an engine of `parallel`: in this process for TP1, else a world."""
    cfg = config(parallel.tp_size, parallel.pp_size)
    if parallel.world_size == 1:
        engine = Engine(cfg)
        try:
            return workload(engine, *args)  # type: ignore[operator]
        finally:
            engine.close()
    return run_world(cfg, workload, *args)  # type: ignore[arg-type]


def cold_traced(prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    cache = CacheConfig(page_size=PAGE, enable_radix_cache=False)
    engine = Engine(dataclasses.replace(config(1, 1), cache=cache))
    req = engine.submit(prompt, SP)
    req.logits_trace = []
    (result,) = engine.run([req])
    engine.close()
    return result.output_ids, torch.stack(req.logits_trace)


@pytest.fixture(scope="module")
def cold() -> list[tuple[list[int], torch.Tensor]]:
    return [cold_traced(TURN1), cold_traced(TURN2)]


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [((2, 2), (1, 1)), ((1, 1), (2, 1)), ((1, 2), (2, 1)), ((2, 1), (1, 2)), ((2, 1), (2, 2))],
    ids=lambda layout: f"TP{layout[0]}PP{layout[1]}",
)
def test_pd_across_layouts_equals_cold(
    cold: list[tuple[list[int], torch.Tensor]],
    prefill: tuple[int, int],
    decode: tuple[int, int],
) -> None:
    sender, receiver = ParallelConfig(*prefill), ParallelConfig(*decode)
    turns = [(TURN1, DECODE_PREFIX[0]), (TURN2, DECODE_PREFIX[1])]
    exports = on(sender, prefill_turns, turns)
    assert isinstance(exports, list) and len(exports[0][0]) == sender.world_size
    got = on(receiver, decode_turns, list(zip((TURN1, TURN2), exports, strict=True)), sender)
    assert isinstance(got, list)
    exact = sender.tp_size == receiver.tp_size == 1
    for (want_ids, want_logits), export, (prefix, ids, logits, received) in zip(
        cold, exports, got, strict=True
    ):
        steps = torch.cat([export[5], logits])
        assert steps.shape == want_logits.shape
        diff = (steps - want_logits).abs().max().item()
        assert diff == 0 if exact else diff < 1e-10, f"logits differ from cold by {diff:.3g}"
        assert ids == want_ids
        # only the suffix moved: rank 0 received its own shard of exactly those pages
        pages = -(-(export[2] - prefix) // PAGE)
        assert export[4] == pages
        shard = 8 // receiver.tp_size * (8 // receiver.pp_size) * 2 * PAGE * 8 * 8  # f64 bytes
        assert received == pages * shard
