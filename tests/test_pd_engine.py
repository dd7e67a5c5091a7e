"""P/D at the engine level: a prefill engine exports KV past decode_prefix_len, a decode engine
restores its own prefix (device and host) and receives exactly the rest.

The bus is not involved here (tests/test_pd_mesh.py runs the same over NATS); this pins the
engine API the services drive: submit_decode / submit_prefill / write_kv. Engines are
batch-invariant float64, so P/D must reproduce the cold run's logits bit for bit: prefill's
step 0, decode's steps 1.. (`Req.logits_trace`).
"""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
import torch

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.cache.transfer import DelayInjection
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.scheduler.request import Req, ReqState

PAGE = 4
SP = SamplingParams(max_new_tokens=5, ignore_eos=True)


def engine(**cache: object) -> Engine:
    cfg = CacheConfig(page_size=PAGE, num_device_pages=256, **cache)  # type: ignore[arg-type]
    eng = Engine(EngineConfig(cache=cfg))
    eng.model.set_batch_invariant(True)
    return eng


def step_until(eng: Engine, done: object, timeout_s: float = 20.0) -> None:
    """Step until `done()`; transfers finish on other threads, so bound it by time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done():  # type: ignore[operator]
            return
        eng.step()
        time.sleep(0.0005)
    raise AssertionError("engine did not get there")


def run_pd(
    prefill: Engine, decode: Engine, prompt: list[int], pages_per_chunk: int = 2, reuse: bool = True
) -> tuple[Req, Req, int]:
    """One request through P/D; returns (decode req, prefill req, tokens moved)."""
    d = decode.submit_decode(prompt, SP, reuse=reuse)
    d.logits_trace = []
    step_until(decode, lambda: d.remote is not None and d.remote.prefix_len >= 0)
    assert d.remote is not None
    prefix_len = d.remote.prefix_len
    p = prefill.submit_prefill(prompt, SP, "", export_from=prefix_len)
    p.logits_trace = []
    step_until(prefill, lambda: p.export is not None)
    export = p.export
    assert export is not None and export.token_start == prefix_len
    moved = 0
    num_pages = export.staging.shape[0]
    for lo in range(0, num_pages, pages_per_chunk):
        hi = min(lo + pages_per_chunk, num_pages)
        start = prefix_len + lo * PAGE
        end = min(prefix_len + hi * PAGE, export.token_end)
        last = hi == num_pages
        payload = export.staging[lo:hi].contiguous().numpy().tobytes()
        decode.write_kv(d.rid, start, end, payload, export.first_token if last else None)
        moved += end - start
    step_until(decode, lambda: d.finish_reason is not None)
    return d, p, moved


def cold(prompts: list[list[int]]) -> list[list[int]]:
    return [ids for ids, _ in cold_traced(prompts)]


def cold_traced(prompts: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    """Cold tokens and each step's logits (steps, vocab), the radix cache off."""
    eng = engine(enable_radix_cache=False)
    out = []
    for prompt in prompts:
        req = eng.submit(prompt, SP)
        req.logits_trace = []
        (result,) = eng.run([req])
        out.append((result.output_ids, torch.stack(req.logits_trace)))
    return out


def assert_logits_equal_cold(d: Req, p: Req, cold_logits: torch.Tensor) -> None:
    """Prefill sampled step 0, decode the rest: together, the cold run's logits exactly."""
    assert p.logits_trace is not None and d.logits_trace is not None
    assert len(p.logits_trace) == 1
    steps = torch.stack(p.logits_trace + d.logits_trace)
    assert steps.shape == cold_logits.shape
    assert torch.equal(steps, cold_logits), f"max diff {(steps - cold_logits).abs().max():.3g}"


def held_prefix(prompt: list[int], held: list[list[int]]) -> int:
    """Page-aligned longest common prefix of prompt[:-1] with any held sequence."""
    best = 0
    for seq in held:
        n = 0
        for a, b in zip(prompt[:-1], seq, strict=False):
            if a != b:
                break
            n += 1
        best = max(best, n - n % PAGE)
    return best


def conversation(seed: int = 3, turns: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    prompt = [rng.randrange(256) for _ in range(37)]
    prompts = [prompt]
    for _ in range(turns - 1):
        prompt = prompt + [rng.randrange(256) for _ in range(11)]
        prompts.append(prompt)
    return prompts


@pytest.mark.parametrize("reuse", [True, False])
def test_pd_outputs_equal_cold_and_move_only_the_suffix(reuse: bool) -> None:
    prompts = conversation()
    want = cold_traced(prompts)
    prefill = engine(enable_hierarchical_cache=True)
    decode = engine(enable_hierarchical_cache=True)
    outs: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        d, p, moved = run_pd(prefill, decode, prompt, reuse=reuse)
        assert d.output_ids == want[i][0]
        assert_logits_equal_cold(d, p, want[i][1])
        assert d.remote is not None
        assert moved == len(prompt) - d.remote.prefix_len
        assert d.remote.prefix_len % PAGE == 0
        # decode holds earlier prompts + outputs (all but the last token); prefill the prompts
        decode_held = [prompts[j] + outs[j][:-1] for j in range(i)]
        assert d.remote.prefix_len == (held_prefix(prompt, decode_held) if reuse else 0)
        assert p.cached.total == held_prefix(prompt, prompts[:i])
        outs.append(d.output_ids)
    for eng in (prefill, decode):
        eng.cache.drain()
        eng.check_integrity()


def test_decode_prefix_includes_host_hits() -> None:
    prompts = conversation(seed=9, turns=2)
    want = cold_traced(prompts)
    prefill = engine()
    decode = engine(enable_hierarchical_cache=True)
    run_pd(prefill, decode, prompts[0])
    decode.cache.drain()
    decode.cache.evict_device(decode.cache.tree.num_device_pages)  # history now host-only
    d, p, moved = run_pd(prefill, decode, prompts[1])
    assert d.output_ids == want[1][0]
    assert_logits_equal_cold(d, p, want[1][1])
    assert d.cached.host > 0 and d.cached.device == 0
    assert d.remote is not None and d.remote.prefix_len == d.cached.host
    assert moved == len(prompts[1]) - d.remote.prefix_len


def test_failed_restore_fails_the_decode_request_with_409_and_frees_pages() -> None:
    prompts = conversation(seed=5, turns=2)
    decode = engine(enable_hierarchical_cache=True, debug_fail_loads=1)
    prefill = engine()
    run_pd(prefill, decode, prompts[0])
    decode.cache.drain()
    decode.cache.evict_device(decode.cache.tree.num_device_pages)
    baseline = decode.cache.num_free_device_pages
    d = decode.submit_decode(prompts[1], SP)
    step_until(decode, lambda: d.finish_reason is not None)
    assert d.error is not None and d.error.code == 409
    decode.cache.drain()
    assert decode.cache.num_free_device_pages == baseline
    decode.check_integrity()
    # the router's retry: no reuse, everything moves
    d2, _, moved = run_pd(prefill, decode, prompts[1], reuse=False)
    assert d2.output_ids == cold(prompts)[1] and moved == len(prompts[1])


def test_local_request_computes_what_a_failed_load_could_not_restore() -> None:
    prompts = conversation(seed=4, turns=2)
    eng = engine(enable_hierarchical_cache=True, debug_fail_loads=1)
    eng.generate(prompts[0], SP)
    eng.cache.drain()
    eng.cache.evict_device(eng.cache.tree.num_device_pages)
    out = eng.generate(prompts[1], SP)
    assert out.output_ids == cold(prompts)[1]
    assert out.cached.host == 0
    eng.cache.drain()
    eng.check_integrity()


def test_write_kv_rejects_chunks_that_do_not_fit() -> None:
    decode = engine()
    prompt = list(range(30))
    d = decode.submit_decode(prompt, SP)
    step_until(decode, lambda: d.remote is not None and d.remote.prefix_len >= 0)
    page_bytes = 4 * 2 * PAGE * 2 * 16 * 8  # layers, K/V, tokens, kv heads, head_dim, float64
    with pytest.raises(ValueError, match="bytes"):  # the wrong size: refused at once
        decode.write_kv(d.rid, 0, 4, b"\0" * (page_bytes - 1), None)
    # a chunk that does not fit the request's state: the command says why after the step
    gap = decode.write_kv(d.rid, 8, 12, b"\0" * page_bytes, None)
    unknown = decode.write_kv(999, 0, 4, b"\0" * page_bytes, None)
    decode.step()
    assert gap.error is not None and "continue" in gap.error and gap.written == 0
    assert unknown.error is not None and "no P/D decode request" in unknown.error
    assert d.state is ReqState.RECEIVING
    decode.abort(d.rid)
    step_until(decode, lambda: d.finish_reason is not None)
    assert decode.cache.num_free_device_pages == 256


def test_seeded_sampling_through_pd_equals_colocated() -> None:
    """Prefill draws token 0, decode the rest: seeded draws depend on (seed, step) only."""
    prompt = conversation(seed=8, turns=1)[0]
    sp = SamplingParams(max_new_tokens=8, temperature=1.3, top_p=0.9, seed=7, ignore_eos=True)
    colocated = engine().generate(prompt, sp).output_ids
    prefill, decode = engine(), engine()
    d = decode.submit_decode(prompt, sp)
    step_until(decode, lambda: d.remote is not None and d.remote.prefix_len >= 0)
    p = prefill.submit_prefill(prompt, sp, "", export_from=0)
    step_until(prefill, lambda: p.export is not None)
    assert p.export is not None
    payload = p.export.staging.contiguous().numpy().tobytes()
    decode.write_kv(d.rid, 0, len(prompt), payload, p.export.first_token)
    step_until(decode, lambda: d.finish_reason is not None)
    assert d.output_ids == colocated
    other = engine().generate(prompt, dataclasses.replace(sp, seed=8)).output_ids
    assert other != colocated  # the seed matters


def test_decode_waits_for_its_restore_ack_before_generating() -> None:
    """DESIGN.md 6.4 and invariant 3: decode starts generating only when its host-tier restore
    is complete, i.e. its load ACK is consumed, even when every KV chunk from prefill arrived
    long before. The restore is slowed by injected transfer delays and the read guard is on:
    a decode step that read the restoring pages would raise."""
    prompts = conversation(seed=6, turns=2)
    want = cold_traced(prompts)
    prefill = engine()
    decode = engine(
        enable_hierarchical_cache=True,
        transfer_delay=DelayInjection(max_ms=1500, seed=4),  # the restore sleeps 0.59 s
        check_reads=True,
    )
    run_pd(prefill, decode, prompts[0])
    decode.cache.drain()
    decode.cache.evict_device(decode.cache.tree.num_device_pages)  # history now host-only

    # prefill first, so that its KV can be written the moment decode admits the request
    prefix_len = decode.cache.match(prompts[1]).host_len
    p = prefill.submit_prefill(prompts[1], SP, "", export_from=prefix_len)
    p.logits_trace = []
    step_until(prefill, lambda: p.export is not None)
    assert p.export is not None and prefix_len > 0
    payload = p.export.staging.contiguous().numpy().tobytes()

    d = decode.submit_decode(prompts[1], SP)
    d.logits_trace = []
    decode.step()  # admits it and starts the restore
    ticket = d.load
    assert ticket is not None and d.remote is not None
    assert d.remote.prefix_len == d.cached.host == prefix_len
    decode.write_kv(d.rid, p.export.token_start, p.export.token_end, payload, p.export.first_token)
    assert not ticket.done  # reception is complete, the restore is not

    started_with_ack: list[bool] = []  # per step that produced tokens: was the ACK consumed?
    deadline = time.monotonic() + 20
    while d.finish_reason is None:
        assert time.monotonic() < deadline, "decode did not finish"
        decode.step()  # the read guard raises if attention reads a page still restoring
        if d.output_ids:
            started_with_ack.append(ticket.done)
        time.sleep(0.001)
    assert started_with_ack and all(started_with_ack)
    assert d.error is None and d.output_ids == want[1][0]
    assert_logits_equal_cold(d, p, want[1][1])
    decode.cache.drain()
    decode.check_integrity()
