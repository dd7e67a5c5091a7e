"""The MLA variant of the tiny model (issue 10, build point 4 and acceptance 2).

`tiny-mla` caches one latent row per token and layer (`ModelConfig`, `mla.MLAttention`),
the same on every TP rank. Checked here:
- the model against a naive MLA written from its weights, chunked and whole;
- MLA pages through every host layout and the relayout path, bit for bit, and a page's
  unified object in the MLA order (layer, token_in_page, dim);
- TP2 and PP2 worlds against TP1 through cold, device-hit, host-hit, second-turn and
  flushed phases (`test_multirank_oracle`'s workload): PP bit-exact, TP within 1e-10; and
  on each layout the hit phases' logits bit-identical to the cold (cache-off) ones;
- the acceptance: a TP2 engine writes a conversation's KV through to a `file` store with
  the unified keys: per page one object per layer range, no `_H`, written by TP rank 0
  alone; a fresh TP1 engine and a fresh TP2 engine serve it from the store with the cold
  run's float64 logits (bit for bit on the same layout, within 1e-10 across TP);
- P/D: a TP1 prefill feeds a TP2 decode and a TP2 prefill a PP2 decode (every TP rank of
  a stage sends and takes the same latent rows).
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
from pathlib import Path
from unittest import mock

import pytest
import torch
from multirank import run_world
from test_multirank_oracle import GREEDY as ORACLE_SP
from test_multirank_oracle import PHASES, make_prompts, workload
from test_multirank_oracle import config as oracle_config
from test_pd_layouts import (
    CHUNK_PAGES,
    DECODE_PREFIX,
    TURN1,
    TURN2,
    decode_turns,
    prefill_turns,
)
from test_pd_layouts import SP as PD_SP

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.cache.storage_io import StorageFaults
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.engine.storage_setup import storage_layout
from gpu_worker.kernels.moves import PoolView, move_pages
from gpu_worker.kernels.relayout import RunView
from gpu_worker.memory.device_pool import DeviceKVPool
from gpu_worker.memory.host_pool import ALL_LAYOUTS, HostKVPool
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.model.config import PRESETS
from gpu_worker.model.forward_batch import ForwardBatch
from gpu_worker.model.layers import rope_tables
from gpu_worker.model.llama import LlamaModel
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.model.weights import build_model
from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.storage import StorageBackend
from gpu_worker.storage.file import file_size

pytestmark = pytest.mark.timeout(400)

MODEL = "tiny-mla"
PAGE = 4
LATENT = 20  # kv_lora_rank 16 + qk_rope_head_dim 4
SP = SamplingParams(max_new_tokens=3, ignore_eos=True)
CPU = torch.device("cpu")
KEY = re.compile(r"^[0-9a-f]{32}_[0-9a-f]{16}_L(\d+)-(\d+)$")  # unified, MLA: no _H


# ---------------------------------------------------------------- the model


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, ..., R) by cos/sin (T, R), rotate-half layout."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.view(shape) + torch.cat([-x2, x1], dim=-1) * sin.view(shape)


def naive_logits(model: LlamaModel, tokens: list[int]) -> torch.Tensor:
    """The last token's logits, every position recomputed from the weights (no cache)."""
    cfg = model.config
    T, H, D, R, C = len(tokens), cfg.num_heads, cfg.head_dim, cfg.rope_dim, cfg.kv_lora_rank
    cos, sin = rope_tables(R, T, cfg.rope_theta)  # (T, R)
    assert model.embed_tokens is not None and model.norm is not None
    h = model.embed_tokens.weight[torch.tensor(tokens)]  # (T, hidden)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for layer in model.layers:
        a, eps = layer.self_attn, cfg.rms_norm_eps
        x = _rms(h, layer.input_layernorm.weight, eps)
        q = (x @ a.q_proj.weight.T).view(T, H, D + R)
        ckv = x @ a.kv_a_proj.weight.T  # (T, C + R)
        c = _rms(ckv[:, :C], a.kv_a_layernorm.weight, eps)  # (T, C)
        k_rope = _rotate(ckv[:, C:], cos, sin)  # (T, R): one for every head
        k = (c @ a.k_b_proj.weight.T).view(T, H, D)
        v = (c @ a.v_b_proj.weight.T).view(T, H, D)
        scores = torch.einsum("qhd,khd->hqk", q[..., :D], k) + torch.einsum(
            "qhr,kr->hqk", _rotate(q[..., D:], cos, sin), k_rope
        )  # (H, T, T)
        scores = (scores / math.sqrt(D + R)).masked_fill(~causal, float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, H * D)
        h = h + out @ a.o_proj.weight.T
        x = _rms(h, layer.post_attention_layernorm.weight, eps)
        mlp = layer.mlp
        gate = torch.nn.functional.silu(x @ mlp.gate_proj.weight.T)
        h = h + (gate * (x @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    return model.compute_logits(_rms(h[-1:], model.norm.weight, cfg.rms_norm_eps))[0]


def test_tiny_mla_is_the_documented_latent_attention() -> None:
    config, model = build_model(MODEL, CPU, torch.float64, batch_invariant=True)
    assert (config.num_kv, config.kv_head_dim, config.num_heads % 4) == (1, LATENT, 0)
    tokens = [(37 * i + 11) % 256 for i in range(23)]
    want = naive_logits(model, tokens)
    spec = KVSpec(config.num_layers, 1, LATENT, PAGE, torch.float64, num_kv=1)
    for chunks in ([23], [9, 6, 8], [20, 1, 1, 1]):
        pool = DeviceKVPool(spec, 8, CPU)
        slots = pool.slot_ids([5, 2, 7, 0, 3, 1], len(tokens))  # scattered pages
        done = 0
        for n in chunks:
            batch = ForwardBatch.build([(tokens[done : done + n], done, slots[: done + n])], CPU)
            logits = model(batch, pool)[0]
            done += n
        assert (logits - want).abs().max().item() < 1e-12, chunks
    # the latent, not K and V, is what the pool holds: one row of 20 per token and layer
    assert pool.kv.shape == (config.num_layers, 1, 8 * PAGE, 1, LATENT)
    assert bool(pool.kv[:, :, slots].ne(0).all())


# ---------------------------------------------------------------- pages


@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_mla_pages_round_trip_through_every_host_layout(layout: str) -> None:
    spec = KVSpec(8, num_kv_heads=1, head_dim=LATENT, page_size=PAGE, dtype=torch.float64, num_kv=1)
    src, dst = DeviceKVPool(spec, 6, CPU), DeviceKVPool(spec, 6, CPU)
    src.kv.copy_(torch.randn(src.kv.shape, dtype=torch.float64))
    host = HostKVPool(spec, 5, layout, CPU)  # type: ignore[arg-type]
    assert spec.bytes_per_page == 8 * PAGE * LATENT * 8
    assert host.kv.numel() * 8 == 5 * spec.bytes_per_page

    def views(pool: DeviceKVPool) -> tuple[PoolView, PoolView]:
        h = host.page_view()
        return (pool.run_view(1) if isinstance(h, RunView) else pool.page_view()), h

    device_pages, host_pages, back = [4, 1, 5], [2, 0, 4], [0, 3, 2]
    d, h = views(src)
    move_pages(d, h, torch.tensor(device_pages), torch.tensor(host_pages))
    d, h = views(dst)
    move_pages(h, d, torch.tensor(host_pages), torch.tensor(back))
    for a, b in zip(device_pages, back, strict=True):
        page = src.kv[:, :, a * PAGE : (a + 1) * PAGE]  # (layers, 1, token, 1, latent)
        assert torch.equal(dst.kv[:, :, b * PAGE : (b + 1) * PAGE], page)
    if layout == "page_unified":  # a page's one object: (layer, token_in_page, dim)
        obj = host.kv[host_pages[0], 0]  # (layers, 1, token, 1, latent)
        slots = slice(device_pages[0] * PAGE, (device_pages[0] + 1) * PAGE)
        assert torch.equal(obj.reshape(8, PAGE, LATENT), src.kv[:, 0, slots, 0])


# ---------------------------------------------------------------- TP and PP


@pytest.fixture(scope="module")
def oracle_prompts() -> list[list[int]]:
    return make_prompts()[:6]


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["TP2", "PP2"])
def test_tp2_and_pp2_equal_tp1(oracle_prompts: list[list[int]], tp: int, pp: int) -> None:
    multi = dataclasses.replace(oracle_config(tp, pp, "write_through"), model=MODEL)
    single = Engine(dataclasses.replace(multi, parallel=ParallelConfig()))
    want = workload(single, oracle_prompts)
    single.close()
    got = run_world(multi, workload, oracle_prompts)
    hits = {phase: [0, 0] for phase in PHASES}
    for (phase, w_out, w_dev, w_host, w_logits), (_, out, dev, host, logits) in zip(
        want, got, strict=True
    ):
        assert (out, dev, host) == (w_out, w_dev, w_host), phase
        diff = (logits - w_logits).abs().max().item()
        assert diff == 0 if tp == 1 else diff < 1e-10, f"{phase}: logits differ by {diff:.3g}"
        hits[phase][0] += dev
        hits[phase][1] += host
    assert hits["cold"] == [0, 0] and hits["flushed"] == [0, 0]
    assert hits["device"][0] > 0 and hits["host"][1] > 0 and sum(hits["turn2"]) > 0
    assert len({tuple(out) for _, out, *_ in want}) > len(oracle_prompts) // 2  # varied
    # a hit never changes the logits: TP1's cold phase is a cache-off run's, bit for bit,
    # and on each layout the hit phases repeat its cold phase's logits bit for bit
    off = cold(oracle_prompts, ORACLE_SP)
    assert all(torch.equal(c[4], o[1]) for c, o in zip(want, off, strict=False))
    for run in (want, got):
        by_phase: dict[str, list[torch.Tensor]] = {}
        for phase, *_, logits in run:
            by_phase.setdefault(phase, []).append(logits)
        for phase in ("device", "host", "flushed"):
            for logits, first in zip(by_phase[phase], by_phase["cold"], strict=False):
                assert torch.equal(logits, first), f"{phase}: a cache hit changed the logits"


# ---------------------------------------------------------------- storage (acceptance 2)


def conversation() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(256) for _ in range(rng.randint(30, 45))] for _ in range(4)]


def storage_config(directory: Path, tp: int, **cache: object) -> EngineConfig:
    kw: dict[str, object] = dict(
        page_size=PAGE,
        num_device_pages=96,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(directory),
        hicache_storage_prefetch_policy="wait_complete",
        hicache_storage_key_scheme="unified",
        storage_layer_partition=4,
    )
    kw.update(cache)
    return EngineConfig(
        model=MODEL,
        cache=CacheConfig(**kw),  # type: ignore[arg-type]
        parallel=ParallelConfig(tp, 1),
        batch_invariant=True,
    )


def serve(engine: Engine, prompts: list[list[int]]) -> list[tuple[list[int], int, torch.Tensor]]:
    """(output ids, tokens from storage, logits) per prompt, once written through."""
    reqs = [engine.submit(p, SP) for p in prompts]
    for r in reqs:
        r.logits_trace = []
    outs = engine.run(reqs)
    engine.drain()  # every rank's writes to the store are done
    return [
        (o.output_ids, o.cached.storage, torch.stack(r.logits_trace or []))
        for o, r in zip(outs, reqs, strict=True)
    ]


def cold(
    prompts: list[list[int]], sampling: SamplingParams = SP
) -> list[tuple[list[int], torch.Tensor]]:
    """TP1 with the cache off: (output ids, logits) per prompt."""
    cache = CacheConfig(page_size=PAGE, enable_radix_cache=False)
    engine = Engine(EngineConfig(model=MODEL, cache=cache, batch_invariant=True))
    reqs = [engine.submit(p, sampling) for p in prompts]
    for r in reqs:
        r.logits_trace = []
    outs = engine.run(reqs)
    engine.close()
    return [
        (o.output_ids, torch.stack(r.logits_trace or [])) for o, r in zip(outs, reqs, strict=True)
    ]


def stored(directory: Path) -> set[str]:
    return {p.name for p in directory.glob("*/*") if p.is_file()}


@pytest.mark.parametrize("scheme", ["rank-suffix", "unified"])
def test_tp_rank_0_of_each_stage_writes_what_every_tp_rank_reads(
    tmp_path: Path, scheme: str
) -> None:
    config = dataclasses.replace(
        storage_config(tmp_path, 2, hicache_storage_key_scheme=scheme),
        parallel=ParallelConfig(2, 2),
    )
    spec = KVSpec(4, 1, LATENT, PAGE, torch.float64, num_kv=1)  # one stage's layers
    host = HostKVPool(spec, 2, "page_unified" if scheme == "unified" else "page_first", CPU)
    keys = {}
    for rank in range(4):  # (pp, tp): (0, 0), (0, 1), (1, 0), (1, 1)
        codec = storage_layout(config, PRESETS[MODEL], rank).codec(host)
        keys[rank] = codec.keys([bytes(16)])
        backend = mock.Mock(spec=StorageBackend)
        backend.put.return_value = len(keys[rank])
        assert codec.write(backend, keys[rank], [1]) == len(keys[rank])
        assert backend.put.called == (rank % 2 == 0), rank  # TP rank 0 alone writes
    assert keys[0] == keys[1] != keys[2] == keys[3]  # a stage's TP ranks read one object set
    if scheme == "unified":  # the stage's one layer range (partition 4), no head group
        assert [k[33:].split("_")[1] for k in keys[0] + keys[2]] == ["L0-3", "L4-7"]
        assert not any("_H" in k for k in keys[0] + keys[2])
    else:
        assert [k[33:] for k in keys[0] + keys[2]] == ["tp0of2pp0of2", "tp0of2pp1of2"]


def test_mla_kv_is_written_once_and_read_by_tp1_and_tp2(tmp_path: Path) -> None:
    prompts = conversation()
    first = prompts[:3]
    want = cold(prompts)

    wrote = run_world(storage_config(tmp_path, 2), serve, first)
    for (ids, from_store, logits), (w_ids, w_logits) in zip(wrote, want, strict=False):
        assert ids == w_ids and from_store == 0
        assert (logits - w_logits).abs().max().item() < 1e-10  # TP2 vs TP1
    objects = stored(tmp_path)
    ranges = {tuple(int(x) for x in KEY.match(name).groups()) for name in objects}  # type: ignore[union-attr]
    assert ranges == {(0, 3), (4, 7)}  # one object per layer range, no head group
    pages = {name[:32] for name in objects}
    assert len(objects) == 2 * len(pages)  # each page: exactly its 2 objects
    assert len(pages) == sum((len(p) + SP.max_new_tokens - 1) // PAGE for p in first)
    payload = 4 * PAGE * LATENT * 8  # (4 layers, 4 tokens, 20) float64
    assert all(p.stat().st_size == file_size(p.name, payload) for p in tmp_path.glob("*/*"))

    engine = Engine(storage_config(tmp_path, 1))  # a fresh TP1 engine: both ranges
    tp1 = serve(engine, first)
    engine.close()
    for (ids, from_store, logits), (w_ids, w_logits), p in zip(tp1, want, first, strict=False):
        assert ids == w_ids and from_store == (len(p) - 1) // PAGE * PAGE
        # TP2 wrote the KV: its all_reduce added in another order than TP1's matmul
        assert (logits - w_logits).abs().max().item() < 1e-10
    assert stored(tmp_path) == objects  # TP1 names the same objects

    # A fresh TP2 engine whose rank 0 cannot write: the prompt it adds gets no objects,
    # so TP rank 1 writes none (it reads rank 0's).
    faults = StorageFaults(fail_write_rank=0)
    tp2 = run_world(storage_config(tmp_path, 2, storage_faults=faults), serve, prompts)
    for (ids, _, logits), (w_ids, w_logits) in zip(tp2, want, strict=True):
        assert ids == w_ids and (logits - w_logits).abs().max().item() < 1e-10
    for (_, from_store, logits), (*_, w_tp2), p in zip(tp2, wrote, first, strict=False):
        assert from_store == (len(p) - 1) // PAGE * PAGE
        assert torch.equal(logits, w_tp2)  # the writer's layout: bit for bit
    assert tp2[3][1] == 0 and stored(tmp_path) == objects  # the new prompt: nothing stored


# ---------------------------------------------------------------- P/D


def on(parallel: ParallelConfig, workload: object, *args: object) -> object:
    """Run `workload` on a tiny-mla P/D engine of `parallel`: here for TP1, else a world."""
    cache = CacheConfig(page_size=PAGE, num_device_pages=128, enable_hierarchical_cache=True)
    cfg = EngineConfig(model=MODEL, cache=cache, parallel=parallel, batch_invariant=True)
    if parallel.world_size == 1:
        engine = Engine(cfg)
        try:
            return workload(engine, *args)  # type: ignore[operator]
        finally:
            engine.close()
    return run_world(cfg, workload, *args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [((1, 1), (2, 1)), ((2, 1), (1, 2))],
    ids=["TP1-to-TP2", "TP2-to-PP2"],
)
def test_pd_moves_the_latent_across_layouts(
    prefill: tuple[int, int], decode: tuple[int, int]
) -> None:
    """Only TP rank 0 of each stage exports the stage's latent rows (the other TP ranks hold
    copies); every decode TP rank writes them. Logits as a cold TP1 run's (TP: within
    1e-10)."""
    sender, receiver = ParallelConfig(*prefill), ParallelConfig(*decode)
    want = cold([TURN1, TURN2], PD_SP)
    exports = on(sender, prefill_turns, [(TURN1, DECODE_PREFIX[0]), (TURN2, DECODE_PREFIX[1])])
    assert isinstance(exports, list)
    assert sorted(exports[0][0]) == [s * sender.tp_size for s in range(sender.pp_size)]
    got = on(receiver, decode_turns, list(zip((TURN1, TURN2), exports, strict=True)), sender)
    assert isinstance(got, list)
    for (w_ids, w_logits), export, (prefix, ids, logits, received) in zip(
        want, exports, got, strict=True
    ):
        assert ids == w_ids
        steps = torch.cat([export[5], logits])
        assert (steps - w_logits).abs().max().item() < 1e-10
        pages = -(-(export[2] - prefix) // PAGE)
        layers = 8 // receiver.pp_size  # decode rank 0's shard: its layers' latent rows
        assert export[4] == pages and received == pages * layers * PAGE * LATENT * 8
    assert exports[0][4] > CHUNK_PAGES  # the first turn came in several chunks


def test_a_latent_shard_from_a_tp_rank_other_than_0_is_refused() -> None:
    """MLA's KV crosses the wire once per stage (`ParallelConfig.kv_ranks`): a frame from
    another TP rank is a sender bug, refused before anything is written."""
    assert ParallelConfig(2, 2).kv_ranks(replicated=True) == (0, 2)
    assert ParallelConfig(2, 2).kv_ranks(replicated=False) == (0, 1, 2, 3)

    def workload(engine: Engine) -> None:
        with pytest.raises(ValueError, match=r"rank 1: its latent is TP rank 0's"):
            engine.write_kv(0, 0, PAGE, b"", None, 1, ParallelConfig(2, 1))

    on(ParallelConfig(), workload)


def test_prefill_frames_carry_the_exported_ranks_in_the_whole_world() -> None:
    """The P/D service frames a TP2 x PP2 MLA export as the shards of world ranks 0 and 2
    of a world of 4 (so the decode side knows the layout to cut), chunk by chunk."""
    from bus_schemas.kv_frame import HEADER_SIZE, decode_frame
    from gpu_worker.scheduler.request import CachedTokens, KVExport
    from services.engine.pd import PDConfig
    from services.engine.pd_prefill import PrefillSide

    page_bytes = 4 * PAGE * LATENT * 4  # one page of a stage's latent: 4 layers, float32
    side = PrefillSide(
        "prefill-0",
        mock.Mock(),
        mock.AsyncMock(),
        PDConfig(frame_bytes=HEADER_SIZE + 2 * page_bytes + 100),  # two pages a frame
        mock.Mock(),
        mock.Mock(),
        mock.Mock(),
        tp_size=2,
        max_payload=lambda: 8 << 20,
    )
    stage = torch.arange(3 * 4 * PAGE * LATENT, dtype=torch.float32)
    stagings = tuple(stage.view(3, 1, 4, 1, PAGE, 1, LATENT) + s for s in (0, 1))
    export = KVExport(stagings, 0, 3 * PAGE, 7, ranks=(0, 2), world_size=4)
    frames = [decode_frame(f) for f in side.plan("r", export, CachedTokens()).frames]
    got = [(h.seq, h.rank, h.world_size, h.tp_size, h.token_start, h.token_end) for h, _ in frames]
    assert got == [
        (0, 0, 4, 2, 0, 2 * PAGE),
        (1, 2, 4, 2, 0, 2 * PAGE),
        (2, 0, 4, 2, 2 * PAGE, 3 * PAGE),
        (3, 2, 4, 2, 2 * PAGE, 3 * PAGE),
    ]
    assert bytes(frames[3][1]) == stagings[1][2:].numpy().tobytes()
