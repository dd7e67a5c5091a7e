"""P/D with replicated context-parallel engines, at the engine level (issue 22, build item 1:
prefill and decode engines take --cp-size too).

A replicated CP engine's KV is its CP1 layout's on every CP rank, so a CP prefill engine
sends only CP rank 0's shards, named as ranks of that CP1 layout (`ParallelConfig.kv_layout`:
what the wire's frames carry), and a CP decode engine cuts each received chunk for every
one of its ranks, CP replicas included. `tests/test_pd_layouts.py`'s two turns (the second
reuses decode's own cache) run between CP2 and CP1 engines both ways and between two CP2
engines: the float64 logits of prefill's step 0 and decode's steps equal a cold CP1 run,
bit for bit. A sharded engine refuses P/D requests with a clear error.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from multirank import run_world
from test_multirank_consensus import checker_env
from test_pd_layouts import (
    DECODE_PREFIX,
    PAGE,
    SP,
    TURN1,
    TURN2,
    cold_traced,
    decode_turns,
    prefill_turns,
)
from test_pd_layouts import config as pd_config

from gpu_worker.engine.engine import Engine, EngineConfig, InvalidRequestError
from gpu_worker.parallel.config import ParallelConfig


def config(cp: int, sharded: bool = False) -> EngineConfig:
    cfg = pd_config(1, 1)
    cache = (
        cfg.cache
        if not sharded
        else dataclasses.replace(cfg.cache, enable_hierarchical_cache=False)
    )
    return dataclasses.replace(
        cfg, cache=cache, parallel=ParallelConfig(cp_size=cp, kv_sharding=sharded)
    )


def on(cp: int, workload: object, *args: object, log_dir: Path) -> object:
    """`workload` on a CP1 engine in this process, or on rank 0 of a CP world with the
    checker on (its stage compares the tokens each CP rank sampled)."""
    if cp == 1:
        engine = Engine(config(1))
        try:
            return workload(engine, *args)  # type: ignore[operator]
        finally:
            engine.close()
    return run_world(config(cp), workload, *args, env=checker_env(log_dir))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def cold() -> list[tuple[list[int], torch.Tensor]]:
    return [cold_traced(TURN1), cold_traced(TURN2)]


@pytest.mark.parametrize(
    ("prefill", "decode"), [(2, 1), (1, 2), (2, 2)], ids=["CP2-CP1", "CP1-CP2", "CP2-CP2"]
)
def test_pd_between_cp_engines_equals_cold(
    cold: list[tuple[list[int], torch.Tensor]], prefill: int, decode: int, tmp_path: Path
) -> None:
    turns = [(TURN1, DECODE_PREFIX[0]), (TURN2, DECODE_PREFIX[1])]
    exports = on(prefill, prefill_turns, turns, log_dir=tmp_path / "prefill")
    assert isinstance(exports, list) and list(exports[0][0]) == [0]  # CP rank 0's shard only
    wire = ParallelConfig()  # the layout the CP2 prefill's frames name: its CP1 layout
    decode_args = (list(zip((TURN1, TURN2), exports, strict=True)), wire)
    got = on(decode, decode_turns, *decode_args, log_dir=tmp_path / "decode")
    assert isinstance(got, list)
    for (want_ids, want_logits), export, (prefix, ids, logits, received) in zip(
        cold, exports, got, strict=True
    ):
        steps = torch.cat([export[5], logits])
        assert torch.equal(steps, want_logits), "logits differ from a cold CP1 run"
        assert ids == want_ids
        pages = -(-(export[2] - prefix) // PAGE)  # only the suffix moved
        assert export[4] == pages and received == pages * 8 * 8 * 2 * PAGE * 8 * 8  # f64


def test_a_sharded_engine_refuses_pd_requests() -> None:
    assert run_world(config(2, sharded=True), _pd_refusals) == 2


def _pd_refusals(engine: Engine) -> int:
    refused = 0
    for submit in (
        lambda: engine.submit_prefill(TURN1, SP, "", export_from=0),
        lambda: engine.submit_decode(TURN1, SP),
    ):
        try:
            submit()
        except InvalidRequestError as e:
            assert "not supported with --enable-kv-cache-sharding yet" in str(e)
            refused += 1
    return refused
