"""Router robustness and observability (issue 7: defects 4, 5, 6 and the metrics).

- defect 4: an engine that failed during a bus pause is back at its next heartbeat (fake
  clock, exact), and one that keeps failing while heartbeating sits out;
- defect 5: slow-body clients against a real router process are cut off after the read
  timeout, /health answers during the attack, they count as client errors, no 500;
- defect 7: the lookup budget ignores event-loop lag; a timeout is not an outage, and
  only a window of mostly timeouts opens the breaker;
- defect 6: a stopped Redis makes /health "degraded" and the redis_up gauge 0; a new
  Redis on the same port brings both back and cache-aware routing resumes;
- observability: a real engine reports KV usage and cache counters in its heartbeats;
  SGLang-named per-engine gauges and request histograms move; /health and
  /metrics polls are not counted as requests.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import nats
import pytest
import redis.asyncio as aioredis
from bus_helpers import next_chunk, spawn_engine, wait_heartbeats
from fake_engine import FakeEngine, running_mesh

from bus_schemas import (
    GenerateRequest,
    Heartbeat,
    Sampling,
    page_hashes,
    redis_keys,
    subjects,
)
from router.config import RouterConfig
from router.engines import EngineTable
from router.keys import TABLE
from router.metrics import RouterMetrics
from router.resp import RespClient
from router.routing import PrefixIndex, _budget
from services.launch.servers import ServerProcess, free_port, start_redis

pytestmark = pytest.mark.timeout(90)

PROMPT = "hello world, this is a test prompt"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(engine_id: str = "e1", epoch: str = "1", interval_s: float = 1.0) -> Heartbeat:
    return Heartbeat(engine_id, "default", epoch, "m", "ns", 4, 64, 260, [0], 0, 0, 0, interval_s)


def table(clock: FakeClock, **config: Any) -> EngineTable:
    return EngineTable(RouterConfig(**config), RouterMetrics(), clock)


async def wait_until(pred: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def samples(text: str, name: str) -> dict[str, float]:
    """`{labels: value}` of every sample of metric `name` in a /metrics text."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, value = line.rsplit(" ", 1)
            out[key[len(name) :]] = float(value)
    return out


# ------------------------------------------------------------------ defect 4


def test_a_nats_pause_costs_the_pause_plus_one_heartbeat() -> None:
    """5 s without heartbeats; 20 requests fail in that time (one incident). The engine is
    live again at its first heartbeat after the pause, not 30 s later."""
    clock = FakeClock()
    t = table(clock)
    t.observe(beat())
    assert t.is_alive("e1")
    for _ in range(20):  # requests timing out during the pause
        clock.now += 0.25
        t.mark_failed("e1", "timeout")
    assert not t.is_alive("e1")
    clock.now += 0.1  # the pause ends; the next heartbeat arrives
    t.observe(beat())
    assert t.is_alive("e1")
    assert [e.engine_id for e in t.live()] == ["e1"]


async def test_after_a_real_nats_pause_the_engine_is_back_at_its_next_heartbeat(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    """nats-server stopped (SIGSTOP) while a request waits: the request fails and the
    engine is marked failed; after SIGCONT it serves again as soon as it heartbeats (on
    90556fa it sat out 30 s). Heartbeats every second: the engine stays live for three of
    them, well past the request's 1 s deadline, so the request reaches it and times out even
    on a loaded machine (at 0.2 s its heartbeats could expire before the router chose)."""
    kw: dict[str, Any] = {"interval_s": 1.0}
    async with running_mesh(
        nats_server.url, redis_server.url, 1, engine_kw=kw, request_timeout_s=1.0
    ) as mesh:
        engine, table = mesh.engines[0], mesh.client.app[TABLE]
        nats_server.proc.send_signal(signal.SIGSTOP)
        try:
            r = await mesh.client.post("/v1/completions", json={"prompt": "hi"})
            assert r.status in (502, 504), await r.text()
            assert not table.is_alive(engine.engine_id)
        finally:
            nats_server.proc.send_signal(signal.SIGCONT)
        await wait_until(lambda: table.is_alive(engine.engine_id), 10.0)
        r = await mesh.client.post("/v1/completions", json={"prompt": "hi"})
        assert r.status == 200, await r.text()


def test_an_engine_failing_while_it_heartbeats_sits_out_after_three_strikes() -> None:
    clock = FakeClock()
    t = table(clock, failed_quarantine_s=30.0, failed_strikes=3)
    t.observe(beat())
    for strike in (1, 2):
        t.mark_failed("e1", "hung")
        assert not t.is_alive("e1")
        clock.now += 1.0
        t.observe(beat())
        assert t.is_alive("e1"), f"strike {strike}: back at the next heartbeat"
    t.mark_failed("e1", "hung")  # third incident within the window: quarantine
    for _ in range(29):
        clock.now += 1.0
        t.observe(beat())
        assert not t.is_alive("e1")
    clock.now += 1.5
    t.observe(beat())
    assert t.is_alive("e1")  # quarantine over


def test_strikes_expire_and_a_new_epoch_clears_them() -> None:
    clock = FakeClock()
    t = table(clock, failed_quarantine_s=10.0, failed_strikes=2)
    t.observe(beat())
    t.mark_failed("e1", "x")
    t.observe(beat())
    clock.now += 11.0  # longer than the window: the next failure is strike 1 again
    t.mark_failed("e1", "x")
    t.observe(beat())
    assert t.is_alive("e1")
    t.mark_failed("e1", "x")  # strike 2 of 2: out, heartbeats or not
    t.observe(beat())
    assert not t.is_alive("e1")
    t.observe(beat(epoch="2"))  # restarted: a fresh engine
    assert t.is_alive("e1")
    # requests sent to epoch 1 that fail now (late, after their timeout) are not held
    # against epoch 2: CI once saw three of them quarantine a restarted decode engine
    for _ in range(3):
        t.mark_failed("e1", "did not answer within 10 s", epoch="1")
    assert t.is_alive("e1")
    t.mark_failed("e1", "x", epoch="2")
    assert not t.is_alive("e1")


async def test_a_request_held_by_an_engine_that_restarted_fails_over_at_once(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    """An engine killed and restarted by its supervisor heartbeats again under the same id
    before the router missed any beat: its streams and admits must fail as soon as the new
    epoch shows (the new process never had them), and that failure must not count against
    the new epoch."""
    async with running_mesh(nats_server.url, redis_server.url, 1, request_timeout_s=60) as mesh:
        (engine,) = mesh.engines
        table = mesh.client.app[TABLE]
        engine.mute_generate = True  # the old process took it and died with it
        task = asyncio.create_task(
            mesh.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
        )
        await wait_until(lambda: bool(engine.received))
        old = engine.epoch
        engine.epoch, engine.mute_generate = "restarted", False
        await engine.beat()
        r = await asyncio.wait_for(task, 20)  # far below the 60 s request timeout
        assert r.status == 200, await r.text()  # retried on the new process
        assert len(engine.received) == 2 and table.epoch_of(engine.engine_id) != old
        assert table.is_alive(engine.engine_id)  # not marked failed for its old epoch


# ------------------------------------------------------------------ defect 5

SLOW_CLIENTS = 200


@pytest.fixture
def router_process(nats_server: ServerProcess, redis_server: ServerProcess) -> Iterator[int]:
    """A real router process with a 1 s read timeout and a cap of 150 connections."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            *("-m", "router", "--log-level", "INFO", "--port", str(port)),
            *("--nats-url", nats_server.url, "--redis-url", redis_server.url),
            *("--read-timeout", "1", "--max-connections", "150"),
        ],
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out = proc.communicate(timeout=20)[0].decode()
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0].decode()
        assert "Traceback" not in out, out[-3000:]


async def slow_upload(port: int) -> bool:
    """Promise 1,000 body bytes, send 10, wait. True when the router closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n"
        )
        writer.write(head.encode() + b'{"prompt":')
        await writer.drain()
        async with asyncio.timeout(30):  # a hang bound, not a timing assertion
            while await reader.read(4096):
                pass
        return True
    except (ConnectionError, TimeoutError):
        return True
    finally:
        writer.close()


async def test_slow_body_clients_are_cut_off_and_counted_as_client_errors(
    router_process: int, nats_server: ServerProcess
) -> None:
    port = router_process
    base = f"http://127.0.0.1:{port}"
    engine = FakeEngine("slow-e", nats_server.url, interval_s=0.2)
    await engine.start()
    try:
        async with aiohttp.ClientSession() as http:
            await wait_until_async(lambda: _ok(http, base + "/health"), 20.0)
            attack = [asyncio.create_task(slow_upload(port)) for _ in range(SLOW_CLIENTS)]
            await asyncio.sleep(0.3)  # all of them connected and stalled
            # /health gets in over the cap (an idle slow reader is evicted for it)
            async with http.get(base + "/health") as r:
                assert r.status == 200, await r.text()
            closed = await asyncio.gather(*attack)
            assert all(closed) and len(closed) == SLOW_CLIENTS
            # the router still serves
            async with http.post(base + "/v1/completions", json={"prompt": "hi"}) as r:
                assert r.status == 200, await r.text()
            async with http.get(base + "/metrics") as r:
                text = await r.text()
    finally:
        await engine.stop()
    requests = samples(text, "hicache_router_requests_total")
    statuses = {k.split('status="')[1].split('"')[0]: v for k, v in requests.items()}
    assert "500" not in statuses, statuses
    client_errors = statuses.get("408", 0) + statuses.get("499", 0)
    assert client_errors >= SLOW_CLIENTS - 150  # at least those evicted or timed out
    closed_by = samples(text, "hicache_router_connections_closed_total")
    assert closed_by.get('{reason="evicted"}', 0) >= SLOW_CLIENTS - 150
    assert closed_by.get('{reason="read_timeout"}', 0) >= 1
    assert statuses.get("200") == 1  # the one completion; /health polls are not counted


def test_the_connection_cap_fits_under_the_descriptor_limit() -> None:
    """With 1,000 descriptors a cap of 4,096 could never act before EMFILE (which fails
    /health and Redis too): it is lowered to leave room for them."""
    code = (
        "import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (1000, 1000));"
        "from router.server import fit_to_fd_limit; print(fit_to_fd_limit(4096))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "744"


async def _ok(http: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with http.get(url) as r:
            return r.status == 200
    except aiohttp.ClientError:
        return False


async def wait_until_async(pred: Callable[[], Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await pred():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


# ------------------------------------------------------------------ defect 6


async def test_redis_down_is_degraded_and_recovery_resumes_cache_routing(
    nats_server: ServerProcess, fresh_redis: ServerProcess
) -> None:
    kw: dict[str, Any] = {"redis_probe_s": 0.1, "redis_probe_timeout_s": 0.3}
    async with running_mesh(nats_server.url, fresh_redis.url, 2, **kw) as mesh:
        c = mesh.client
        a, b = mesh.engines
        body = await (await c.get("/health")).json()
        assert body["status"] == "ok" and body["reasons"] == []
        assert await gauge(c, "hicache_router_redis_up") == 1
        fresh_redis.stop()
        await wait_until_async(lambda: _status_is(c, "degraded"), 10.0)
        r = await c.get("/health")
        body = await r.json()
        assert r.status == 200 and body["redis_connected"] is False
        assert any("redis is down" in reason for reason in body["reasons"])
        assert await gauge(c, "hicache_router_redis_up") == 0
        r = await c.post("/generate", json={"text": PROMPT})
        assert r.status == 200
        # a new Redis on the same port: seen by the probe without any request
        new = start_redis(fresh_redis.port)
        try:
            await wait_until_async(lambda: _status_is(c, "ok"), 10.0)
            assert await gauge(c, "hicache_router_redis_up") == 1
            hashes = page_hashes(list(PROMPT.encode()), a.page_size, a.namespace)
            r_ = aioredis.Redis.from_url(new.url)
            for h in hashes[:3]:
                await r_.hset(redis_keys.page(h), b.engine_id, 1)
            await r_.aclose()
            resp = await c.post("/generate", json={"text": PROMPT})
            assert (await resp.json())["meta_info"]["engine_id"] == b.engine_id
            text = await (await c.get("/metrics")).text()
            decisions = samples(text, "hicache_router_routing_decisions_total")
            assert decisions['{reason="cache"}'] == 1
            assert decisions['{reason="redis_down"}'] >= 1
        finally:
            new.stop()


async def gauge(client: Any, name: str) -> float:
    text = await (await client.get("/metrics")).text()
    return samples(text, name)[""]


async def _status_is(client: Any, status: str) -> bool:
    return (await (await client.get("/health")).json()).get("status") == status


# ------------------------------------------------------------------ observability


async def test_sglang_metrics_per_engine_and_histograms_move(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    kw = {"tokens_per_chunk": 2, "token_delay_s": 0.01}
    async with running_mesh(nats_server.url, redis_server.url, 2, engine_kw=kw) as mesh:
        c = mesh.client
        a, b = mesh.engines
        a.waiting, a.token_usage, a.evicted_device_pages = 3, 0.25, 7
        await a.beat()
        await wait_until(lambda: _hb(mesh, a.engine_id).waiting == 3)
        for _ in range(5):
            assert (await c.get("/health")).status == 200
        text = await (await c.get("/metrics")).text()
        assert samples(text, "hicache_router_requests_total") == {}  # polls do not count
        running = samples(text, "sglang:num_running_reqs")
        queued = samples(text, "sglang:num_queue_reqs")
        usage = samples(text, "sglang:token_usage")
        for e in (a, b):
            key = f'{{bucket="default",engine_id="{e.engine_id}",model_name="tiny-test"}}'
            assert running[key] == 0
            assert key in samples(text, "sglang:cache_hit_rate")
            assert key in samples(text, "hicache_engine_cache_loads_total")
        assert queued[f'{{bucket="default",engine_id="{a.engine_id}",model_name="tiny-test"}}'] == 3
        assert (
            usage[f'{{bucket="default",engine_id="{a.engine_id}",model_name="tiny-test"}}'] == 0.25
        )
        evicted = samples(text, "hicache_engine_evicted_device_pages_total")
        assert (
            evicted[f'{{bucket="default",engine_id="{a.engine_id}",model_name="tiny-test"}}'] == 7
        )
        assert f'{{bucket="default",engine_id="{b.engine_id}",model_name="tiny-test"}}' in samples(
            text, "hicache_engine_evicted_host_pages_total"
        )
        e2e = 'sglang:e2e_request_latency_seconds_count{model_name="tiny-test"}'
        assert e2e not in text
        r = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6})
        assert r.status == 200
        text = await (await c.get("/metrics")).text()
        model = '{model_name="tiny-test"}'
        assert samples(text, "sglang:e2e_request_latency_seconds_count")[model] == 1
        assert samples(text, "sglang:time_to_first_token_seconds_count")[model] == 1
        assert samples(text, "sglang:queue_time_seconds_count")[model] == 1
        assert samples(text, "sglang:time_per_output_token_seconds_count")[model] == 1
        assert samples(text, "sglang:inter_token_latency_seconds_count")[model] == 4  # 6 - 2
        assert samples(text, "sglang:prompt_tokens_total")[model] == len(PROMPT)
        assert samples(text, "sglang:generation_tokens_total")[model] == 6
        assert model in samples(text, "sglang:cached_tokens_total")
        requests = samples(text, "hicache_router_requests_total")
        assert requests == {'{endpoint="/v1/completions",status="200"}': 1.0}


def _hb(mesh: Any, engine_id: str) -> Heartbeat:
    return next(
        hb for hb, _ in mesh.client.app[TABLE].live_heartbeats() if hb.engine_id == engine_id
    )


# ------------------------------------------------------------------ defect 7


async def test_the_lookup_budget_does_not_count_event_loop_lag() -> None:
    """A reply that came within the budget, while the loop was busy, is taken (with a plain
    `asyncio.timeout` the late deadline cancels it)."""

    async def answer() -> str:
        await asyncio.sleep(0.02)  # Redis answers in 20 ms
        return "hits"

    async with _budget(0.05):
        task = asyncio.ensure_future(answer())
        await asyncio.sleep(0)
        time.sleep(0.2)  # the router is busy for 200 ms: every callback runs late
        assert await task == "hits"
    with pytest.raises(TimeoutError):  # an idle loop still cuts a slow answer at the budget
        async with _budget(0.05):
            await asyncio.sleep(0.5)


async def test_a_hung_redis_times_out_apart_from_down_and_opens_the_breaker(
    fresh_redis: ServerProcess,
) -> None:
    config = RouterConfig(redis_timeout_s=0.05, redis_breaker_window=10, redis_retry_s=60.0)
    metrics = RouterMetrics()
    client = RespClient(fresh_redis.url)
    index = PrefixIndex(client, config, metrics, asyncio.get_running_loop().time)
    hashes = page_hashes(list(PROMPT.encode()), 4, "ns")
    try:
        assert (await index.lookup(hashes)).hits == {}
        fresh_redis.proc.send_signal(signal.SIGSTOP)
        try:
            for _ in range(9):
                found = await index.lookup(hashes)
                assert (found.hits, found.failure) == (None, "redis_timeout")
            text = metrics.render().decode()
            assert samples(text, "hicache_router_store_timeouts_total")[""] == 9
            assert samples(text, "hicache_router_store_errors_total")[""] == 0
            assert index.up  # slow is not down
            # 9 of the last 10 timed out (>= 0.8): the breaker is open, Redis is not asked
            assert (await index.lookup(hashes)).failure == "redis_timeout"
            text = metrics.render().decode()
            assert samples(text, "hicache_router_store_timeouts_total")[""] == 9
        finally:
            fresh_redis.proc.send_signal(signal.SIGCONT)
    finally:
        await client.aclose()


async def test_one_timeout_among_answers_keeps_cache_routing(fresh_redis: ServerProcess) -> None:
    config = RouterConfig(redis_timeout_s=0.05, redis_breaker_window=10)
    client = RespClient(fresh_redis.url)
    index = PrefixIndex(client, config, RouterMetrics(), asyncio.get_running_loop().time)
    hashes = page_hashes(list(PROMPT.encode()), 4, "ns")
    try:
        for _ in range(9):
            assert (await index.lookup(hashes)).hits == {}
        fresh_redis.proc.send_signal(signal.SIGSTOP)
        try:
            assert (await index.lookup(hashes)).failure == "redis_timeout"
        finally:
            fresh_redis.proc.send_signal(signal.SIGCONT)
        assert (await index.lookup(hashes)).hits == {}  # the next lookup asks Redis again
    finally:
        await client.aclose()


async def test_a_lookup_runs_meanwhile_once_while_its_command_is_out(
    fresh_redis: ServerProcess,
) -> None:
    """The router encodes the engine's request during the Redis round trip: `meanwhile` runs
    once, after the lookup is written and before its reply is awaited, whatever Redis does;
    a `meanwhile` that raises leaves the connection in step."""
    client = RespClient(fresh_redis.url)
    index = PrefixIndex(client, RouterConfig(), RouterMetrics(), asyncio.get_running_loop().time)
    hashes = page_hashes(list(PROMPT.encode()), 4, "ns")
    seen: list[int] = []

    def meanwhile() -> None:
        assert client._conn is not None
        seen.append(len(client._conn._waiting))  # commands written, replies not yet read

    try:
        assert (await index.lookup(hashes)).hits == {}  # connects
        assert (await index.lookup(hashes, meanwhile=meanwhile)).hits == {}
        assert seen == [1]

        def broken() -> None:
            raise RuntimeError("encoding failed")

        with pytest.raises(RuntimeError, match="encoding failed"):
            await index.lookup(hashes, meanwhile=broken)
        assert await client.execute("PING") == "PONG"  # after the dropped reply: in step
        assert (await index.lookup(hashes, meanwhile=meanwhile)).hits == {}
        assert seen == [1, 1]
        assert (await index.lookup([], meanwhile=meanwhile)).hits == {}  # nothing to ask
        fresh_redis.stop()
        assert (await index.lookup(hashes, meanwhile=lambda: seen.append(-1))).failure == (
            "redis_down"
        )
        assert (await index.lookup(hashes, meanwhile=lambda: seen.append(-2))).failure == (
            "redis_down"
        )
        assert seen == [1, 1, 0, -1, -2]  # once each, down or not
    finally:
        await client.aclose()


# ------------------------------------------------------------------ engine heartbeats


async def test_a_real_engine_reports_cache_usage_and_counters_in_heartbeats(
    nats_server: ServerProcess,
) -> None:
    # 16 device pages: one 37-token prompt (10 pages running, 9 cached) fits, two do not
    flags = ["--model", "tiny", "--page-size", "4", "--max-total-tokens", "64"]
    flags += ["--enable-hierarchical-cache"]
    proc = spawn_engine(nats_server.url, "hb-stats", *flags, "--heartbeat-interval", "0.2")
    nc = await nats.connect(nats_server.url)
    try:
        first = (await wait_heartbeats(nc, {"hb-stats"}))["hb-stats"]
        assert (first.token_usage, first.cached_tokens, first.num_loads) == (0.0, 0, 0)
        assert (first.evicted_device_pages, first.evicted_host_pages) == (0, 0)
        prompt = list(range(10, 47))  # 37 tokens: 36 reusable at page 4
        for _ in range(2):
            await _generate(nc, "hb-stats", prompt)
        latest: list[Heartbeat] = []

        async def keep(msg: Any) -> None:
            hb = Heartbeat.decode(msg.data)
            if hb.engine_id == "hb-stats":
                latest.append(hb)

        sub = await nc.subscribe(subjects.HEARTBEAT_ALL, cb=keep)
        await wait_until(lambda: bool(latest) and latest[-1].cached_tokens == 36)
        await sub.unsubscribe()
        hb = latest[-1]
        assert 0.0 < hb.token_usage <= 1.0  # the cached prompt holds device pages
        assert 0.0 <= hb.host_token_usage <= 1.0
        assert hb.evicted_device_pages == 0
        latest.clear()
        sub = await nc.subscribe(subjects.HEARTBEAT_ALL, cb=keep)
        await _generate(nc, "hb-stats", list(range(100, 137)))  # makes room: evicts the first
        await wait_until(lambda: bool(latest) and latest[-1].evicted_device_pages > 0)
        await sub.unsubscribe()
        assert latest[-1].evicted_host_pages == 0  # 32 host pages hold both prompts
    finally:
        await nc.drain()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


async def _generate(nc: Any, engine_id: str, ids: list[int]) -> None:
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    req = GenerateRequest(uuid.uuid4().hex, ids, Sampling(3, ignore_eos=True), inbox)
    await nc.publish(subjects.engine_generate(engine_id), req.encode())
    while not (await next_chunk(sub)).finished:
        pass
    await sub.unsubscribe()
