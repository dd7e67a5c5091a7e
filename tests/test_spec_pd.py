"""P/D with speculative decoding: the draft's KV of the prompt crosses with the target's.

A prefill engine with a draft exports the draft's KV of the same pages with the target's
(each page of a shard: the target's rows, then the draft's); the decode engine writes it
into its draft pool at the same page ids and decodes speculatively from there, and a turn-2
decode-side reuse hit holds both models' KV. The float64 batch-invariant oracle: tokens and
the target's logits at every emitted position equal speculation off bit for bit, and the
accepted counts of every verify round equal the colocated speculative run's (with `self`
every proposal is accepted), on turn 1 and on the reuse hit. Zeroing the received draft rows
(a test switch) breaks the acceptance; engines of different drafts are refused, naming both.
"""

from __future__ import annotations

import dataclasses
import random
import time

import aiohttp
import pytest
import torch
from fault_helpers import MeshSpec, Req, cold_reference, running_mesh
from multirank import run_world

from bus_schemas.codec import SchemaError
from bus_schemas.kv_frame import (
    HEADER_SIZE,
    KVFrameHeader,
    decode_frame,
    draft_digest,
    encode_frame,
)
from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.scheduler.request import CachedTokens, KVExport
from gpu_worker.scheduler.request import Req as EngineReq
from gpu_worker.scheduler.spec_config import SpecConfig
from services.engine.pd_frames import ShardAssembler, cut_frames, payload_limit

PAGE = 4
SP = SamplingParams(max_new_tokens=9, ignore_eos=True)


def make_engine(
    draft: str | None, radix: bool = True, quant: str = "none", host: bool = False
) -> Engine:
    spec = SpecConfig() if draft is None else SpecConfig("standalone", draft, 3, quant)
    cache = CacheConfig(
        page_size=PAGE,
        num_device_pages=256,
        enable_radix_cache=radix,
        enable_hierarchical_cache=host,
        write_through_threshold=1,
    )
    return Engine(EngineConfig(cache=cache, batch_invariant=True, spec=spec))


def step_until(eng: Engine, done: object, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done():  # type: ignore[operator]
            return
        eng.step()
    raise AssertionError("engine did not get there")


def run_pd(
    prefill: Engine, decode: Engine, prompt: list[int], reuse: bool = True
) -> tuple[EngineReq, EngineReq]:
    """One request through P/D, two pages per chunk; returns (decode req, prefill req)."""
    d = decode.submit_decode(prompt, SP, reuse=reuse)
    d.logits_trace = []
    step_until(decode, lambda: d.remote is not None and d.remote.prefix_len >= 0)
    assert d.remote is not None
    p = prefill.submit_prefill(prompt, SP, "", export_from=d.remote.prefix_len)
    p.logits_trace = []
    step_until(prefill, lambda: p.export is not None)
    export = p.export
    assert export is not None
    assert len(export.draft_stagings) == (1 if prefill.spec is not None else 0)
    for lo in range(0, export.num_pages, 2):
        hi = min(lo + 2, export.num_pages)
        start = export.token_start + lo * PAGE
        end = min(export.token_start + hi * PAGE, export.token_end)
        last = hi == export.num_pages
        payload = export.shard_bytes(0, slice(lo, hi))
        decode.write_kv(
            d.rid,
            start,
            end,
            payload,
            export.first_token if last else None,
            draft=draft_digest(export.draft),
        )
    step_until(decode, lambda: d.finish_reason is not None)
    decode.check_integrity()
    return d, p


def draft_rows(eng: Engine, ids: list[int]) -> torch.Tensor:
    """The draft pool's rows of `ids`' cached whole pages (the tree's device prefix)."""
    pool = eng.cache.pools.draft
    assert pool is not None
    hit = eng.cache.match([*ids, 0])
    assert hit.device_len >= len(ids) // PAGE * PAGE > 0
    n = len(ids) // PAGE * PAGE
    return pool.kv[:, :, pool.slot_ids(list(hit.device_page_ids), n)].clone()


def conversation() -> list[list[int]]:
    """Turn 2 extends turn 1's prompt: a decode-side reuse hit."""
    rng = random.Random(5)
    first = [rng.randrange(256) for _ in range(23)]
    return [first, first + [rng.randrange(256) for _ in range(9)]]


def colocated(draft: str | None, prompts: list[list[int]]) -> list[EngineReq]:
    eng = make_engine(draft, radix=False)
    reqs = []
    for prompt in prompts:
        req = eng.submit(prompt, SP)
        req.logits_trace = []
        eng.run([req])
        reqs.append(req)
    return reqs


@pytest.mark.parametrize("reuse", [True, False])
@pytest.mark.parametrize("draft", ["self", "tiny-draft"])
def test_pd_speculation_is_lossless_and_restores_the_draft_exactly(draft: str, reuse: bool) -> None:
    """Turn 2 with decode reuse: decode holds the prefix's draft KV itself; without: prefill
    sends it, from its own prefix hit (its draft pool holds it with the target's)."""
    prompts = conversation()
    off, on = colocated(None, prompts), colocated(draft, prompts)
    prefill, decode = make_engine(draft), make_engine(draft)
    for i, prompt in enumerate(prompts):
        d, p = run_pd(prefill, decode, prompt, reuse)
        assert d.remote is not None
        held = len(prompts[0]) // PAGE * PAGE if i else 0  # turn 1's prompt, in both caches
        assert d.remote.prefix_len == (held if reuse else 0)
        assert p.cached.device == held
        assert d.output_ids == off[i].output_ids
        assert p.logits_trace is not None and d.logits_trace is not None
        got = torch.stack(p.logits_trace + d.logits_trace)
        assert off[i].logits_trace is not None
        want = torch.stack(off[i].logits_trace)
        assert got.dtype == torch.float64 and torch.equal(got, want)
        assert d.spec_rounds == on[i].spec_rounds  # the draft's state restored exactly
        # what decode holds of the draft's KV is what prefill computed, bit for bit (with
        # tiny-draft, which rejects every proposal, this is what pins its rows)
        assert torch.equal(draft_rows(decode, prompt), draft_rows(prefill, prompt))
        if draft == "self":
            assert all(k == a for k, a in d.spec_rounds) and d.spec_rounds


@pytest.mark.parametrize("draft", ["self", "tiny-draft"])  # packed / sidecar host rows
def test_decode_reuse_restores_the_draft_from_decodes_host_tier(draft: str) -> None:
    """Decode-side reuse from the decode engine's host tier: turn 1's KV (both models') is
    backed up, the device evicted, and turn 2's hit is loaded back from the host, the draft's
    rows in the same transfer as the target's: lossless, and every verify round as the
    colocated run's."""
    prompts = conversation()
    off, on = colocated(None, prompts), colocated(draft, prompts)
    prefill, decode = make_engine(draft), make_engine(draft, host=True)
    for i, prompt in enumerate(prompts):
        if i:
            decode.drain()  # turn 1's backups land on the host
            decode.evict_device(256)
            draft_pool = decode.cache.pools.draft
            assert draft_pool is not None and decode.cache.tree.num_device_pages == 0
            for pool in (decode.cache.pools.device, draft_pool):
                pool.kv.zero_()  # nothing on the device: only a load-back brings rows back
        d, _ = run_pd(prefill, decode, prompt)
        assert d.output_ids == off[i].output_ids
        assert d.spec_rounds == on[i].spec_rounds
        if i:
            assert d.cached.host == len(prompts[0]) // PAGE * PAGE  # the hit came from the host
    if draft == "self":
        assert all(k == a for k, a in d.spec_rounds) and d.spec_rounds


def test_zeroed_received_draft_rows_break_acceptance() -> None:
    """The acceptance test's own check: with the received draft rows zeroed, the exact copy
    no longer accepts every proposal (outputs stay lossless: the target verifies)."""
    (prompt,) = conversation()[:1]
    (on,) = colocated("self", [prompt])
    prefill, decode = make_engine("self"), make_engine("self")
    decode.scheduler.remote_kv.zero_draft = True
    d, _ = run_pd(prefill, decode, prompt)
    assert d.output_ids == on.output_ids
    assert d.spec_rounds != on.spec_rounds


@pytest.mark.parametrize(
    ("pre", "dec", "quant"),
    [
        ("self", "tiny-draft", "none"),  # another shape
        ("self", "self", "int8"),  # the same shape, other weights: sizes alone would pass
        ("self", None, "none"),
        (None, "self", "none"),
    ],
)
def test_a_different_draft_is_refused_naming_both(
    pre: str | None, dec: str | None, quant: str
) -> None:
    prefill, decode = make_engine(pre), make_engine(dec, quant=quant)
    with pytest.raises(ValueError, match="must run the same draft") as e:
        run_pd(prefill, decode, conversation()[0])
    theirs = draft_digest(prefill.draft_id)
    assert (f"digest {theirs:016x}" if theirs else "is none") in str(e.value)
    assert repr(decode.draft_id or "none") in str(e.value)


def test_self_and_the_targets_own_name_are_one_draft() -> None:
    """`self` is the target's weights: a prefill engine drafting with `self` and a decode
    engine naming the target's preset run the same draft, and P/D accepts it."""
    prefill, decode = make_engine("self"), make_engine("tiny")
    assert prefill.draft_id == decode.draft_id
    (on,) = colocated("self", conversation()[:1])
    d, _ = run_pd(prefill, decode, conversation()[0])
    assert d.output_ids == on.output_ids and d.spec_rounds == on.spec_rounds


def test_kv_frames_carry_the_drafts_digest() -> None:
    """The frame header names the draft (a digest: 0 without one), and a frame of the
    previous version, which had no such field, is refused rather than read as draft-less."""
    digest = draft_digest(make_engine("self").draft_id)
    assert digest and draft_digest("") == 0
    h = KVFrameHeader("r", 0, 0, 8, draft=digest)
    got, _ = decode_frame(encode_frame(h, b"kv"))
    assert got.draft == digest and HEADER_SIZE == 100
    older = bytearray(encode_frame(h, b"kv"))
    older[:4] = b"HKV4"
    with pytest.raises(SchemaError, match="magic"):
        decode_frame(bytes(older))


MESH_SPEC = (
    "--speculative-algorithm",
    "standalone",
    "--speculative-draft-model-path",
    "self",
    "--speculative-num-steps",
    "3",
    "--enable-deterministic-inference",
    "--disaggregation-decode-enable-radix-cache",
)


@pytest.mark.timeout(300)
async def test_pd_mesh_speculates_with_the_received_draft_state(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """`up --pd` with the `self` draft, through HTTP: greedy tokens equal an in-process run
    without speculation, turn 2 reuses decode's own cache, and decode accepted every
    proposal (its draft state of the received and the reused prompt is exact)."""
    spec = MeshSpec(pd=True, extra=MESH_SPEC, host_tier=False)
    first = conversation()[0]
    turns = [Req(tuple(first), 6, False), Req((*first, *range(40, 49)), 6, True)]
    want = cold_reference(turns, exact=True)
    with running_mesh(spec, tmp_path_factory, "spec-pd") as mesh:
        async with aiohttp.ClientSession() as http:
            for i, req in enumerate(turns):
                body = {
                    "prompt": list(req.prompt),
                    "max_tokens": req.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                async with http.post(f"{mesh.url}/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    data = await r.json()
                assert tuple(data["choices"][0]["token_ids"]) == want[req]
                reused = data["usage"]["disaggregation"]["decode_prefix_len"]
                assert reused == (len(first) // PAGE * PAGE if i else 0)
            async with http.get(f"{mesh.url}/stats") as r:
                assert r.status == 200, await r.text()
                stats = (await r.json())["engines"]["decode-0"]["stats"]
    assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"] > 0


# ---------------------------------------------------------------- across layouts

LAYOUT_TURNS = (
    ([(7 * i + 3) % 256 for i in range(41)], 0),
    (
        [*((7 * i + 3) % 256 for i in range(41)), *((5 * i + 1) % 256 for i in range(17))],
        40,  # turn 2: decode's own cache holds turn 1's 41 tokens, 10 pages
    ),
)


def layout_config(parallel: ParallelConfig, draft: str | None = "self") -> EngineConfig:
    spec = SpecConfig() if draft is None else SpecConfig("standalone", draft, 3)
    cache = CacheConfig(page_size=PAGE, num_device_pages=128)
    return EngineConfig(
        model="tiny-tp", cache=cache, parallel=parallel, batch_invariant=True, spec=spec
    )


def prefill_layout(engine: Engine) -> list[tuple[dict[int, bytes], int, int, int, int, int]]:
    """Runs on a prefill engine (rank 0 of its world): each turn's export as the frames
    carry it, (each sender rank's shard bytes, start, end, first token, pages, draft)."""
    out = []
    for prompt, export_from in LAYOUT_TURNS:
        p = engine.submit_prefill(prompt, SP, "", export_from=export_from)
        step_until(engine, lambda p=p: p.export is not None, 120)
        e = p.export
        assert e is not None and len(e.draft_stagings) == len(e.stagings)
        shards = {r: e.shard_bytes(i, slice(0, e.num_pages)) for i, r in enumerate(e.ranks)}
        digest = draft_digest(e.draft)
        out.append((shards, e.token_start, e.token_end, e.first_token, e.num_pages, digest))
        step_until(engine, lambda p=p: p.finish_reason is not None, 120)
    return out


def decode_layout(
    engine: Engine, exports: list[tuple[dict[int, bytes], int, int, int, int, int]], sender: object
) -> list[tuple[int, list[int], list[tuple[int, int]]]]:
    """Runs on a decode engine: each turn's (prefix, tokens, verify rounds)."""
    out = []
    for (prompt, _), (shards, start, end, first, pages, digest) in zip(
        LAYOUT_TURNS, exports, strict=True
    ):
        d = engine.submit_decode(prompt, SP)
        step_until(engine, lambda d=d: d.remote is not None and d.remote.prefix_len >= 0, 120)
        assert d.remote is not None and d.remote.prefix_len == start
        for lo in range(0, pages, 3):
            hi = min(lo + 3, pages)
            for rank, shard in shards.items():
                per_page = len(shard) // pages
                t0, t1 = start + lo * PAGE, min(start + hi * PAGE, end)
                payload = shard[lo * per_page : hi * per_page]
                last = first if hi == pages else None
                engine.write_kv(d.rid, t0, t1, payload, last, rank, sender, 0, digest)  # type: ignore[arg-type]
        step_until(engine, lambda d=d: d.finish_reason is not None, 120)
        out.append((start, d.output_ids, list(d.spec_rounds)))
    engine.check_integrity()
    return out


def on_layout(parallel: ParallelConfig, workload: object, *args: object) -> object:
    cfg = layout_config(parallel)
    if parallel.world_size == 1:
        engine = Engine(cfg)
        try:
            return workload(engine, *args)  # type: ignore[operator]
        finally:
            engine.close()
    return run_world(cfg, workload, *args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("prefill", "decode"), [((1, 2), (1, 1)), ((2, 1), (1, 2))], ids=["PP2-to-TP1", "TP2-to-PP2"]
)
def test_draft_kv_is_cut_for_a_decode_engine_of_another_layout(
    prefill: tuple[int, int], decode: tuple[int, int]
) -> None:
    """The draft's rows are cut by its own heads and layers as the target's are: a PP2 or
    TP2 prefill engine feeds a TP1 or PP2 decode engine, whose `self` draft accepts every
    proposal and whose tokens equal a TP1 run without speculation."""
    sender, receiver = ParallelConfig(*prefill), ParallelConfig(*decode)
    cold = Engine(dataclasses.replace(layout_config(ParallelConfig(), None)))
    want = [cold.generate(prompt, SP).output_ids for prompt, _ in LAYOUT_TURNS]
    cold.close()
    exports = on_layout(sender, prefill_layout)
    got = on_layout(receiver, decode_layout, exports, sender)
    assert isinstance(got, list)
    for (prefix, ids, rounds), w, (_, start) in zip(got, want, LAYOUT_TURNS, strict=True):
        assert prefix == start and ids == w
        assert rounds and all(k == a for k, a in rounds), rounds


# 1460 KiB: two pages of the target's rows alone would fit a frame, not with the draft's
# (sized by the target's alone, such a chunk would go out split in parts)
@pytest.mark.parametrize("max_payload", [1460 << 10, 96 << 10], ids=["chunks", "split-pages"])
def test_frames_size_pages_with_the_drafts_rows_and_carry_them_whole(max_payload: int) -> None:
    """A chunk is sized by a page's bytes of both models, so frames stay within the limit
    with the draft's rows, and the shards put back together are `shard_bytes` exactly."""
    gen = torch.Generator().manual_seed(0)
    pages, ps = 5, 16
    target = torch.rand((pages, 3, 30, 2, ps, 1, 64), generator=gen)  # SmolLM2's shape
    draft = torch.rand((pages, 1, 4, 2, ps, 1, 64), generator=gen)  # a draft of another
    export = KVExport((target,), 0, pages * ps - 3, 42, draft_stagings=(draft,), draft="d")
    limit = payload_limit(max_payload, 1, 32 << 20)
    plan = cut_frames("r", export, CachedTokens(), 1, limit)
    assert all(len(f) <= max_payload for f in plan.frames)
    decoded = [decode_frame(f) for f in plan.frames]
    page_fits = export.page_bytes(0) <= limit  # then chunks of whole pages, never parts
    assert page_fits == (max_payload > 1 << 20)
    assert page_fits == all(h.part_offset == 0 for h, _ in decoded)
    assert {h.draft for h, _ in decoded} == {draft_digest("d")}
    assembler, got = ShardAssembler(), b""
    for header, payload in decoded:
        shard = assembler.add(header, payload)
        if shard is not None:
            got += bytes(shard)
            assembler.written(header)
    assert got == export.shard_bytes(0, slice(0, pages))
    assert len(got) == pages * (target[0].numel() + draft[0].numel()) * 4
