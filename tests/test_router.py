"""The router over real HTTP, against scripted engines on a real nats-server and a real Redis."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from fake_engine import FakeEngine, Mesh, expected_tokens, read_sse, running_mesh

from bus_schemas import page_hashes, redis_keys
from router.__main__ import build_parser, config_from_args
from router.app import init
from router.chat import ChatMessage, ChatTemplate
from router.config import RouterConfig
from router.detokenize import TextAssembler
from router.keys import TABLE
from router.outcome import parse_server_timing
from router.tokenizer import ByteTokenizer, HFTokenizer
from services.launch.servers import ServerProcess, free_port

pytestmark = pytest.mark.timeout(60)

PROMPT = "hello world, this is a test prompt"
BYTES = ByteTokenizer()


def text_of(ids: list[int]) -> str:
    return BYTES.decode(ids)


async def wait_until(pred: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def set_load(mesh: Mesh, engine: FakeEngine, tokens: int) -> None:
    """Make `engine` report `tokens` in flight and wait until the router knows it."""
    engine.inflight_tokens = tokens
    await engine.beat()
    table = mesh.client.app[TABLE]

    def seen() -> bool:
        return any(e.engine_id == engine.engine_id and e.load == tokens for e in table.live())

    await wait_until(seen)


async def metric(mesh: Mesh, name: str, labels: str = "") -> float:
    text = await (await mesh.client.get("/metrics")).text()
    for line in text.splitlines():
        if line.startswith(name + (f"{{{labels}}}" if labels else " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ------------------------------------------------------------------ pure pieces


def test_chat_template_is_documented_format() -> None:
    msgs = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")]
    plain = ChatTemplate(None)  # a model card without a template (the random presets)
    assert plain.render(msgs) == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"


def test_text_assembler_holds_back_partial_stops_and_utf8() -> None:
    asm = TextAssembler(BYTES, ["END"])
    released = []
    for b in "añb EN".encode():
        asm.push(b)
        released.append(asm.release())
    assert "".join(released) == "añb "  # "EN" might begin "END"
    assert asm.push(ord("D")) is True
    assert asm.release() == "" and asm.text == "añb "
    asm2 = TextAssembler(BYTES)
    for b in "ñ".encode()[:1]:
        asm2.push(b)
    assert asm2.release() == ""  # a cut UTF-8 sequence is not final
    asm2.finish()
    assert asm2.release() == "\ufffd"


def test_tokenizer_json_is_loaded_with_the_tokenizers_library() -> None:
    import tokenizers
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = tokenizers.Tokenizer(WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, "[UNK]"))
    tok.pre_tokenizer = Whitespace()
    loaded = HFTokenizer.from_json(tok.to_str())  # as a model card carries it
    assert loaded.encode("hello world") == [0, 1]
    assert loaded.decode([1, 0]) == "world hello"
    assert BYTES.encode("hé") == [104, 195, 169]


def test_cli_flags_build_the_config() -> None:
    argv = "--port 8123 --nats-url nats://x:1 --redis-url redis://y:2/0 --api-key k"
    argv += " --record /tmp/r.jsonl --request-timeout 7 --bucket long --host 0.0.0.0"
    argv += " --read-timeout 12 --max-connections 64"
    args = build_parser().parse_args(argv.split())
    config = config_from_args(args)
    assert (args.port, args.host) == (8123, "0.0.0.0")
    assert config.nats_url == "nats://x:1" and config.redis_url == "redis://y:2/0"
    assert config.api_key == "k" and config.record_path == "/tmp/r.jsonl"
    assert config.request_timeout_s == 7.0 and config.bucket == "long"
    assert (config.read_timeout_s, config.max_connections) == (12.0, 64)


# ------------------------------------------------------------------ serving


async def test_completions_text_ids_and_cached_tokens(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    kw = {"cached_device": 8, "cached_host": 4}
    async with running_mesh(nats_server.url, redis_server.url, 1, engine_kw=kw) as mesh:
        r = await mesh.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5})
        assert r.status == 200, await r.text()
        body = await r.json()
        ids = list(PROMPT.encode())
        want = expected_tokens(ids, 5)
        choice = body["choices"][0]
        assert body["object"] == "text_completion" and body["model"] == "tiny-test"
        assert choice["text"] == text_of(want) and choice["token_ids"] == want
        assert choice["finish_reason"] == "length"
        assert body["usage"] == {
            "prompt_tokens": len(ids),
            "completion_tokens": 5,
            "total_tokens": len(ids) + 5,
            "prompt_tokens_details": {
                "cached_tokens": 12,
                "cached_tokens_by_tier": {"device": 8, "host": 4, "storage": 0},
            },
        }
        engine = mesh.engines[0]
        assert engine.received[0].input_ids.tolist() == ids
        assert engine.received[0].sampling.max_new_tokens == 5
        # token ids, and a batch of one id list; without max_tokens, up to the context (256)
        for prompt in ([5, 6, 7], [[5, 6, 7]]):
            r = await mesh.client.post("/v1/completions", json={"prompt": prompt, "seed": 3})
            body = await r.json()
            assert body["choices"][0]["token_ids"] == expected_tokens([5, 6, 7], 256 - 3)
        assert engine.received[-1].sampling.seed == 3


async def test_chat_uses_the_template(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    async with running_mesh(nats_server.url, redis_server.url, 1) as mesh:
        messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hey"}]
        r = await mesh.client.post(
            "/v1/chat/completions",
            json={"messages": messages, "max_completion_tokens": 4, "model": "tiny-test"},
        )
        assert r.status == 200, await r.text()
        body = await r.json()
        ids = list(b"<|system|>\nsys\n<|user|>\nhey\n<|assistant|>\n")
        assert mesh.engines[0].received[0].input_ids.tolist() == ids
        assert body["object"] == "chat.completion"
        msg = body["choices"][0]["message"]
        assert msg == {"role": "assistant", "content": text_of(expected_tokens(ids, 4))}
        assert body["usage"]["completion_tokens"] == 4


async def test_generate_native_api(nats_server: ServerProcess, redis_server: ServerProcess) -> None:
    kw = {"cached_host": 16}
    async with running_mesh(nats_server.url, redis_server.url, 1, engine_kw=kw) as mesh:
        sp = {"max_new_tokens": 6, "temperature": 0.5, "top_p": 0.9, "seed": 1, "ignore_eos": True}
        r = await mesh.client.post(
            "/generate", json={"input_ids": [1, 2, 3], "sampling_params": sp, "cache_salt": "u1"}
        )
        assert r.status == 200, await r.text()
        body = await r.json()
        want = expected_tokens([1, 2, 3], 6)
        assert body["output_ids"] == want and body["text"] == text_of(want)
        meta = body["meta_info"]
        assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 6
        assert (meta["cached_tokens"], meta["cached_tokens_device"]) == (16, 0)
        assert meta["cached_tokens_host"] == 16 and meta["finish_reason"] == "length"
        assert meta["engine_id"] == mesh.engines[0].engine_id
        timing = parse_server_timing(r.headers["Server-Timing"])
        assert list(timing) == ["parse", "route", "lookup", "engine", "total"]
        assert timing["lookup"] == 0  # one engine: Redis is not asked
        assert timing["parse"] + timing["route"] + timing["engine"] <= timing["total"]
        req = mesh.engines[0].received[0]
        assert req.cache_salt == "u1"
        assert (req.sampling.temperature, req.sampling.top_p, req.sampling.seed) == (0.5, 0.9, 1)
        assert req.sampling.ignore_eos is True
        # stop_token_ids end the generation at the engine
        sp2: dict[str, Any] = {"max_new_tokens": 6, "stop_token_ids": [4]}
        r = await mesh.client.post("/generate", json={"text": "abc", "sampling_params": sp2})
        body = await r.json()
        assert body["output_ids"] == expected_tokens(list(b"abc"), 6)
        r = await mesh.client.post("/generate", json={"input_ids": [3, 1], "sampling_params": sp2})
        body = await r.json()
        assert body["output_ids"] == [4] and body["meta_info"]["finish_reason"] == "stop"


async def test_streaming_sse_for_all_endpoints(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    kw = {"cached_device": 4, "tokens_per_chunk": 2}
    async with running_mesh(nats_server.url, redis_server.url, 1, engine_kw=kw) as mesh:
        ids = list(PROMPT.encode())
        want = expected_tokens(ids, 7)
        body = {"prompt": PROMPT, "max_tokens": 7, "stream": True}
        body["stream_options"] = {"include_usage": True}
        r = await mesh.client.post("/v1/completions", json=body)
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        events, done = await read_sse(r)
        assert done and len(events) == 5  # 2 + 2 + 2 + 1 tokens, then the usage chunk
        usage_event, events = events[-1], events[:-1]
        assert "".join(e["choices"][0]["text"] for e in events) == text_of(want)
        assert [t for e in events for t in e["choices"][0]["token_ids"]] == want
        assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert all(e["usage"] is None for e in events)  # asked for: null until the last
        assert usage_event["choices"] == []  # OpenAI's usage chunk
        usage = usage_event["usage"]
        assert usage["completion_tokens"] == 7 and usage["prompt_tokens"] == len(ids)
        assert usage["prompt_tokens_details"]["cached_tokens_by_tier"] == {
            "device": 4,
            "host": 0,
            "storage": 0,
        }

        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
        r = await mesh.client.post("/v1/chat/completions", json=chat)
        events, done = await read_sse(r)
        assert done and events[0]["object"] == "chat.completion.chunk"
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        chat_ids = list(ChatTemplate(None).render([ChatMessage("user", "hi")]).encode())
        content = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
        assert content == text_of(expected_tokens(chat_ids, 3))
        assert not any("usage" in e for e in events)  # not asked for: none
        assert events[-1]["choices"][0]["finish_reason"] == "length"

        gen = {"text": "xyz", "sampling_params": {"max_new_tokens": 5}, "stream": True}
        r = await mesh.client.post("/generate", json=gen)
        events, done = await read_sse(r)
        want = expected_tokens(list(b"xyz"), 5)
        assert done and events[-1]["output_ids"] == want and events[-1]["text"] == text_of(want)
        assert events[-1]["meta_info"]["finish_reason"] == "length"
        assert events[0]["meta_info"]["finish_reason"] is None
        assert len(events[0]["output_ids"]) == 2  # cumulative


async def test_stop_strings_truncate_and_abort(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    kw = {"token_delay_s": 0.01}
    async with running_mesh(nats_server.url, redis_server.url, 1, engine_kw=kw) as mesh:
        # "hello" -> "ifmmp" repeated
        body = {"prompt": "hello", "max_tokens": 16, "stop": ["mp", "zz"]}
        r = await mesh.client.post("/v1/completions", json=body)
        out = await r.json()
        choice = out["choices"][0]
        assert choice["text"] == "ifm" and choice["finish_reason"] == "stop"
        assert choice["token_ids"] == list(b"ifmmp") and out["usage"]["completion_tokens"] == 5
        engine = mesh.engines[0]
        await wait_until(lambda: engine.received[0].request_id in engine.aborts)
        r = await mesh.client.post("/v1/completions", json=body | {"stream": True})
        events, done = await read_sse(r)
        assert done and "".join(e["choices"][0]["text"] for e in events) == "ifm"
        assert events[-1]["choices"][0]["finish_reason"] == "stop"


async def test_streaming_client_disconnect_aborts(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    kw = {"token_delay_s": 0.05}
    async with running_mesh(nats_server.url, redis_server.url, 1, engine_kw=kw) as mesh:
        body = {"prompt": "hello", "max_tokens": 100, "stream": True}
        r = await mesh.client.post("/v1/completions", json=body)
        await r.content.readline()
        r.close()
        engine = mesh.engines[0]
        await wait_until(lambda: bool(engine.aborts), timeout_s=3)
        assert engine.aborts == [engine.received[0].request_id]


# ------------------------------------------------------------------ routing


async def test_routing_prefers_the_engine_holding_the_prefix(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    async with running_mesh(nats_server.url, redis_server.url, 2) as mesh:
        a, b = mesh.engines
        ids = list(PROMPT.encode())
        hashes = page_hashes(ids, a.page_size, a.namespace)
        r = aioredis.Redis.from_url(redis_server.url)
        try:
            for h in hashes[:5]:  # b holds the first 5 pages (2 on the device)
                await r.hset(redis_keys.page(h), b.engine_id, 1 if h in hashes[:2] else 2)
            for _ in range(3):
                resp = await mesh.client.post("/generate", json={"text": PROMPT})
                assert (await resp.json())["meta_info"]["engine_id"] == b.engine_id
                timing = parse_server_timing(resp.headers["Server-Timing"])
                assert 0 < timing["lookup"] <= timing["route"]  # the Redis round trip
                assert timing["parse"] + timing["route"] + timing["engine"] <= timing["total"]
            assert len(a.received) == 0 and len(b.received) == 3
            assert (
                await metric(mesh, "hicache_router_routing_decisions_total", 'reason="cache"') == 3
            )
            # a salted prompt hashes differently: no hit, both engines idle -> load/round robin
            seen = set()
            for _ in range(2):
                resp = await mesh.client.post("/generate", json={"text": PROMPT, "cache_salt": "s"})
                seen.add((await resp.json())["meta_info"]["engine_id"])
            assert seen == {a.engine_id, b.engine_id}
            # a loaded engine loses even with its cache: 5 pages x 4 tokens < 0.5 x 10000
            await set_load(mesh, b, 10_000)
            resp = await mesh.client.post("/generate", json={"text": PROMPT})
            assert (await resp.json())["meta_info"]["engine_id"] == a.engine_id
        finally:
            for h in hashes:
                await r.delete(redis_keys.page(h))
            await r.aclose()


async def test_routing_counts_an_engines_store_below_its_host(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    """Engines a and b read different external stores; only b's holds the prompt: b wins.
    A host hit of a's beats b's store (storage pages weigh half of host pages)."""
    async with running_mesh(nats_server.url, redis_server.url, 2) as mesh:
        a, b = mesh.engines
        a.store_id, b.store_id = "store-a", "store-b"
        for e in (a, b):
            await e.beat()
        table = mesh.client.app[TABLE]
        await wait_until(lambda: {e.store_id for e in table.live()} == {"store-a", "store-b"})
        ids = list(PROMPT.encode())
        hashes = page_hashes(ids, a.page_size, a.namespace)
        r = aioredis.Redis.from_url(redis_server.url)
        try:
            for h in hashes[:6]:
                await r.set(redis_keys.store_page("store-b", h), "1", ex=60)
            for _ in range(3):
                resp = await mesh.client.post("/generate", json={"text": PROMPT})
                assert (await resp.json())["meta_info"]["engine_id"] == b.engine_id
                timing = parse_server_timing(resp.headers["Server-Timing"])
                assert 0 < timing["lookup"] <= timing["route"]  # the Redis round trip
                assert timing["parse"] + timing["route"] + timing["engine"] <= timing["total"]
            for h in hashes[:4]:  # a holds 4 pages on its host: 4 x 0.5 > 6 x 0.25
                await r.hset(redis_keys.page(h), a.engine_id, 2)
            resp = await mesh.client.post("/generate", json={"text": PROMPT})
            assert (await resp.json())["meta_info"]["engine_id"] == a.engine_id
        finally:
            for h in hashes:
                await r.delete(redis_keys.page(h), redis_keys.store_page("store-b", h))
            await r.aclose()


async def test_routing_by_load_when_redis_knows_nothing(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    async with running_mesh(nats_server.url, redis_server.url, 2) as mesh:
        a, b = mesh.engines
        await set_load(mesh, a, 500)
        for _ in range(3):
            r = await mesh.client.post("/v1/completions", json={"prompt": PROMPT})
            assert r.headers["X-Hicache-Engine"] == b.engine_id
        await set_load(mesh, a, 0)
        await set_load(mesh, b, 500)
        r = await mesh.client.post("/v1/completions", json={"prompt": PROMPT})
        assert r.headers["X-Hicache-Engine"] == a.engine_id
        assert await metric(mesh, "hicache_router_routing_decisions_total", 'reason="load"') == 4
        # local in-flight tokens count as load too: a slow request on b...
        await set_load(mesh, b, 0)
        b.token_delay_s = 0.05
        a.token_delay_s = 0.05
        slow = asyncio.create_task(
            mesh.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 10})
        )
        await wait_until(lambda: len(a.received) + len(b.received) == 5)
        busy = a if len(a.received) == 2 else b
        other = b if busy is a else a
        r = await mesh.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.headers["X-Hicache-Engine"] == other.engine_id
        assert (await slow).status == 200


async def test_redis_down_routes_by_load_and_counts_errors(
    nats_server: ServerProcess, fresh_redis: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_mesh(nats_server.url, fresh_redis.url, 2, redis_retry_s=0.0) as mesh:
        r = await mesh.client.post("/v1/completions", json={"prompt": PROMPT})
        assert r.status == 200
        assert await metric(mesh, "hicache_router_store_errors_total") == 0
        fresh_redis.stop()
        with caplog.at_level(logging.WARNING, logger="router.routing"):
            for _ in range(3):
                t0 = time.monotonic()
                r = await mesh.client.post("/v1/completions", json={"prompt": PROMPT})
                assert r.status == 200, await r.text()
                assert time.monotonic() - t0 < 1.0
        # the first lookup finds Redis down; the next ones skip it until a probe answers
        assert await metric(mesh, "hicache_router_store_errors_total") >= 1
        assert await metric(mesh, "hicache_router_store_timeouts_total") == 0
        assert await metric(mesh, "hicache_router_redis_up") == 0
        assert (
            await metric(mesh, "hicache_router_routing_decisions_total", 'reason="redis_down"') == 3
        )
        warnings = [rec for rec in caplog.records if "Redis prefix lookup failed" in rec.message]
        assert len(warnings) == 1  # one per outage


# ------------------------------------------------------------------ failures


async def test_engine_silent_mid_request_gives_502_then_next_goes_elsewhere(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    kw = {"token_delay_s": 0.01}
    async with running_mesh(nats_server.url, redis_server.url, 2, engine_kw=kw) as mesh:
        a, b = mesh.engines
        await set_load(mesh, b, 100_000)
        a.silent_after_chunks = 3
        t0 = time.monotonic()
        r = await mesh.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 20})
        assert r.status == 502
        assert time.monotonic() - t0 < 3.0
        err = (await r.json())["error"]
        assert err["code"] == "engine_lost" and err["type"] == "server_error"
        assert len(b.received) == 0  # started on a: not replayed
        r = await mesh.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status == 200 and r.headers["X-Hicache-Engine"] == b.engine_id
        assert await metric(mesh, "hicache_router_bus_errors_total", 'kind="lost"') == 1


async def test_engine_silent_mid_stream_gives_error_event_then_done(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    kw = {"token_delay_s": 0.01}
    async with running_mesh(nats_server.url, redis_server.url, 2, engine_kw=kw) as mesh:
        a, b = mesh.engines
        await set_load(mesh, b, 100_000)
        a.silent_after_chunks = 3
        t0 = time.monotonic()
        body = {"prompt": PROMPT, "max_tokens": 20, "stream": True}
        r = await mesh.client.post("/v1/completions", json=body)
        assert r.status == 200
        events, done = await read_sse(r)
        assert time.monotonic() - t0 < 3.0
        assert done and len(events) == 4
        assert [e["choices"][0]["token_ids"] for e in events[:3]] == [
            [t] for t in expected_tokens(list(PROMPT.encode()), 3)
        ]
        assert events[-1]["error"]["code"] == "engine_lost"
        r = await mesh.client.post("/v1/completions", json=body)
        events, done = await read_sse(r)
        assert done and "error" not in events[-1] and r.headers["X-Hicache-Engine"] == b.engine_id


async def test_failure_before_first_chunk_retries_on_another_engine(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    async with running_mesh(nats_server.url, redis_server.url, 2, request_timeout_s=0.5) as mesh:
        a, b = mesh.engines
        await set_load(mesh, b, 100_000)
        a.mute_generate = True  # heartbeats on, never answers: a hung engine
        r = await mesh.client.post("/generate", json={"text": PROMPT})
        assert r.status == 200, await r.text()
        assert (await r.json())["meta_info"]["engine_id"] == b.engine_id
        assert len(a.received) == 1 and len(b.received) == 1
        assert await metric(mesh, "hicache_router_bus_errors_total", 'kind="timeout"') == 1
        assert await metric(mesh, "hicache_router_routing_decisions_total", 'reason="retry"') == 1
        # a sits out until its next heartbeat, then is back in routing (strike 1 of 3)
        table = mesh.client.app[TABLE]
        await wait_until(lambda: table.is_alive(a.engine_id))
        # with both gone, nothing is live: 503 with Retry-After
        a.silent = b.silent = True
        await wait_until(lambda: not mesh.client.app[TABLE].live())
        r = await mesh.client.post("/generate", json={"text": PROMPT})
        assert r.status == 503 and r.headers["Retry-After"] == "1"


async def test_replies_lost_in_a_reconnect_fail_at_once_and_retry_elsewhere(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    """An engine's NATS connection came back (its heartbeat says so) after replies to the
    router were lost: the router asks the engine what it sent (StreamCheck), and instead of
    waiting out `request_timeout_s` it retries a request that got nothing on another engine
    and ends one that had streamed with a clear error naming the lost chunks."""
    async with running_mesh(nats_server.url, redis_server.url, 2, request_timeout_s=60) as mesh:
        a, b = mesh.engines
        await set_load(mesh, b, 100_000)
        a.lose_chunks_from = 0  # every reply of a's is lost
        a.token_delay_s = 0.05
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
        task = asyncio.create_task(mesh.client.post("/v1/completions", json=body))
        await wait_until(lambda: bool(a.received))
        await set_load(mesh, b, 0)
        a.bus_reconnects += 1
        await a.beat()
        r = await asyncio.wait_for(task, 20)  # far below the 60 s request timeout
        assert r.status == 200, await r.text()
        data = await r.json()
        expected = expected_tokens(list(PROMPT.encode()), 6)
        assert data["choices"][0]["token_ids"] == expected
        assert len(a.received) == 1 and len(b.received) == 1  # retried once, on b
        assert a.received[0].request_id in a.aborts  # a was told to drop it

        # two chunks came, the rest was lost: the stream ends with an error naming it
        await set_load(mesh, b, 100_000)
        a.lose_chunks_from, a.token_delay_s = 2, 0.3
        body |= {"stream": True, "max_tokens": 20}
        task = asyncio.create_task(mesh.client.post("/v1/completions", json=body))
        await wait_until(lambda: len(a.received) == 2 and a._chunks_sent >= 3)
        a.bus_reconnects += 1
        await a.beat()
        r = await asyncio.wait_for(task, 20)
        events, done = await read_sse(r)
        assert done  # the error event, then [DONE]
        assert [len(e["choices"][0]["token_ids"]) for e in events[:2]] == [1, 1]
        assert "error" in events[-1] and "2 came" in events[-1]["error"]["message"], events
        assert len(b.received) == 1  # a request that streamed is never sent elsewhere


async def test_a_request_lost_on_the_bus_is_retried_on_the_same_engine(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    """Replies lost in a reconnect say nothing about the engine: with no other engine, the
    retry goes to the same one, under a fresh request id (the first copy may still be
    held there)."""
    async with running_mesh(nats_server.url, redis_server.url, 1, request_timeout_s=60) as mesh:
        (a,) = mesh.engines
        a.lose_chunks_from, a.token_delay_s = 0, 0.05
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
        task = asyncio.create_task(mesh.client.post("/v1/completions", json=body))
        await wait_until(lambda: bool(a.received))
        a.lose_chunks_from = None  # the bus is back
        a.bus_reconnects += 1
        await a.beat()
        r = await asyncio.wait_for(task, 20)
        assert r.status == 200, await r.text()
        data = await r.json()
        assert data["choices"][0]["token_ids"] == expected_tokens(list(PROMPT.encode()), 6)
        first, second = (req.request_id for req in a.received)
        assert first != second and first in a.aborts
        assert data["id"] == f"cmpl-{first}"  # the response keeps the first id


async def test_engine_error_chunks(nats_server: ServerProcess, redis_server: ServerProcess) -> None:
    async with running_mesh(nats_server.url, redis_server.url, 2) as mesh:
        a, b = mesh.engines
        await set_load(mesh, b, 100_000)
        a.error = (400, "prompt rejected by engine")
        r = await mesh.client.post("/v1/completions", json={"prompt": PROMPT})
        assert r.status == 400
        err = (await r.json())["error"]
        assert err["code"] == "engine_rejected" and "prompt rejected" in err["message"]
        assert len(b.received) == 0
        a.error = (503, "engine stopping")
        r = await mesh.client.post("/v1/completions", json={"prompt": PROMPT})
        assert r.status == 200 and r.headers["X-Hicache-Engine"] == b.engine_id
        b.error = (500, "boom")
        r = await mesh.client.post("/v1/completions", json={"prompt": PROMPT})
        assert r.status == 502 and (await r.json())["error"]["code"] == "engine_error"


# ------------------------------------------------------------------ the other endpoints


async def test_auth(nats_server: ServerProcess, redis_server: ServerProcess) -> None:
    async with running_mesh(nats_server.url, redis_server.url, 1, api_key="sekret") as mesh:
        c = mesh.client
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "sekret"}):
            r = await c.post("/v1/completions", json={"prompt": "hi"}, headers=headers)
            assert r.status == 401
            body = await r.json()
            assert body == {
                "error": {
                    "message": "missing or incorrect API key",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            }
        for path in ("/v1/models", "/stats"):
            assert (await c.get(path)).status == 401
        assert (await c.post("/flush_cache")).status == 401
        assert (await c.get("/health")).status == 200
        assert (await c.get("/metrics")).status == 200
        r = await c.post("/v1/completions", json={"prompt": "hi"}, headers=mesh.auth)
        assert r.status == 200
        assert (await c.get("/v1/models", headers=mesh.auth)).status == 200
        assert mesh.engines[0].received[0].input_ids.tolist() == list(b"hi")
        assert len(mesh.engines[0].received) == 1


async def test_health_models_metrics_and_no_engine(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    async with running_mesh(nats_server.url, redis_server.url, 2) as mesh:
        c = mesh.client
        r = await c.get("/health")
        body = await r.json()
        assert r.status == 200 and body["status"] == "ok" and body["nats_connected"] is True
        assert sorted(body["live_engines"]) == [e.engine_id for e in mesh.engines]
        r = await c.get("/v1/models")
        assert (await r.json()) == {
            "object": "list",
            "data": [
                {
                    "id": "tiny-test",
                    "object": "model",
                    "created": 0,
                    "owned_by": "hicache-mesh",
                    "max_model_len": 256,
                }
            ],
        }
        await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        text = await (await c.get("/metrics")).text()
        for name in (
            "hicache_router_requests_total",
            "hicache_router_ttft_seconds_bucket",
            "hicache_router_prompt_tokens_total",
            "hicache_router_completion_tokens_total",
            "hicache_router_cached_tokens_total",
            "hicache_router_routing_decisions_total",
            "hicache_router_bus_errors_total",
            "hicache_router_store_errors_total",
            "hicache_router_live_engines",
        ):
            assert name in text, name
        assert 'endpoint="/v1/completions",status="200"' in text
        assert await metric(mesh, "hicache_router_completion_tokens_total") == 2
        assert await metric(mesh, "hicache_router_live_engines") == 2
        for e in mesh.engines:
            e.silent = True
        await wait_until(lambda: not mesh.client.app[TABLE].live())
        r = await c.get("/health")
        assert r.status == 503
        assert (await r.json())["error"]["code"] == "unhealthy"
        r = await c.post("/v1/completions", json={"prompt": "hi"})
        assert r.status == 503 and r.headers["Retry-After"] == "1"
        assert (await r.json())["error"]["code"] == "no_live_engine"
        assert (await c.post("/flush_cache")).status == 503


async def test_flush_fans_out_and_stats(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    async with running_mesh(nats_server.url, redis_server.url, 2, flush_timeout_s=0.5) as mesh:
        a, b = mesh.engines
        r = await mesh.client.post("/flush_cache")
        body = await r.json()
        assert r.status == 200 and body["success"] is True
        assert set(body["results"]) == {a.engine_id, b.engine_id}
        assert a.flushes == 1 and b.flushes == 1
        b.flush_success = False
        r = await mesh.client.post("/flush_cache")
        body = await r.json()
        assert r.status == 409 and body["error"]["code"] == "flush_refused"
        assert body["results"][b.engine_id]["success"] is False
        assert body["results"][a.engine_id]["success"] is True
        r = await mesh.client.get("/stats")
        body = await r.json()
        stats = body["engines"]
        assert stats[a.engine_id]["stats"] == {"device_pages": 7}
        # per bucket: the sums of its engines' figures (both fakes are in "default")
        default = body["buckets"]["default"]
        assert sorted(default["engines"]) == sorted([a.engine_id, b.engine_id])
        assert default["stats"] == {"device_pages": 14}
        b.mute_generate = True
        b.silent = True  # still in the table for 3 heartbeat intervals: no answer -> 503
        r = await mesh.client.post("/flush_cache")
        if r.status != 200:  # b may already be gone from the table
            assert r.status == 503
            assert (await r.json())["error"]["code"] == "flush_unanswered"


async def test_record_writes_a_header_and_every_request_rejected_ones_too(
    nats_server: ServerProcess, redis_server: ServerProcess, tmp_path: Path
) -> None:
    path = tmp_path / "traffic.jsonl"
    kw = {"cached_device": 4}
    meta = '{"model": "tiny", "page_size": 4, "mesh_flags": ["up", "--api-key", "s3cret"]}'
    async with running_mesh(
        nats_server.url,
        redis_server.url,
        1,
        engine_kw=kw,
        record_path=str(path),
        record_meta=meta,
        router_argv=("--api-key", "s3cret", "--record", str(path)),
    ) as mesh:
        await mesh.client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
        await mesh.client.post("/generate", json={"text": "ab", "stream": True})
        await mesh.client.post("/v1/completions", json={"prompt": [999]})  # outside the vocab
        await mesh.client.post("/v1/completions", data=b"{not json")
        sampled = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0.7, "n": 2}
        await mesh.client.post("/v1/completions", json=sampled)
        seeds = [r.sampling.seed for r in mesh.engines[0].received[-2:]]
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    head, first, second, vocab, not_json, drawn = lines
    assert head["type"] == "header" and head["version"] == 1
    assert head["format"] == "hicache-mesh-record" and head["model"] == "tiny"
    assert head["page_size"] == 4 and head["redacted"] is False
    assert "s3cret" not in path.read_text()  # secrets are masked
    assert head["router_flags"] == ["--api-key=***", "--record", str(path)]
    assert head["mesh_flags"] == ["up", "--api-key=***"]
    assert first["type"] == "request" and first["status"] == 200 and first["error"] is None
    assert first["endpoint"] == "/v1/completions"
    assert first["request"] == {"prompt": [1, 2], "max_tokens": 3}
    assert first["input_ids"] == [1, 2] and first["seed"] is None  # greedy: no seed
    assert first["choices"][0]["output_ids"] == expected_tokens([1, 2], 3)
    assert first["sampling"][0]["max_new_tokens"] == 3
    assert first["usage"]["cached_tokens"] == {"device": 4, "host": 0, "storage": 0}
    assert first["usage"]["completion_tokens"] == 3
    assert first["engine_id"] == mesh.engines[0].engine_id and first["bucket"] == "default"
    assert first["ttft_s"] > 0 and first["time"] > 0 and first["e2e_s"] >= first["ttft_s"]
    assert len(first["itl_s"]) >= 1  # gaps between chunks after the first
    assert first["predicted_cached_tokens"] is None  # one engine: the index was not asked
    assert second["endpoint"] == "/generate" and second["input_ids"] == list(b"ab")
    assert vocab["status"] == 400 and "999" in vocab["error"] and vocab["choices"] == []
    assert vocab["request"] == {"prompt": [999]}
    assert not_json["status"] == 400 and not_json["request"] is None
    assert "not valid JSON" in not_json["error"]
    # a sampled request without a seed gets one; choice i draws with seed + i
    assert drawn["seed"] is not None and seeds == [drawn["seed"], drawn["seed"] + 1]
    assert [s["seed"] for s in drawn["sampling"]] == seeds
    assert len(drawn["choices"]) == 2


async def test_record_redact_keeps_ids_and_only_safe_fields(
    nats_server: ServerProcess, redis_server: ServerProcess, tmp_path: Path
) -> None:
    path = tmp_path / "redacted.jsonl"
    async with running_mesh(
        nats_server.url, redis_server.url, 1, record_path=str(path), record_redact=True
    ) as mesh:
        body = {"prompt": "secret words", "max_tokens": 2, "stop": ["zz"]}
        await mesh.client.post("/v1/completions", json=body)
    head, rec = (orjson.loads(line) for line in path.read_bytes().splitlines())
    assert head["redacted"] is True
    assert rec["request"] == {"max_tokens": 2}  # stop strings are text: dropped, and named
    assert rec["redacted_fields"] == ["prompt", "stop"]
    assert rec["input_ids"] == list(b"secret words")
    assert rec["choices"][0]["text"] is None and rec["choices"][0]["output_ids"]
    assert "secret" not in path.read_text()


def test_recorder_drops_and_counts_when_its_queue_is_full(tmp_path: Path) -> None:
    """The handler never waits for the writer: a full queue drops the record, counts it,
    and a `drops` line marks the gap once there is room again."""
    from router.record import Recorder

    dropped: list[int] = []
    recorder = Recorder(
        tmp_path / "r.jsonl", {"type": "header"}, max_queue=2, on_drop=lambda: dropped.append(1)
    )
    gate = threading.Event()
    real_write = recorder._file.write

    def slow_write(data: bytes) -> int:
        gate.wait(10)
        return real_write(data)

    recorder._file.write = slow_write  # type: ignore[method-assign]
    recorder.write({"type": "request", "n": 0})  # the writer takes it and blocks
    deadline = time.monotonic() + 5
    while recorder._queue.qsize() and time.monotonic() < deadline:
        time.sleep(0.01)
    for n in range(1, 6):  # 2 fit in the queue, 3 are dropped
        recorder.write({"type": "request", "n": n})
    assert recorder.dropped == 3 and len(dropped) == 3
    gate.set()
    deadline = time.monotonic() + 5
    while recorder._queue.qsize() and time.monotonic() < deadline:
        time.sleep(0.01)
    recorder.write({"type": "request", "n": 6})  # room again: the gap is marked first
    recorder.close()
    lines = [orjson.loads(line) for line in (tmp_path / "r.jsonl").read_bytes().splitlines()]
    kinds = [(rec["type"], rec.get("n", rec.get("count"))) for rec in lines]
    assert kinds == [
        ("header", None),
        ("request", 0),
        ("request", 1),
        ("request", 2),
        ("drops", 3),
        ("request", 6),
    ]


async def test_shutdown_lets_inflight_streams_finish(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    engine = FakeEngine(f"shut-{uuid.uuid4().hex[:6]}", nats_server.url, token_delay_s=0.02)
    await engine.start()
    config = RouterConfig(nats_url=nats_server.url, redis_url=redis_server.url)
    runner = web.AppRunner(init(config), shutdown_timeout=5.0)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    cleanup: asyncio.Task[None] | None = None
    try:
        async with aiohttp.ClientSession() as session:
            await wait_until_async(lambda: _health_ok(session, url))
            body = {"prompt": "hello", "max_tokens": 20, "stream": True}
            body["stream_options"] = {"include_usage": True}
            resp = await session.post(f"{url}/v1/completions", json=body)
            first = await resp.content.readline()
            assert first.startswith(b"data: ") and await resp.content.readline() == b"\n"
            cleanup = asyncio.create_task(runner.cleanup())
            rest, done = await read_sse(resp)
            await cleanup
        events = [orjson.loads(first[len(b"data: ") :]), *rest]
        assert done and events[-1]["usage"]["completion_tokens"] == 20
        assert len([t for e in events for c in e["choices"] for t in c["token_ids"]]) == 20
        assert engine.aborts == []
    finally:
        await (cleanup if cleanup is not None else runner.cleanup())
        await engine.stop()


async def _health_ok(session: aiohttp.ClientSession, url: str) -> bool:
    async with session.get(f"{url}/health") as r:
        return r.status == 200


async def wait_until_async(pred: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await pred():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


# ------------------------------------------------------------------ the process


def _run(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return proc.stdout.strip()


def test_router_imports_no_engine_code() -> None:
    out = _run(
        "import sys, router.__main__, router.app\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & "
        "{'torch', 'triton', 'gpu_worker', 'services'})\n"
        "print(bad)"
    )
    assert out == "[]"


def test_cli_serves_and_stops_gracefully_on_sigterm(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    port = free_port()
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            *["-m", "router", "--log-level", "WARNING", "--port"],
            str(port),
            *("--nats-url", nats_server.url, "--redis-url", redis_server.url),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 20
        status: Any = None
        while status is None:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline
            status = _http_status(port)
            time.sleep(0.05)
        assert status == 503  # no engine: not healthy, but serving
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _http_status(port: int) -> int | None:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return None
