"""Engine failure paths (DESIGN.md 7a): a request's own failure fails that request alone;
a dead step loop stops heartbeats, fails everything it held and exits non-zero; SIGTERM
stops an engine while NATS is unreachable."""

from __future__ import annotations

import asyncio
import math
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest
import torch
from bus_helpers import chunk_of, connect_as, next_chunk, spawn_engine, wait_heartbeats
from fake_engine import running_mesh
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from test_router import set_load

from bus_schemas import (
    DecodeAdmit,
    DecodeAdmitReply,
    GenerateRequest,
    Heartbeat,
    PrefillRequest,
    Sampling,
    TokenChunk,
)
from bus_schemas import subjects as subj
from bus_schemas.token_ids import as_token_ids
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.scheduler.request import ReqState
from router.keys import TABLE
from services.cli import build_parser
from services.launch.servers import ServerProcess, free_port, start_nats
from services.launch.up import Mesh

POISON = 7  # an embedding row set to NaN: a prompt holding it yields NaN logits


def nan_engine() -> Engine:
    engine = Engine(EngineConfig())
    with torch.no_grad():
        engine.model.embed_tokens.weight[POISON] = math.nan
    return engine


def test_a_request_that_fails_in_sampling_fails_alone() -> None:
    """NaN logits for one request of a batch: it ends with a 500, the others finish with the
    same tokens as alone, its pages go back, and the engine keeps serving."""
    sp = SamplingParams(max_new_tokens=6, temperature=0.7, seed=3, ignore_eos=True)
    good = [list(range(20, 33)), list(range(40, 49))]
    alone = [nan_engine().generate(p, sp).output_ids for p in good]
    engine = nan_engine()
    free_before = engine.cache.num_free_device_pages
    bad = engine.submit([1, 2, POISON, 4, 5], sp)
    reqs = [engine.submit(p, sp) for p in good]
    outs = engine.run([*reqs, bad])
    assert bad.error is not None and bad.error.code == 500
    assert "sampling failed" in bad.error.message
    assert bad.state is ReqState.FINISHED and bad.output_ids == []
    assert [o.output_ids for o in outs[:2]] == alone
    assert all(o.finish_reason == "length" for o in outs[:2])
    engine.check_integrity()
    engine.cache.drain()
    assert engine.cache.num_free_device_pages + engine.cache.tree.num_device_pages == free_before
    assert engine.generate(good[0], sp).output_ids == alone[0]  # still serving
    engine.check_integrity()


# --------------------------------------------------------------- a step loop that dies

CRASH_TOKEN = 3
FLAGS = ["--model", "tiny", "--page-size", "4", "--max-total-tokens", "2048"]
FLAGS += ["--heartbeat-interval", "0.2"]


class Collector:
    """Every TokenChunk on one inbox, and every heartbeat of one engine, with arrival times."""

    def __init__(self, nc: NATS, engine_id: str) -> None:
        self.nc = nc
        self.engine_id = engine_id
        self.chunks: dict[str, list[TokenChunk]] = {}
        self.heartbeats: list[float] = []
        self.first_error_at: float | None = None
        self.inbox = nc.new_inbox()

    async def start(self) -> None:
        await self.nc.subscribe(self.inbox, cb=self._on_chunk)
        await self.nc.subscribe(subj.HEARTBEAT_ALL, cb=self._on_heartbeat)

    async def _on_chunk(self, msg: Msg) -> None:
        chunk = chunk_of(msg.data)
        if chunk is None:  # the engine's progress on a request
            return
        self.chunks.setdefault(chunk.request_id, []).append(chunk)
        if chunk.error is not None and self.first_error_at is None:
            self.first_error_at = time.monotonic()

    async def _on_heartbeat(self, msg: Msg) -> None:
        if Heartbeat.decode(msg.data).engine_id == self.engine_id:
            self.heartbeats.append(time.monotonic())

    async def send(self, ids: list[int], max_new: int) -> str:
        rid = uuid.uuid4().hex
        req = GenerateRequest(
            rid, as_token_ids(ids), Sampling(max_new, ignore_eos=True), self.inbox
        )
        await self.nc.publish(subj.engine_generate(self.engine_id), req.encode())
        return rid

    def finished(self, rid: str) -> TokenChunk | None:
        last = self.chunks.get(rid, [])[-1:]
        return last[0] if last and last[0].finished else None


async def test_a_step_loop_crash_fails_every_request_stops_heartbeats_and_exits(
    nats_server: ServerProcess,
) -> None:
    """Requests running and queued when the step loop dies all get an error chunk marked
    `engine_crashed`; heartbeats stop at once; the process exits non-zero."""
    eid = "crashy"
    flags = [*FLAGS, "--max-running-requests", "2", "--debug-crash-on-prompt-token"]
    proc = spawn_engine(nats_server.url, eid, *flags, str(CRASH_TOKEN))
    nc = await nats.connect(nats_server.url)
    try:
        await wait_heartbeats(nc, {eid})
        col = Collector(nc, eid)
        await col.start()
        running = [await col.send(list(range(20 + i, 40 + i)), 500) for i in range(3)]
        # two run, one is queued; and one heartbeat is seen, so "they stopped" can be checked
        while not (all(col.chunks.get(r) for r in running[:2]) and col.heartbeats):
            await asyncio.sleep(0.02)
        poison = await col.send([CRASH_TOKEN, 9, 10, 11], 4)
        rids = [*running, poison]
        for _ in range(500):
            if all(col.finished(r) for r in rids):
                break
            await asyncio.sleep(0.02)
        for rid in rids:
            last = col.finished(rid)
            assert last is not None, f"request {rid} got no final chunk"
            assert last.engine_crashed and last.error_code == 500
            assert last.error is not None and "crashed" in last.error
        assert proc.wait(10) == 1
        await asyncio.sleep(0.6)  # three heartbeat intervals
        # heartbeats stopped before the first error chunk went out (same connection, in order)
        assert col.first_error_at is not None and col.heartbeats
        assert not [t for t in col.heartbeats if t > col.first_error_at], "heartbeats went on"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await nc.close()


async def test_pd_engines_that_crash_mark_their_errors_and_exit(
    nats_server: ServerProcess,
) -> None:
    """P/D: a prefill engine whose step loop dies reports the crash (marked) on the
    request's reply subject and exits 1; a decode engine that dies while admitting refuses
    the admit with code 500 (the router's "engine_crashed") and exits 1."""

    def spawn(eid: str, mode: str, token: int) -> subprocess.Popen[bytes]:
        crash = ["--debug-crash-on-prompt-token", str(token)]
        return spawn_engine(nats_server.url, eid, *FLAGS, *crash, "--disaggregation-mode", mode)

    pre = spawn("crash-pre", "prefill", CRASH_TOKEN)
    dec = spawn("crash-dec", "decode", CRASH_TOKEN + 1)  # serves prompts with CRASH_TOKEN
    nc = await nats.connect(nats_server.url)
    try:
        await wait_heartbeats(nc, {"crash-pre", "crash-dec"})
        prompt = as_token_ids([CRASH_TOKEN, *range(20, 31)])
        sampling = Sampling(4, ignore_eos=True)
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        admit = DecodeAdmit("pd-crash-1", prompt, sampling, inbox, "", True, 5.0)
        msg = await nc.request(subj.engine_decode_admit("crash-dec"), admit.encode(), timeout=30)
        reply = DecodeAdmitReply.decode(msg.data)
        assert reply.error is None, reply.error
        req = PrefillRequest(
            "pd-crash-1", prompt, sampling, "", reply.decode_prefix_len, reply.kv_subject, inbox
        )
        await nc.publish(subj.engine_prefill("crash-pre"), req.encode())
        chunk = await next_chunk(sub)
        assert chunk.engine_id == "crash-pre" and chunk.finished
        assert chunk.engine_crashed and chunk.error_code == 500, chunk
        assert pre.wait(10) == 1
        assert dec.poll() is None  # decode waits for KV that never comes; it did not crash
        bad_prompt = as_token_ids([CRASH_TOKEN + 1, *range(20, 31)])
        admit = DecodeAdmit("pd-crash-2", bad_prompt, sampling, inbox, "", True, 5.0)
        msg = await nc.request(subj.engine_decode_admit("crash-dec"), admit.encode(), timeout=30)
        reply = DecodeAdmitReply.decode(msg.data)
        assert reply.error is not None and reply.error_code == 500, reply
        assert dec.wait(10) == 1
    finally:
        await nc.close()
        for p in (pre, dec):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(30)


# --------------------------------------------------------------- SIGTERM with NATS down


class LoggedEngine:
    """An engine process whose stderr goes to a file the test can read while it runs."""

    def __init__(self, tmp_path: Path, nats_url: str, engine_id: str, *flags: str) -> None:
        self.log = tmp_path / f"{engine_id}.stderr"
        argv = [sys.executable, "-m", "services.engine", "--engine-id", engine_id]
        with self.log.open("wb") as err:
            self.proc = subprocess.Popen(
                [*argv, "--nats-url", nats_url, *flags], stdout=subprocess.DEVNULL, stderr=err
            )

    @property
    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    async def wait_for_log(self, text: str, timeout_s: float = 60) -> None:
        for _ in range(int(timeout_s / 0.1)):
            if text in self.stderr:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"{text!r} never logged:\n{self.stderr[-3000:]}")

    def terminate(self, deadline_s: float) -> int:
        """SIGTERM; the exit code, or -1 when it did not exit within `deadline_s`."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(deadline_s)
        except subprocess.TimeoutExpired:
            return -1

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


async def test_sigterm_stops_an_engine_while_nats_is_down(tmp_path: Path) -> None:
    """NATS dies under a running engine: reconnect attempts log one line each (no
    traceback), with backoff, and SIGTERM still stops the engine within its grace period
    plus a margin."""
    server = start_nats()
    grace = 1.0
    engine = LoggedEngine(tmp_path, server.url, "lonely", *FLAGS, "--shutdown-grace", str(grace))
    try:
        nc = await nats.connect(server.url)
        await wait_heartbeats(nc, {"lonely"})
        await nc.close()
        server.stop()
        await engine.wait_for_log("next attempt in")
        await asyncio.sleep(2.5)  # several more attempts
        code = engine.terminate(grace + 8)
    finally:
        server.stop()
        engine.kill()
    err = engine.stderr
    assert code == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    attempts = [line for line in err.splitlines() if "next attempt in" in line]
    assert 2 <= len(attempts) <= 12, err[-3000:]  # backs off: not one every 0.1 s


async def test_sigterm_stops_an_engine_whose_nats_is_frozen(tmp_path: Path) -> None:
    """nats-server SIGSTOPped (the socket stays open, nothing answers) with a request in
    flight: SIGTERM still stops the engine within grace + margin, without a traceback."""
    server = start_nats()
    grace = 1.0
    engine = LoggedEngine(tmp_path, server.url, "frozen", *FLAGS, "--shutdown-grace", str(grace))
    try:
        nc = await nats.connect(server.url)
        await wait_heartbeats(nc, {"frozen"})
        col = Collector(nc, "frozen")
        await col.start()
        rid = await col.send(list(range(20, 40)), 1000)
        while not col.chunks.get(rid):
            await asyncio.sleep(0.02)
        server.proc.send_signal(signal.SIGSTOP)
        await asyncio.sleep(0.5)
        start = time.monotonic()
        code = engine.terminate(grace + 12)
        took = time.monotonic() - start
    finally:
        server.proc.send_signal(signal.SIGCONT)
        server.stop()
        engine.kill()
    assert code == 0, engine.stderr[-3000:]
    assert "Traceback" not in engine.stderr, engine.stderr[-3000:]
    print(f"engine stopped {took:.1f} s after SIGTERM with NATS frozen")


async def test_engine_starts_before_nats_and_stops_on_sigterm_without_it(tmp_path: Path) -> None:
    """An engine started with no nats-server keeps retrying (one line per attempt) and
    serves once NATS comes up; an engine whose NATS never comes stops at once on SIGTERM."""
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    early = LoggedEngine(tmp_path, url, "early", *FLAGS, "--shutdown-grace", "1")
    waiting = LoggedEngine(tmp_path, f"nats://127.0.0.1:{free_port()}", "never", *FLAGS)
    server: ServerProcess | None = None
    try:
        await early.wait_for_log("next attempt in")
        server = start_nats(port)
        nc = await nats.connect(url)
        await wait_heartbeats(nc, {"early"}, timeout_s=30)
        await nc.close()
        assert early.terminate(15) == 0, early.stderr[-3000:]
        assert "Traceback" not in early.stderr, early.stderr[-3000:]
        await waiting.wait_for_log("next attempt in")
        assert waiting.terminate(8) == 0, waiting.stderr[-3000:]
        assert "Traceback" not in waiting.stderr, waiting.stderr[-3000:]
    finally:
        early.kill()
        waiting.kill()
        if server is not None:
            server.stop()


async def test_router_never_retries_a_request_that_crashed_an_engine(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    """A crash-marked error chunk before any token: 500 "engine_crashed", the other engine
    never sees the request, and the crashed engine sits out at once."""
    async with running_mesh(nats_server.url, redis_server.url, 2) as mesh:
        a, b = mesh.engines
        await set_load(mesh, b, 100_000)
        a.error, a.crashed = (500, "engine step loop crashed: boom"), True
        r = await mesh.client.post("/v1/completions", json={"prompt": "hello"})
        assert r.status == 500, await r.text()
        err = (await r.json())["error"]
        assert err["code"] == "engine_crashed" and "crashed" in err["message"]
        assert len(a.received) == 1 and b.received == []
        assert not mesh.client.app[TABLE].is_alive(a.engine_id)


# --------------------------------------------------------------- poison requests, real mesh

U64 = 2**64
# (endpoint, body beyond the prompt): every numeric extreme of every sampling parameter,
# the accepted ones and the ones just past each range
POISON_REQUESTS: list[tuple[str, dict[str, Any]]] = [
    *[("/v1/completions", {"temperature": t}) for t in (1e-320, 1e-310, 5e-324, 0, -0.0)],
    *[("/v1/completions", {"temperature": t}) for t in (1e-5, 1e300, 1.7976931348623157e308)],
    *[("/v1/completions", {"temperature": t}) for t in (-5e-324, -1, U64)],
    *[("/v1/completions", {"temperature": 1.0, "top_p": p}) for p in (5e-324, 1e-300, 1.0)],
    *[("/v1/completions", {"temperature": 1.0, "top_p": p}) for p in (0, -0.0, 1.0000001, 2)],
    *[("/v1/completions", {"temperature": 0.7, "seed": s}) for s in (0, 2**63 - 1)],
    *[("/v1/completions", {"temperature": 0.7, "seed": s}) for s in (-1, 2**63, U64, -(2**63))],
    *[("/v1/completions", {"max_tokens": n}) for n in (0, 1, 2**31, 2**63, -1)],
    *[("/v1/completions", {"stop_token_ids": ids}) for ids in ([0], [259], [260], [-1])],
    ("/v1/completions", {"stop_token_ids": [2**63]}),
    *[("/v1/completions", {"temperature": 1.0, "top_k": k}) for k in (-1, 0, 1, 259, 260, U64)],
    *[("/v1/completions", {"temperature": 1.0, "min_p": p}) for p in (0, 5e-324, 1.0, 1.01)],
    *[("/v1/completions", {"repetition_penalty": r}) for r in (5e-324, 1e-300, 1e300, 0)],
    *[("/v1/completions", {"presence_penalty": v}) for v in (-2, 2, 2.0000001)],
    *[("/v1/completions", {"frequency_penalty": v, "temperature": 0.9}) for v in (-2, 2)],
    ("/v1/completions", {"logit_bias": {str(t): 100 for t in range(260)}}),
    ("/v1/completions", {"logit_bias": {str(t): -100 for t in range(260)}, "temperature": 1}),
    ("/v1/completions", {"logit_bias": {"5": 100.0000001}}),
    *[("/v1/completions", {"logprobs": k}) for k in (0, 20, 21)],
    ("/v1/completions", {"n": 16, "temperature": 1e-320, "top_k": 1, "min_p": 1.0}),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 20, "repetition_penalty": 1e-300}),
    ("/v1/completions", {"temperature": 1e-320, "top_p": 5e-324, "stream": True}),
    ("/v1/completions", {"temperature": 1e300, "top_p": 5e-324, "seed": 2**63 - 1}),
    ("/v1/chat/completions", {"temperature": 1e-310, "top_p": 1e-300, "seed": 0}),
    *[
        ("/generate", {"sampling_params": sp})
        for sp in (
            {"temperature": 1e-320, "max_new_tokens": 4},
            {"temperature": 1e300, "top_p": 5e-324, "seed": 2**63 - 1, "max_new_tokens": 4},
            {"max_new_tokens": 0},
            {"stop_token_ids": [0, 259], "max_new_tokens": 4},
            {"seed": -1},
        )
    ],
]


@pytest.fixture(scope="module")
def up_mesh() -> Iterator[Mesh]:
    argv = ["up", "--port", str(free_port()), "--model", "tiny", "--engines", "2"]
    argv += ["--page-size", "4"]
    # heartbeats at the default 1 s: 40 requests at once on 2 busy cores can delay a 0.2 s
    # heartbeat past the router's liveness bound, and "no live engine" is not what we test
    argv += ["--max-total-tokens", "2048"]
    mesh = Mesh(build_parser().parse_args([*argv, "--startup-timeout", "120"]))
    mesh.start()
    yield mesh
    mesh.stop()


def _body(endpoint: str, extra: dict[str, Any]) -> dict[str, Any]:
    if endpoint == "/generate":
        return {"input_ids": [5, 6, 7, 8, 9, 10], **extra}
    if endpoint == "/v1/chat/completions":
        return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    return {"prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 4, **extra}


async def test_poison_requests_through_the_mesh_leave_every_engine_serving(
    up_mesh: Mesh,
) -> None:
    """The reported request (temperature 1e-320) and every numeric extreme, concurrently:
    each gets a 200 or a 4xx, no engine dies, and each engine still serves afterwards."""
    base = f"http://{up_mesh.args.host}:{up_mesh.args.port}"
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def send(endpoint: str, extra: dict[str, Any]) -> tuple[int, str]:
            async with http.post(base + endpoint, json=_body(endpoint, extra)) as r:
                return r.status, await r.text()

        results = await asyncio.gather(*(send(e, x) for e, x in POISON_REQUESTS))
        for (endpoint, extra), (status, text) in zip(POISON_REQUESTS, results, strict=True):
            assert status == 200 or 400 <= status < 500, (endpoint, extra, status, text)
        statuses = [s for s, _ in results]
        assert statuses.count(200) >= 45 and any(400 <= s < 500 for s in statuses)
        async with http.get(base + "/health") as r:
            health = await r.json()
            assert r.status == 200 and len(health["live_engines"]) == 2, health
    children = up_mesh.supervisor.children
    engines = [(n, c.proc) for n, c in children.items() if n.startswith("engine-")]
    assert [p.poll() if p else -1 for _, p in engines] == [None, None]  # none exited
    assert all(c.restarts == 0 for c in children.values())
    nats_url = str(up_mesh.supervisor.extra_status["nats_url"])
    nc = await connect_as(nats_url, up_mesh.creds.nats["router"])  # work is the router's
    try:
        col = Collector(nc, "")
        await col.start()
        for name, _ in engines:  # each engine, straight over the bus
            col.engine_id = name
            rid = await col.send([5, 6, 7, 8, 9, 10], 4)
            for _ in range(500):
                if col.finished(rid):
                    break
                await asyncio.sleep(0.02)
            last = col.finished(rid)
            assert last is not None and last.error is None and last.finish_reason == "length"
            assert sum(len(c.token_ids) for c in col.chunks[rid]) == 4
    finally:
        await nc.close()
