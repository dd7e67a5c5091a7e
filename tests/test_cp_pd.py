"""P/D with context-parallel engines, at the engine level (issue 22, build items 1 and 9).

Replicated CP: an engine's KV is its CP1 layout's on every CP rank, so a CP prefill engine
sends only CP rank 0's shards, named as ranks of that CP1 layout (`ParallelConfig.kv_layout`:
what the wire's frames carry), and a CP decode engine cuts each received chunk for every
one of its ranks, CP replicas included. `tests/test_pd_layouts.py`'s two turns (the second
reuses decode's own cache) run between CP2 and CP1 engines both ways and between two CP2
engines: the float64 logits of prefill's step 0 and decode's steps equal a cold CP1 run,
bit for bit.

Sharded CP (`--enable-kv-cache-sharding`): a prefill engine sends each page from its owner
rank, and a decode engine of any layout takes it; a sharded decode engine writes on each CP
rank the pages that rank owns. The same two turns go through the real wire: the prefill's
export is cut into frames by the service's `cut_frames` under a small frame limit (several
chunks, the last with fewer pages than CP ranks, so some rank sends nothing for it), and the
decode side reads them back as `DecodeSide` does (`decode_frame`, `ShardAssembler`, the
sender's layout and rotation from each header). Frame counts are checked against the owner
cycle. Prefill engines: CP2 and CP4 sharded, CP2 sharded x PP2, and CP1; decode engines:
CP1, CP2 sharded, CP2 replicated and TP2 (within 1e-10 there: TP's all_reduce adds in
another order). Every engine here reads KV by slot gathers (`DebugHooks.gather_reads`, as a sharded
pool must; see `tests/test_cp_engine.py`), the cold reference too, and sharded pools are
poisoned (rows no rank wrote read as NaN), so a page written on the wrong rank or row, or not
at all, shows in the logits, which must equal the cold CP1 run bit for bit.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from fault_helpers import (
    MeshSpec,
    baseline,
    cold_reference,
    running_mesh,
    workload,
)
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

from bus_schemas.codec import SchemaError
from bus_schemas.kv_frame import (
    HEADER_SIZE,
    KVFrameHeader,
    chunk_senders,
    decode_frame,
    encode_frame,
    owned_pages,
)
from gpu_worker.engine.driver import StepLoop
from gpu_worker.engine.engine import DebugHooks, Engine, EngineConfig
from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.scheduler.request import CachedTokens, KVExport
from services.engine.pd_frames import ShardAssembler, cut_frames, sender_layout


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


@pytest.mark.parametrize(("prefill", "decode"), [(2, 1), (1, 2)], ids=["CP2-CP1", "CP1-CP2"])
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


# ---------------------------------------------------------------- sharded CP

PAGE_BYTES = 8 * 8 * 2 * PAGE * 8 * 8  # tiny-tp, float64: 8 KV heads, 8 layers, head_dim 8
FRAME_LIMIT = PAGE_BYTES + PAGE_BYTES // 2  # one page's shard per frame: chunks of N pages

Layout = tuple[int, bool, int, int]  # (cp_size, sharded, tp_size, pp_size)
# per turn: (frames, rotation of the export's first page, pages, prefill's step-0 logits)
Frames = tuple[list[bytes], int, int, torch.Tensor]


def sharded_config(cp: int, sharded: bool, tp: int = 1, pp: int = 1) -> EngineConfig:
    """`config`, every engine reading by gathers (the bit-exact reference of a sharded
    pool) and sharded pools poisoned."""
    return dataclasses.replace(
        config(cp, sharded),
        parallel=ParallelConfig(tp, pp, cp, sharded),
        debug=DebugHooks(gather_reads=True, poison_kv=sharded),
    )


def on_layout(layout: Layout, workload: object, *args: object, log_dir: Path) -> object:
    """`workload` on an engine of `layout`: in this process, or on rank 0 of a world with
    the rank consensus checker on (its stage compares the tokens each CP rank sampled, so
    a page a sharded decode rank wrote wrongly shows even where rank 0's logits do not)."""
    cfg = sharded_config(*layout)
    if cfg.parallel.world_size == 1:
        engine = Engine(cfg)
        try:
            return workload(engine, *args)  # type: ignore[operator]
        finally:
            engine.close()
    return run_world(cfg, workload, *args, env=checker_env(log_dir))  # type: ignore[arg-type]


def prefill_frames(engine: Engine, turns: list[tuple[list[int], int]]) -> list[Frames]:
    """Runs on a prefill engine: export each turn from its prefix and cut the export into
    the frames the service would send."""
    out = []
    for export, step0 in (_export(engine, prompt, start) for prompt, start in turns):
        tp = engine.config.parallel.tp_size
        plan = cut_frames(f"t{len(out)}", export, CachedTokens(), tp, FRAME_LIMIT)
        out.append((plan.frames, export.rotation, export.num_pages, step0))
    return out


def _export(engine: Engine, prompt: list[int], export_from: int) -> tuple[Any, torch.Tensor]:
    p = engine.submit_prefill(prompt, SP, "", export_from=export_from)
    p.logits_trace = []
    _step_until(engine, lambda: p.export is not None)
    step0 = torch.stack(p.logits_trace)
    _step_until(engine, lambda: p.finish_reason is not None)
    return p.export, step0


def decode_frames(
    engine: Engine, turns: list[tuple[list[int], int, list[bytes]]]
) -> list[tuple[int, list[int], torch.Tensor, int, int]]:
    """Runs on a decode engine: admit each turn, check decode's own prefix, write the
    frames as `DecodeSide` would, and generate. Returns (prefix, ids, logits, bytes
    received, tokens decode's device cache served) per turn."""
    out = []
    for prompt, want_prefix, frames in turns:
        d = engine.submit_decode(prompt, SP, reuse=True)
        d.logits_trace = []
        _step_until(engine, lambda d=d: d.remote is not None and d.remote.prefix_len >= 0)
        assert d.remote is not None and d.remote.prefix_len == want_prefix
        shards = ShardAssembler()
        for frame in frames:
            header, payload = decode_frame(frame)
            shard = shards.add(header, payload)
            if shard is None:
                continue
            first = header.first_token if header.last else None
            args = (header.token_start, header.token_end, memoryview(shard), first, header.rank)
            engine.write_kv(d.rid, *args, sender_layout(header), header.rotation)
            shards.written(header)
        _step_until(engine, lambda d=d: d.finish_reason is not None)
        logits = torch.stack(d.logits_trace)
        out.append((want_prefix, d.output_ids, logits, d.remote.received_bytes, d.cached.device))
    engine.drain()
    engine.check_integrity()
    return out


def _step_until(engine: Engine, done: Any, timeout_s: float = 30.0) -> None:
    deadline, loop = time.monotonic() + timeout_s, StepLoop(engine)
    while not done():
        assert time.monotonic() < deadline, "the engine did not get there"
        loop.step_or_wait()


@pytest.fixture(scope="module")
def cold_gathered() -> list[tuple[list[int], torch.Tensor]]:
    """Cold CP1 runs of both turns, reading by gathers (no cache)."""
    cfg = sharded_config(1, False)
    cfg = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, enable_radix_cache=False))
    engine = Engine(cfg)
    out = []
    for prompt in (TURN1, TURN2):
        req = engine.submit(prompt, SP)
        req.logits_trace = []
        (result,) = engine.run([req])
        out.append((result.output_ids, torch.stack(req.logits_trace)))
    engine.close()
    return out


def expected_frames(
    num_pages: int, rotation: int, layout: ParallelConfig
) -> list[tuple[int, int, int]]:
    """(chunk's first page, sending rank, shard bytes) of each frame of a transfer under
    FRAME_LIMIT: chunks of as many pages as one rank's page shard fits the limit, times the
    CP size when sharded (a rank holds one page in N), every rank's shard in rank order; a
    rank owning none of a chunk's pages sends no frame for it."""
    page_bytes = PAGE_BYTES // (layout.tp_size * layout.pp_size)  # one rank's shard of a page
    cp = layout.cp_size if layout.kv_sharding else 1
    per = FRAME_LIMIT // page_bytes * cp
    frames = []
    for lo in range(0, num_pages, per):
        n, first = min(per, num_pages - lo), (rotation + lo) % cp
        for r in layout.kv_ranks(False):
            c = layout.coords(r).cp
            if c in chunk_senders(n, cp, first):
                frames.append((lo, r, len(owned_pages(n, cp, first, c)) * page_bytes))
    return frames


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [
        ((2, True, 1, 1), (1, False, 1, 1)),
        ((1, False, 1, 1), (2, True, 1, 1)),
        ((4, True, 1, 1), (2, True, 1, 1)),
        ((2, True, 1, 1), (1, False, 2, 1)),
        ((2, True, 1, 2), (2, True, 1, 1)),
    ],
    ids=["CP2s-CP1", "CP1-CP2s", "CP4s-CP2s", "CP2s-TP2", "CP2sPP2-CP2s"],
)
def test_pd_with_sharded_engines_equals_cold(
    cold_gathered: list[tuple[list[int], torch.Tensor]],
    prefill: Layout,
    decode: Layout,
    tmp_path: Path,
) -> None:
    turns = [(TURN1, DECODE_PREFIX[0]), (TURN2, DECODE_PREFIX[1])]
    exports = on_layout(prefill, prefill_frames, turns, log_dir=tmp_path / "prefill")
    assert isinstance(exports, list)
    sender = sharded_config(*prefill).parallel
    cp = sender.cp_size if sender.kv_sharding else 1
    for (prompt, start), (frames, rotation, pages, _) in zip(turns, exports, strict=True):
        assert pages == -(-(len(prompt) - start) // PAGE)
        assert rotation == start // PAGE % cp  # a path's page k is on CP rank k % N
        headers = [decode_frame(f)[0] for f in frames]
        assert {sender_layout(h) for h in headers} == {sender}
        # each page once, from its owner; no frame from a rank owning none of a chunk
        got = [(h.token_start // PAGE - start // PAGE, h.rank, h.shard_len) for h in headers]
        assert got == expected_frames(pages, rotation, sender)
        assert all(h.rotation == h.token_start // PAGE % cp for h in headers)
    decode_args = [
        (prompt, prefix, frames)
        for (prompt, prefix), (frames, *_) in zip(turns, exports, strict=True)
    ]
    got_turns = on_layout(decode, decode_frames, decode_args, log_dir=tmp_path / "decode")
    assert isinstance(got_turns, list)
    tp = decode[2]
    for (want_ids, want_logits), (_, _, pages, step0), (prefix, ids, logits, received, hit) in zip(
        cold_gathered, exports, got_turns, strict=True
    ):
        steps = torch.cat([step0, logits])
        if tp == 1:
            assert torch.equal(steps, want_logits), "logits differ from a cold CP1 run"
        else:  # TP's all_reduce adds in another order (tests/test_pd_layouts.py)
            diff = (steps - want_logits).abs().max().item()
            assert diff < 1e-10, f"logits differ from a cold CP1 run by {diff:.3g}"
        assert ids == want_ids
        assert hit == prefix  # turn 2: decode's own device cache served its first 40 tokens
        assert received == pages * PAGE_BYTES // tp  # rank 0's shard of every page moved


def test_kv_frames_name_the_cp_layout_and_rotation() -> None:
    h = KVFrameHeader("r", 0, 8, 16, rank=3, world_size=8, tp_size=2, cp_size=2, rotation=1)
    got, _ = decode_frame(encode_frame(h, b"kv"))
    assert HEADER_SIZE == 100 and got == dataclasses.replace(h, shard_len=2)
    assert (got.pp_size, got.cp_rank) == (2, 1)
    assert sender_layout(got) == ParallelConfig(2, 2, 2, kv_sharding=True)
    plain = KVFrameHeader("r", 0, 0, 8, rank=1, world_size=4, tp_size=2)
    assert sender_layout(decode_frame(encode_frame(plain, b"kv"))[0]) == ParallelConfig(2, 2)
    with pytest.raises(ValueError, match="rotation 2 is not a CP rank of 2"):
        dataclasses.replace(h, rotation=2)
    with pytest.raises(ValueError, match="cp_size 3 x tp_size 2 does not divide world 8"):
        dataclasses.replace(h, cp_size=3, rotation=0)
    older = bytearray(encode_frame(h, b"kv"))
    older[:4] = b"HKV3"  # no CP fields: its reader would take CP ranks for stages
    with pytest.raises(SchemaError, match="magic"):
        decode_frame(bytes(older))
    # which CP ranks send a chunk, and which of its pages each holds
    assert chunk_senders(1, 4, 2) == [2] and chunk_senders(3, 4, 3) == [0, 1, 3]
    assert chunk_senders(9, 2, 1) == [0, 1] and chunk_senders(5, 1, 0) == [0]
    assert list(owned_pages(5, 4, 2, 0)) == [2] and list(owned_pages(5, 2, 1, 1)) == [0, 2, 4]
    assert list(owned_pages(3, 4, 0, 3)) == [] and list(owned_pages(3, 1, 0, 0)) == [0, 1, 2]


def test_sharded_export_cut_in_parts_reassembles() -> None:
    """A CP2 sharded export of 5 pages (page 0 on CP rank 1) cut under a limit smaller than
    one page's shard: chunks of 2 pages, each owner's shard in parts, no frame of CP rank 0
    for the last chunk; the parts put back by owner give every page exactly."""
    shape = (5, 8, 8, 2, PAGE, 1, 8)
    whole = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).view(shape)
    stagings = (whole[1::2].contiguous(), whole[0::2].contiguous())  # CP ranks 0 and 1
    export = KVExport(stagings, 8, 25, 7, (0, 1), 2, 2, 1, (0, 1))
    limit = PAGE_BYTES // 3 + 8
    plan = cut_frames("r", export, CachedTokens(), 1, limit)
    back = torch.full(shape, float("nan"), dtype=torch.float64)
    shards, senders = ShardAssembler(), []
    for frame in plan.frames:
        header, payload = decode_frame(frame)
        assert len(frame) <= limit + HEADER_SIZE
        shard = shards.add(header, payload)
        if shard is None:
            continue
        lo = (header.token_start - 8) // PAGE
        pages = -(-(header.token_end - header.token_start) // PAGE)
        assert header.rotation == (1 + lo) % 2 and header.last == (header.token_end == 25)
        senders.append((lo, header.rank))
        mine = owned_pages(pages, 2, header.rotation, header.cp_rank)
        piece = torch.frombuffer(bytearray(shard), dtype=torch.float64)
        back[[lo + i for i in mine]] = piece.view(len(mine), *shape[1:])
        shards.written(header)
    assert torch.equal(back, whole)
    assert senders == [(0, 0), (0, 1), (2, 0), (2, 1), (4, 1)]  # CP rank 1 owns page 4 alone
    parts = -(-PAGE_BYTES // limit)  # of one page's shard
    assert plan.units == [1] * (parts - 1) * 2 + [2] + [1] * (parts - 1) * 2 + [2] + [1] * (
        parts - 1
    ) + [1]


def test_kv_import_refuses_shards_a_sharded_sender_never_sends() -> None:
    engine = Engine(sharded_config(1, False))
    sender = ParallelConfig(cp_size=2, kv_sharding=True)
    page = bytes(PAGE_BYTES)
    try:
        # one page, on CP rank 0: rank 1 owns none of the chunk, so no shard of it comes
        with pytest.raises(ValueError, match="CP rank 1 owns none of the 1 pages"):
            engine.write_kv(0, 0, 4, page, None, 1, sender, 0)
        with pytest.raises(ValueError, match="rotation 2 is not a CP rank of 2"):
            engine.write_kv(0, 0, 4, page, None, 0, sender, 2)
        with pytest.raises(ValueError, match="holds no token"):
            engine.write_kv(0, 4, 4, b"", None, 0, sender, 0)
        # three pages from page 0 on rank 0: rank 0's shard holds two of them
        with pytest.raises(ValueError, match=f"has {PAGE_BYTES} bytes, expected {2 * PAGE_BYTES}"):
            engine.write_kv(0, 0, 12, page, None, 0, sender, 0)
        # two pages: the shards of one chunk must name one rotation
        engine.write_kv(0, 0, 8, page, None, 0, sender, 0)
        with pytest.raises(ValueError, match="page 0 on CP rank 1"):
            engine.write_kv(0, 0, 8, page, None, 1, sender, 1)
    finally:
        engine.close()


# ---------------------------------------------------------------- through the mesh


@pytest.mark.timeout(300)
async def test_pd_mesh_with_sharded_engines_equals_cp1(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """`up --pd --cp-size 2 --enable-kv-cache-sharding`: a sharded prefill engine's frames
    (cut for the real server's max_payload) reach a sharded decode engine through the
    services; greedy outputs equal a CP1 engine's, and a repeat reuses decode's sharded
    cache: only the suffix it lacks moves."""
    sharded = ("--cp-size", "2", "--enable-kv-cache-sharding")
    extra = (*sharded, "--disaggregation-decode-enable-radix-cache")
    spec = MeshSpec(pd=True, extra=extra, host_tier=False)
    with running_mesh(spec, tmp_path_factory, "pd-cp2sharded") as mesh:
        reqs = workload(4)
        got = await baseline(mesh.url, reqs)
        assert got == cold_reference(reqs)
        assert mesh.log_path.read_text().count("engine world TP1/PP1/CP2 sharded up") == 2
        req = reqs[0]
        body = {"prompt": list(req.prompt), "max_tokens": req.max_tokens, "temperature": 0}
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{mesh.url}/v1/completions", json={**body, "ignore_eos": True}) as r,
        ):
            data = await r.json()
    assert tuple(data["choices"][0]["token_ids"]) == got[req]
    usage = data["usage"]
    pd = usage["disaggregation"]
    assert pd["decode_prefix_len"] > 0  # decode's own cache
    assert usage["prompt_tokens_details"]["cached_tokens"] == pd["decode_prefix_len"]
    assert pd["transferred_tokens"] == len(req.prompt) - pd["decode_prefix_len"]
