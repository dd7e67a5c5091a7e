"""Prefill/decode disaggregation in the router, over real HTTP, against scripted prefill and
decode engines (tests/fake_engine.py) on a real nats-server and a real Redis."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis
from fake_engine import (
    KV_BYTES_PER_TOKEN,
    FakeEngine,
    Mesh,
    expected_tokens,
    read_sse,
    running_mesh,
)
from test_router import metric, set_load, text_of, wait_until

from bus_schemas import page_hashes, redis_keys, subjects
from router.disagg import retry_kind
from router.keys import REPLIES, TABLE
from router.stream import EngineFailure
from services.launch.servers import ServerProcess

pytestmark = pytest.mark.timeout(60)

PROMPT = "hello world, this is a test prompt"  # 34 byte tokens
IDS = list(PROMPT.encode())
PD = ("prefill", "decode")


def disagg(
    mesh: Mesh, prefix_len: int, pre_dev: int, pre_host: int, dec_dev: int
) -> dict[str, Any]:
    """The `usage.disaggregation` the fakes produce for PROMPT (one prefill, one decode)."""
    moved = len(IDS) - prefix_len
    return {
        "prefill_engine": mesh.prefills[0].engine_id,
        "decode_engine": mesh.decodes[0].engine_id,
        "decode_prefix_len": prefix_len,
        "transferred_tokens": moved,
        "transferred_bytes": moved * KV_BYTES_PER_TOKEN,
        "prefill_cached_device": pre_dev,
        "prefill_cached_host": pre_host,
        "prefill_cached_storage": 0,
        "decode_cached_device": dec_dev,
        "decode_cached_host": prefix_len - dec_dev,
    }


def no_generate_requests(mesh: Mesh) -> bool:
    return all(not e.received for e in (*mesh.prefills, *mesh.decodes))


# ------------------------------------------------------------------ pure pieces


def test_retry_kind_by_failure() -> None:
    def f(kind: str, engine: str = "d", chunks: int = 0) -> EngineFailure:
        return EngineFailure(kind, engine, "x", chunks)

    assert retry_kind(f("restore_failed"), "p") == "restore"
    assert retry_kind(f("transfer_timeout"), "p") == "prefill"
    assert retry_kind(f("lost", "p"), "p") == "prefill"
    assert retry_kind(f("engine_error", "p"), "p") == "prefill"
    assert retry_kind(f("lost"), "p") == "decode"
    assert retry_kind(f("unavailable"), "p") == "decode"
    assert retry_kind(f("bus"), "p") == retry_kind(f("bus", "p"), "p") == "bus"
    assert retry_kind(f("bus", chunks=1), "p") is None
    assert retry_kind(f("rejected"), "p") is None  # a bad request: never retried
    assert retry_kind(f("rejected", "p"), "p") is None
    assert retry_kind(f("restore_failed", chunks=1), "p") is None  # the client saw output
    assert retry_kind(f("engine_crashed"), "p") is None  # it may have crashed the engine
    assert retry_kind(f("engine_crashed", "p"), "p") is None


# ------------------------------------------------------------------ serving


async def test_pd_path_when_both_roles_are_live(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    roles = ("colocated", *PD)
    async with running_mesh(nats_server.url, redis_server.url, roles=roles) as mesh:
        (col,), (pre,), (dec,) = mesh.colocated, mesh.prefills, mesh.decodes
        pre.cached_device, pre.cached_host = 12, 4
        dec.cached_device = 10  # cut to 8: whole pages of 4
        want_pd = disagg(mesh, 8, 12, 4, 8)
        r = await mesh.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5})
        assert r.status == 200, await r.text()
        assert r.headers["X-Hicache-Engine"] == dec.engine_id
        assert r.headers["X-Hicache-Prefill-Engine"] == pre.engine_id
        body = await r.json()
        want = expected_tokens(IDS, 5)
        assert body["choices"][0]["token_ids"] == want
        assert body["choices"][0]["text"] == text_of(want)
        assert body["usage"]["prompt_tokens_details"] == {
            "cached_tokens": 8,  # the decode engine's own reuse: KV that did not move
            "cached_tokens_by_tier": {"device": 8, "host": 0, "storage": 0},
        }
        assert body["usage"]["disaggregation"] == want_pd
        (admit,) = dec.admits
        assert admit.input_ids.tolist() == IDS and admit.sampling.max_new_tokens == 5
        assert admit.reuse is True and admit.transfer_timeout_s == mesh.config.transfer_timeout_s
        (prefill,) = pre.prefills
        assert prefill.request_id == admit.request_id == body["id"].removeprefix("cmpl-")
        assert prefill.decode_prefix_len == 8 and prefill.input_ids.tolist() == IDS
        assert prefill.kv_subject == subjects.engine_kv(dec.engine_id)
        assert prefill.reply_to != admit.reply_to
        assert col.received == [] and no_generate_requests(mesh)

        # streaming: the usage chunk (asked for) carries the same dict
        body_s = {"prompt": PROMPT, "max_tokens": 5, "stream": True}
        body_s["stream_options"] = {"include_usage": True}
        r = await mesh.client.post("/v1/completions", json=body_s)
        assert r.headers["X-Hicache-Prefill-Engine"] == pre.engine_id
        events, done = await read_sse(r)
        assert done and events[-1]["choices"] == []
        assert [t for e in events[:-1] for t in e["choices"][0]["token_ids"]] == want
        assert events[-1]["usage"]["disaggregation"] == want_pd
        assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 8

        # /generate: meta_info.disaggregation, streaming or not
        for stream in (False, True):
            r = await mesh.client.post("/generate", json={"text": PROMPT, "stream": stream})
            events = (await read_sse(r))[0] if stream else [await r.json()]
            meta = events[-1]["meta_info"]
            assert meta["disaggregation"] == want_pd and meta["engine_id"] == dec.engine_id
            assert meta["cached_tokens"] == 8 and meta["finish_reason"] == "length"

        assert col.received == [] and no_generate_requests(mesh)
        assert await metric(mesh, "hicache_router_pd_requests_total") == 4
        assert await metric(mesh, "hicache_router_pd_transferred_tokens_total") == 4 * 26
        assert await metric(mesh, "hicache_router_pd_transferred_bytes_total") == 4 * 26 * 8
        assert await metric(mesh, "hicache_router_cached_tokens_total", 'tier="device"') == 32
        # each engine's hit rate is its own cache's: prefill skipped 16 of 34 prompt tokens,
        # decode reused 8 (the prefill engine's used to read 0)
        text = await (await mesh.client.get("/metrics")).text()
        for engine, cached in ((pre, 16), (dec, 8)):
            (line,) = [
                line
                for line in text.splitlines()
                if line.startswith("sglang:cache_hit_rate{")
                and f'engine_id="{engine.engine_id}"' in line
            ]
            assert float(line.rsplit(" ", 1)[1]) == cached / len(IDS), line

        # without a live prefill engine the colocated one serves, never the decode engine
        pre.silent = True
        await wait_until(lambda: len(mesh.client.app[TABLE].live()) == 2)
        r = await mesh.client.post("/generate", json={"text": PROMPT})
        assert r.status == 200 and (await r.json())["meta_info"]["engine_id"] == col.engine_id
        assert "disaggregation" not in (await r.json())["meta_info"]
        assert len(col.received) == 1 and no_generate_requests(mesh) and len(dec.admits) == 4


async def test_pd_routing_uses_each_engines_own_cache(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    roles = (*PD, *PD)
    async with running_mesh(nats_server.url, redis_server.url, roles=roles) as mesh:
        _, pre_b = mesh.prefills
        dec_a, _ = mesh.decodes
        hashes = page_hashes(IDS, 4, pre_b.namespace)
        r = aioredis.Redis.from_url(redis_server.url)
        try:
            for h in hashes[:3]:
                await r.hset(redis_keys.page(h), pre_b.engine_id, 1)
            for h in hashes[:5]:
                await r.hset(redis_keys.page(h), dec_a.engine_id, 2)
            for _ in range(3):
                resp = await mesh.client.post("/v1/completions", json={"prompt": PROMPT})
                assert resp.status == 200
                assert resp.headers["X-Hicache-Engine"] == dec_a.engine_id
                assert resp.headers["X-Hicache-Prefill-Engine"] == pre_b.engine_id
            assert (
                await metric(mesh, "hicache_router_routing_decisions_total", 'reason="cache"') == 6
            )  # one decision per role
        finally:
            for h in hashes:
                await r.delete(redis_keys.page(h))
            await r.aclose()


async def test_stop_string_aborts_the_decode_engine(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    kw = {"token_delay_s": 0.01}
    async with running_mesh(nats_server.url, redis_server.url, roles=PD, engine_kw=kw) as mesh:
        (dec,) = mesh.decodes
        r = await mesh.client.post(
            "/v1/completions", json={"prompt": "hello", "max_tokens": 16, "stop": ["mp"]}
        )
        assert (await r.json())["choices"][0]["text"] == "ifm"
        await wait_until(lambda: dec.admits[0].request_id in dec.aborts)
        assert mesh.prefills[0].aborts == []  # its part was done


# ------------------------------------------------------------------ failures


async def test_restore_failure_retries_once_without_reuse(
    nats_server: ServerProcess, redis_server: ServerProcess, tmp_path: Path
) -> None:
    path = tmp_path / "pd.jsonl"
    async with running_mesh(
        nats_server.url, redis_server.url, roles=PD, record_path=str(path)
    ) as mesh:
        (pre,), (dec,) = mesh.prefills, mesh.decodes
        dec.cached_device, dec.restore_fails_once = 8, True
        r = await mesh.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
        assert r.status == 200, await r.text()
        body = await r.json()
        assert body["choices"][0]["token_ids"] == expected_tokens(IDS, 3)
        assert [a.reuse for a in dec.admits] == [True, False]
        assert [p.decode_prefix_len for p in pre.prefills] == [8, 0]
        assert dec.admits[0].request_id != dec.admits[1].request_id
        assert body["usage"]["disaggregation"] == disagg(mesh, 0, 0, 0, 0)
        assert await metric(mesh, "hicache_router_pd_restore_retries_total") == 1
        assert await metric(mesh, "hicache_router_routing_decisions_total", 'reason="retry"') == 2

        # a decode engine that never restores: one retry, then a clear 502 (not a 500)
        dec.error = (409, "restore lost pages")
        r = await mesh.client.post("/v1/completions", json={"prompt": PROMPT})
        assert r.status == 502
        assert (await r.json())["error"]["code"] == "restore_failed"
        assert [a.reuse for a in dec.admits[2:]] == [True, False]
        assert await metric(mesh, "hicache_router_pd_restore_retries_total") == 2
    head, *records = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert head["type"] == "header"
    assert [rec["status"] for rec in records] == [200, 502]
    assert records[0]["disaggregation"] == disagg(mesh, 0, 0, 0, 0)
    assert records[0]["engine_id"] == dec.engine_id and "disaggregation" not in records[1]


async def test_an_admit_lost_in_a_nats_reconnect_is_asked_again(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    """The question or the decode engine's answer was lost while NATS reconnected: the
    router asks again at the reconnect instead of waiting out `pd_admit_timeout_s` for a 504
    (the fault matrix saw 10 s waits and 504s after a nats-server kill)."""
    async with running_mesh(
        nats_server.url, redis_server.url, roles=PD, pd_admit_timeout_s=10.0
    ) as mesh:
        (dec,) = mesh.decodes
        dec.lose_admits = 1
        task = asyncio.create_task(mesh.client.post("/v1/completions", json={"prompt": PROMPT}))
        await wait_until(lambda: len(dec.admits) == 1)
        mesh.client.app[REPLIES].reconnected()  # what the router does when NATS is back
        r = await task
        assert r.status == 200, await r.text()
        assert [a.request_id for a in dec.admits] == [dec.admits[0].request_id] * 2


async def test_no_responders_just_after_a_reconnect_is_asked_again(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    """NATS came back for the router before the decode engine resubscribed: "no responders"
    then means "not yet", and the admission is asked again until it is heard (the fault
    matrix saw a 502 "engine decode-0 is not listening" after a nats-server kill)."""
    async with running_mesh(nats_server.url, redis_server.url, roles=PD) as mesh:
        (dec,) = mesh.decodes
        await dec.unsubscribe_admits()
        mesh.client.app[REPLIES].reconnected()
        task = asyncio.create_task(mesh.client.post("/v1/completions", json={"prompt": PROMPT}))
        await asyncio.sleep(0.3)
        assert not task.done()
        await dec.subscribe_admits()
        r = await asyncio.wait_for(task, 10.0)
        assert r.status == 200, await r.text()
        assert len(dec.admits) == 1


async def test_a_prefill_request_lost_in_a_nats_reconnect_is_found_and_retried(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    """The PrefillRequest was lost while NATS reconnected: the decode engine would wait for
    KV until its transfer timeout (20 s here). The router asks the prefill engine at the
    reconnect, learns it never got the request, and retries the pair at once."""
    async with running_mesh(
        nats_server.url, redis_server.url, roles=PD, pd_transfer_timeout_s=20.0
    ) as mesh:
        (pre,), (dec,) = mesh.prefills, mesh.decodes
        pre.lose_prefills = 1
        task = asyncio.create_task(mesh.client.post("/v1/completions", json={"prompt": PROMPT}))
        await wait_until(lambda: len(pre.prefills) == 1)
        mesh.client.app[REPLIES].reconnected()  # what the router does when NATS is back
        r = await asyncio.wait_for(task, 10.0)
        assert r.status == 200, await r.text()
        assert len(pre.prefills) == len(dec.admits) == 2
        assert dec.aborts == [dec.admits[0].request_id]  # the first admission released
        assert await metric(mesh, "hicache_router_bus_errors_total", 'kind="bus"') == 1


async def test_prefill_death_aborts_decode_and_fails_fast(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    async with running_mesh(
        nats_server.url, redis_server.url, roles=PD, pd_transfer_timeout_s=3.0
    ) as mesh:
        (pre,), (dec,) = mesh.prefills, mesh.decodes
        pre.mute_prefill = True
        t0 = time.monotonic()
        task = asyncio.create_task(mesh.client.post("/v1/completions", json={"prompt": PROMPT}))
        await wait_until(lambda: len(pre.prefills) == 1)
        pre.silent = True  # its heartbeats stop: the KV will never come
        r = await task
        assert r.status == 502 and time.monotonic() - t0 < 2.5
        err = (await r.json())["error"]
        assert err["code"] == "prefill_lost" and pre.engine_id in err["message"]
        await wait_until(lambda: dec.aborts == [dec.admits[0].request_id])
        assert len(dec.admits) == 1  # no live prefill engine to retry with
        assert await metric(mesh, "hicache_router_bus_errors_total", 'kind="lost"') == 1


async def test_transfer_timeout_retries_on_another_prefill_engine(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    roles = ("prefill", "prefill", "decode")
    async with running_mesh(
        nats_server.url, redis_server.url, roles=roles, pd_transfer_timeout_s=0.3
    ) as mesh:
        mute, good = mesh.prefills
        (dec,) = mesh.decodes
        mute.mute_prefill = True
        await set_load(mesh, good, 10_000)  # the mute one is chosen first
        r = await mesh.client.post("/generate", json={"input_ids": IDS})
        assert r.status == 200, await r.text()
        assert r.headers["X-Hicache-Prefill-Engine"] == good.engine_id
        meta = (await r.json())["meta_info"]
        assert meta["disaggregation"]["prefill_engine"] == good.engine_id
        assert (len(mute.prefills), len(good.prefills), len(dec.admits)) == (1, 1, 2)
        assert dec.aborts == []  # decode gave up itself
        assert await metric(mesh, "hicache_router_bus_errors_total", 'kind="transfer_timeout"') == 1

        # every prefill engine mute: one retry, then 504 within about two transfer timeouts
        good.mute_prefill = True
        t0 = time.monotonic()
        r = await mesh.client.post("/generate", json={"input_ids": IDS, "stream": True})
        assert r.status == 504 and time.monotonic() - t0 < 2.0
        assert (await r.json())["error"]["code"] == "kv_transfer_timeout"
        assert (len(mute.prefills), len(good.prefills), len(dec.admits)) == (2, 2, 4)


async def test_prefill_error_reports(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    roles = ("prefill", "prefill", "decode")
    async with running_mesh(nats_server.url, redis_server.url, roles=roles) as mesh:
        bad, good = mesh.prefills
        (dec,) = mesh.decodes
        await set_load(mesh, good, 10_000)
        bad.prefill_error = (400, "prompt rejected by prefill")
        r = await mesh.client.post("/v1/completions", json={"prompt": PROMPT})
        assert r.status == 400
        assert (await r.json())["error"]["code"] == "prefill_rejected"
        await wait_until(lambda: dec.aborts == [dec.admits[0].request_id])
        assert good.prefills == []
        bad.prefill_error = (500, "boom")
        r = await mesh.client.post("/v1/completions", json={"prompt": PROMPT, "stream": True})
        assert r.status == 200 and r.headers["X-Hicache-Prefill-Engine"] == good.engine_id
        events, done = await read_sse(r)
        assert done and "error" not in events[-1]
        assert len(bad.prefills) == 2 and len(good.prefills) == 1


async def test_a_kv_transfer_that_failed_on_prefill_falls_back_then_names_its_cause(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    """A prefill engine that cannot send its KV (a frame the server refuses) says so at once
    (error 502): the router retries the prefill once, on another prefill engine if one is
    live, and only then answers 502 `kv_transfer_failed` with the cause, within seconds,
    never after the decode engine's transfer timeout (it used to take 48 s and end in a
    504 that blamed a timeout). The engine stays in routing: it is not broken."""
    why = "KV transfer to decode failed: frame 0 of 3 (8,400,000 bytes) could not be sent"
    why += ": MaxPayloadError: nats: maximum payload exceeded"
    roles = ("prefill", "decode")
    async with running_mesh(
        nats_server.url, redis_server.url, roles=roles, pd_transfer_timeout_s=30.0
    ) as mesh:
        (pre,), (dec,) = mesh.prefills, mesh.decodes
        pre.prefill_error = (502, why)
        t0 = time.monotonic()
        r = await mesh.client.post("/v1/completions", json={"prompt": PROMPT})
        assert r.status == 502 and time.monotonic() - t0 < 10.0
        err = (await r.json())["error"]
        assert err["code"] == "kv_transfer_failed"
        assert "MaxPayloadError" in err["message"] and pre.engine_id in err["message"]
        assert len(pre.prefills) == len(dec.admits) == 2  # retried once, on the same pair
        await wait_until(lambda: sorted(dec.aborts) == sorted(a.request_id for a in dec.admits))
        assert await metric(mesh, "hicache_router_bus_errors_total", 'kind="transfer_failed"') == 2
        pre.prefill_error = None
        r = await mesh.client.post("/v1/completions", json={"prompt": PROMPT})
        assert r.status == 200, await r.text()  # never marked failed
    roles = ("prefill", "prefill", "decode")
    async with running_mesh(nats_server.url, redis_server.url, roles=roles) as mesh:
        bad, good = mesh.prefills
        await set_load(mesh, good, 10_000)  # the failing one is chosen first
        bad.prefill_error = (502, why)
        r = await mesh.client.post("/v1/completions", json={"prompt": PROMPT})
        assert r.status == 200, await r.text()
        assert r.headers["X-Hicache-Prefill-Engine"] == good.engine_id
        assert (len(bad.prefills), len(good.prefills)) == (1, 1)


async def test_decode_admit_refusals(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    roles = ("prefill", "decode", "decode")
    async with running_mesh(nats_server.url, redis_server.url, roles=roles) as mesh:
        (pre,) = mesh.prefills
        first, other = mesh.decodes
        await set_load(mesh, other, 10_000)
        first.admit_error = (400, "bad prompt")
        r = await mesh.client.post("/v1/completions", json={"prompt": PROMPT})
        assert r.status == 400 and (await r.json())["error"]["code"] == "engine_rejected"
        assert other.admits == [] and pre.prefills == [] and first.aborts == []
        first.admit_error = (503, "no room")
        r = await mesh.client.post("/v1/completions", json={"prompt": PROMPT})
        assert r.status == 200 and r.headers["X-Hicache-Engine"] == other.engine_id
        assert len(pre.prefills) == 1  # only the admitted attempt reached prefill
        other.admit_error = (503, "no room")  # first sits out after refusing: nothing left
        r = await mesh.client.post("/v1/completions", json={"prompt": PROMPT})
        assert r.status == 503 and r.headers["Retry-After"] == "1"
        assert (await r.json())["error"]["code"] == "engine_unavailable"


async def test_decode_failures(nats_server: ServerProcess, redis_server: ServerProcess) -> None:
    kw = {"token_delay_s": 0.01}
    async with running_mesh(nats_server.url, redis_server.url, roles=PD, engine_kw=kw) as mesh:
        (dec,) = mesh.decodes
        # decode dies mid-stream: an error event, then [DONE]
        dec.silent_after_chunks = 3
        body = {"prompt": PROMPT, "max_tokens": 20, "stream": True}
        t0 = time.monotonic()
        r = await mesh.client.post("/v1/completions", json=body)
        events, done = await read_sse(r)
        assert r.status == 200 and done and time.monotonic() - t0 < 3.0
        assert events[-1]["error"]["code"] == "engine_lost" and len(events) == 4
    async with running_mesh(nats_server.url, redis_server.url, roles=PD) as mesh:
        (dec,) = mesh.decodes
        dec.error = (500, "boom")  # before the first token, and no other decode engine
        r = await mesh.client.post("/v1/completions", json={"prompt": PROMPT})
        assert r.status == 502 and (await r.json())["error"]["code"] == "engine_error"
        assert len(dec.admits) == 1


async def test_bad_input_reaches_no_engine(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    async with running_mesh(nats_server.url, redis_server.url, roles=("colocated", *PD)) as mesh:
        bodies: list[dict[str, Any]] = [
            {"prompt": [1, 999]},
            {"prompt": PROMPT, "max_tokens": 10_000},
            {"prompt": PROMPT, "temperature": -1},
        ]
        for body in bodies:
            r = await mesh.client.post("/v1/completions", json=body)
            assert r.status == 400, body
        r = await mesh.client.post("/generate", json={"input_ids": [260]})
        assert r.status == 400
        await mesh.sync()
        engines: list[FakeEngine] = mesh.engines
        assert all(not e.received for e in engines)
        assert not mesh.decodes[0].admits and not mesh.prefills[0].prefills


async def test_health_flush_and_stats_with_roles(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    async with running_mesh(nats_server.url, redis_server.url, roles=PD) as mesh:
        (pre,), (dec,) = mesh.prefills, mesh.decodes
        r = await mesh.client.get("/health")
        body = await r.json()
        assert r.status == 200
        assert body["roles"] == {pre.engine_id: "prefill", dec.engine_id: "decode"}
        r = await mesh.client.post("/flush_cache")
        assert r.status == 200 and (pre.flushes, dec.flushes) == (1, 1)
        stats = (await (await mesh.client.get("/stats")).json())["engines"]
        assert set(stats) == {pre.engine_id, dec.engine_id}
        dec.silent = True  # a prefill engine alone cannot serve
        await wait_until(lambda: len(mesh.client.app[TABLE].live()) == 1)
        r = await mesh.client.get("/health")
        assert r.status == 503 and (await r.json())["live_engines"] == [pre.engine_id]
        r = await mesh.client.post("/v1/completions", json={"prompt": "hi"})
        assert r.status == 503 and (await r.json())["error"]["code"] == "no_live_engine"
        assert pre.prefills == [] and pre.received == []


async def test_a_request_that_crashed_an_engine_is_never_retried(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    """Crash-marked errors from decode (chunk or admit refusal 500) or prefill end the
    request with a 500 "engine_crashed"; no other engine of either role gets it."""
    roles = ("prefill", "prefill", "decode", "decode")
    async with running_mesh(nats_server.url, redis_server.url, roles=roles) as mesh:
        pres, decs = mesh.prefills, mesh.decodes
        for e in (*pres, *decs):
            e.crashed = True
        for e in decs:
            e.error = (500, "engine step loop crashed: boom")
        r = await mesh.client.post("/v1/completions", json={"prompt": PROMPT})
        assert r.status == 500, await r.text()
        assert (await r.json())["error"]["code"] == "engine_crashed"
        assert sum(len(d.admits) for d in decs) == 1
        assert sum(len(p.prefills) for p in pres) == 1
    async with running_mesh(nats_server.url, redis_server.url, roles=roles) as mesh:
        pres, decs = mesh.prefills, mesh.decodes
        for e in pres:
            e.crashed = True
            e.prefill_error = (500, "engine step loop crashed: boom")
        r = await mesh.client.post("/v1/completions", json={"prompt": PROMPT})
        assert r.status == 500 and (await r.json())["error"]["code"] == "engine_crashed"
        assert sum(len(p.prefills) for p in pres) == 1
        assert sum(len(d.admits) for d in decs) == 1
        for e in decs:
            e.admit_error = (500, "engine step loop crashed: boom")
        r = await mesh.client.post("/v1/completions", json={"prompt": PROMPT})
        assert r.status == 500 and (await r.json())["error"]["code"] == "engine_crashed"
        assert sum(len(d.admits) for d in decs) == 2  # one more, not two
