"""Readiness (issue 19, defect 4): `/ready` is 200 only when every configured bucket has a
ready engine of each role it needs, and says what is missing; `/health` keeps its meaning
(the router serves something).

With `--bucket short:max_len=64 --bucket long`, `/health` answered 200 as soon as the short
bucket's engine was up, and a request that needed the long bucket then got 503 `no live
engine in bucket 'long'`. Here the router runs against fake engines of each role (the
bucket and role rules), and against real engine processes, the long one started later.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from bus_helpers import spawn_engine
from fake_engine import FakeDecode, FakeEngine, FakePrefill

from router.app import init
from router.buckets import Bucket
from router.config import RouterConfig
from services.launch.servers import ServerProcess, free_port

pytestmark = pytest.mark.timeout(240)

LONG_PROMPT = list(range(1, 101))  # 100 tokens: past the short bucket's 64


async def _get(client: TestClient[Any, Any], path: str) -> tuple[int, dict[str, Any]]:
    resp = await client.get(path)
    return resp.status, await resp.json()


async def _until(client: TestClient[Any, Any], path: str, want: Any, timeout_s: float = 10) -> Any:
    """Poll `path` until `want(status, body)`; the last body."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        status, body = await _get(client, path)
        if want(status, body):
            return body
        assert asyncio.get_running_loop().time() < deadline, (path, status, body)
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def _router(nats_url: str, redis_url: str) -> AsyncIterator[TestClient[Any, Any]]:
    config = RouterConfig(
        nats_url=nats_url,
        redis_url=redis_url,
        buckets=(Bucket("short", 64), Bucket("long")),
        api_key="k",
        request_timeout_s=5.0,
        liveness_poll_s=0.05,
    )
    client: TestClient[Any, Any] = TestClient(TestServer(init(config)))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


async def test_ready_names_each_bucket_and_role_that_is_missing(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    tag = os.urandom(3).hex()
    auth = {"Authorization": "Bearer k"}
    engines: list[FakeEngine] = []

    async def start(engine: FakeEngine) -> FakeEngine:
        engines.append(engine)
        await engine.start()
        return engine

    async with _router(nats_server.url, redis_server.url) as client:
        try:
            status, body = await _get(client, "/ready")  # no key needed: a probe
            assert status == 503 and body["error"]["code"] == "not_ready"
            assert body["missing"] == [
                "bucket 'short': no ready engine (colocated, or prefill and decode)",
                "bucket 'long': no ready engine (colocated, or prefill and decode)",
            ]

            await start(FakeEngine(f"short-{tag}", nats_server.url, bucket="short"))
            await _until(client, "/health", lambda s, b: s == 200)
            status, body = await _get(client, "/ready")
            assert status == 503, body
            assert body["status"] == "not_ready"
            assert body["missing"] == [
                "bucket 'long': no ready engine (colocated, or prefill and decode)"
            ]
            assert body["error"]["message"] == "not ready: " + body["missing"][0]
            assert body["buckets"]["short"] == {
                "ready": True,
                "engines": {"colocated": [f"short-{tag}"]},
                "loading": [],
            }
            assert body["buckets"]["long"]["ready"] is False
            # what /health's 200 let through: a request that needs the long bucket
            resp = await client.post(
                "/v1/completions", json={"prompt": LONG_PROMPT, "max_tokens": 2}, headers=auth
            )
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "no_live_engine"

            # P/D in the long bucket: a prefill engine alone does not serve
            await start(FakePrefill(f"long-p-{tag}", nats_server.url, bucket="long"))
            body = await _until(
                client,
                "/ready",
                lambda s, b: (
                    "long" in b["buckets"] and b["buckets"]["long"]["engines"].get("prefill")
                ),
            )
            assert body["missing"] == [
                "bucket 'long': no ready decode engine (it has a prefill engine)"
            ]
            # a decode engine whose model card has not arrived is live, not ready
            await start(
                FakeDecode(
                    f"long-d-{tag}", nats_server.url, bucket="long", model="other", mute_card=True
                )
            )
            body = await _until(client, "/ready", lambda s, b: b["buckets"]["long"]["loading"])
            assert body["missing"] == [
                "bucket 'long': no ready decode engine (it has a prefill engine); "
                f"long-d-{tag} live, waiting for the model card"
            ]
            await start(FakeDecode(f"long-e-{tag}", nats_server.url, bucket="long"))
            body = await _until(client, "/ready", lambda s, b: s == 200)
            assert body["status"] == "ready" and body["missing"] == []
            assert body["buckets"]["long"]["engines"] == {
                "prefill": [f"long-p-{tag}"],
                "decode": [f"long-e-{tag}"],
            }
            body = {"prompt": LONG_PROMPT, "max_tokens": 2, "model": "tiny-test"}
            resp = await client.post("/v1/completions", json=body, headers=auth)
            assert resp.status == 200, await resp.text()
            assert resp.headers["X-Hicache-Engine"] == f"long-e-{tag}"
            # probes are not counted as requests
            metrics = await (await client.get("/metrics")).text()
            assert 'endpoint="/ready"' not in metrics
        finally:
            for e in engines:
                await e.stop()


# ---------------------------------------------------------------- real engine processes


def _status(url: str) -> tuple[int, dict[str, Any]] | None:
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return int(r.status), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return int(e.code), json.loads(e.read())
    except OSError:
        return None


def _wait(pred: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting: {what}"
        time.sleep(0.1)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_a_real_mesh_is_ready_only_once_its_slow_bucket_is(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    """Real router and engine processes: the short bucket's engine comes up, the long
    bucket's only later. /health is 200 in between (the router serves the short bucket),
    /ready is 503 naming the long bucket until its engine is ready, then 200, and the
    request that needs the long bucket is served."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    tag = os.urandom(3).hex()
    short, long = f"short-{tag}", f"long-{tag}"
    router = subprocess.Popen(
        [
            sys.executable,
            *("-m", "router", "--log-level", "WARNING", "--port", str(port)),
            *("--nats-url", nats_server.url, "--redis-url", redis_server.url),
            *("--bucket", "short:max_len=64", "--bucket", "long"),
        ],
    )
    flags = ("--model", "tiny", "--page-size", "4", "--max-total-tokens", "1024")
    flags += ("--heartbeat-interval", "0.5")
    procs = [router]
    try:
        procs.append(spawn_engine(nats_server.url, short, *flags, "--bucket", "short"))
        _wait(lambda: (_status(f"{base}/health") or (0,))[0] == 200, 120, "/health 200")
        answer = _status(f"{base}/ready")
        assert answer is not None and answer[0] == 503, answer
        assert answer[1]["missing"] == [
            "bucket 'long': no ready engine (colocated, or prefill and decode)"
        ]
        assert answer[1]["buckets"]["short"]["engines"] == {"colocated": [short]}
        body = {"prompt": LONG_PROMPT, "max_tokens": 2, "temperature": 0}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                assert resp.status == 503  # what a client got after /health's 200
            procs.append(spawn_engine(nats_server.url, long, *flags, "--bucket", "long"))
            _wait(lambda: (_status(f"{base}/ready") or (0,))[0] == 200, 120, "/ready 200")
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                assert resp.headers["X-Hicache-Engine"] == long
    finally:
        for proc in reversed(procs):
            _stop(proc)


# ---------------------------------------------------------------- `hicache-mesh up`


def test_up_is_ready_only_when_the_router_is_and_says_what_is_missing() -> None:
    """`up` waits on /ready, not /health: a router whose /health lists every engine ready
    while /ready still misses a bucket (a request for it would get 503) keeps `up` waiting,
    and its timeout names what /ready missed."""
    import argparse
    import http.server
    import json
    import threading

    from services.launch import up
    from services.launch.readiness import wait_ready

    parser = argparse.ArgumentParser()
    up.add_up_args(parser)
    plan = up.Mesh(parser.parse_args(["--bucket", "short:max_len=64", "--bucket", "long"]))
    names = [name for name, _ in plan.engines()]
    missing = "bucket 'long': no ready engine (colocated, or prefill and decode)"
    ready: dict[str, Any] = {"status": "not_ready", "missing": [missing], "buckets": {}}
    health: dict[str, Any] = {"status": "ok", "ready_engines": names}

    class Router(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, answer = (200, health) if self.path == "/health" else (503, ready)
            if self.path == "/ready" and not ready["missing"]:
                status = 200
            payload = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Router)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        health["pid"] = ready["pid"] = sleeper.pid
        with pytest.raises(TimeoutError, match=r"not ready within .*bucket 'long': no ready"):
            wait_ready(url, set(names), sleeper.pid, 1.5, lambda: False)
        ready.update(
            status="ready",
            missing=[],
            buckets={
                "short": {"engines": {"colocated": names[:1]}},
                "long": {"engines": {"colocated": names[1:]}},
            },
        )
        wait_ready(url, set(names), sleeper.pid, 10.0, lambda: False)
    finally:
        server.shutdown()
        sleeper.kill()
        sleeper.wait()
        plan.workdir.cleanup()
