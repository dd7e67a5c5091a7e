"""A real `hicache-mesh up` under concurrent clients, for the fault matrix (issue 7).

`UpMesh` runs `python -m services.cli up` as a subprocess in its own session and finds its
children (nats-server, redis-server, index, engines, router) by walking /proc for the
descendants of `up` and reading their command lines, so a child restarted by the supervisor
is found again under its new pid. `Load` runs N client loops (a mix of plain and streamed
greedy completions) and classifies every answer; `wait_healed` polls until every part of the
mesh serves again; `pools` flushes and reads every engine's page pools.

An answer is one of:
- "ok": 200 with the expected greedy tokens (a stream: no error event, then `[DONE]`);
- "error": a clear failure: a 5xx with an OpenAI-style JSON error body, or a stream that
  carries an error event and then `[DONE]`;
- "bad": anything else (a 4xx, a refused connection, a malformed body, a stream cut short,
  wrong tokens): a fault must never produce one;
- "hang": no answer within the per-request bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis
from bus_helpers import credentials_of, redis_url_as

from bus_schemas import redis_keys as rk
from services.launch.servers import free_port

REQUEST_TIMEOUT_S = 60.0  # the hang bound: every request is answered within it
STREAM_BOUND_S = 3 * REQUEST_TIMEOUT_S  # a held long stream ends within it (and never goes quiet)
PAGE = 4


# ------------------------------------------------------------------ processes


@dataclass(frozen=True, slots=True)
class Child:
    """One process of the mesh: its role ("nats", "redis", "index", "router" or an engine id)."""

    role: str
    pid: int
    argv: tuple[str, ...]


def _argv(pid: int) -> tuple[str, ...]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ()
    return tuple(a.decode(errors="replace") for a in raw.split(b"\0") if a)


def _ppid_and_state(pid: int) -> tuple[int, str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # the name may hold spaces and parens
    return int(fields[1]), fields[0]


def descendants(root: int) -> list[int]:
    """Every live (not zombie) process below `root`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = _ppid_and_state(int(entry))
            if info is not None and info[1] != "Z":
                children.setdefault(info[0], []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            out.append(pid)
            todo.append(pid)
    return out


def session_members(sid: int) -> list[int]:
    """Every live (not zombie) process of session `sid`, from /proc. `up`'s children run in
    process groups of their own (a terminal's Ctrl-C reaches only `up`), but stay in the
    session a test started `up` in, also once orphaned."""
    out = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else ""
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 3 and fields[0] != "Z" and int(fields[3]) == sid:
            out.append(int(entry))
    return out


def kill_session(sid: int) -> list[int]:
    """SIGKILL every process left in session `sid`; their pids."""
    left = session_members(sid)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


def role_of(argv: Sequence[str]) -> str | None:
    """Which part of the mesh a command line is, or None (rank workers, helpers)."""
    joined = " ".join(argv)
    if argv and argv[0].endswith("nats-server"):
        return "nats"
    if argv and ("redis-server" in argv[0] or "valkey-server" in argv[0]):
        return "redis"
    if "services.engine" in argv and "--engine-id" in argv:
        return argv[argv.index("--engine-id") + 1]
    if "services.index" in argv:
        return "index"
    if "-m router" in joined:
        return "router"
    return None


def _flag(argv: Sequence[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """How to start one mesh: colocated engines, or one prefill and one decode (`pd`)."""

    model: str = "tiny"  # `up`'s default is the real model: tests name theirs
    engines: int = 2
    pd: bool = False
    heartbeat_s: float = 0.5
    max_total_tokens: int = 4096
    extra: tuple[str, ...] = ()  # more `up` flags (e.g. --tp-size 2 --pp-size 2)
    host_tier: bool = True  # --enable-hierarchical-cache

    @property
    def engine_ids(self) -> tuple[str, ...]:
        if self.pd:
            return ("prefill-0", "decode-0")
        return tuple(f"engine-{i}" for i in range(self.engines))

    def argv(self, port: int) -> list[str]:
        topology = ["--pd"] if self.pd else ["--engines", str(self.engines)]
        return [
            sys.executable,
            "-m",
            "services.cli",
            "up",
            "--port",
            str(port),
            "--model",
            self.model,
            *topology,
            "--page-size",
            str(PAGE),
            "--max-total-tokens",
            str(self.max_total_tokens),
            *(["--enable-hierarchical-cache"] if self.host_tier else []),
            "--heartbeat-interval",
            str(self.heartbeat_s),
            *self.extra,
        ]


class UpMesh:
    """`hicache-mesh up` as a subprocess; its output goes to a log file for diagnostics."""

    def __init__(self, spec: MeshSpec, log_dir: Path) -> None:
        self.spec = spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"up-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, timeout_s: float = 120.0) -> None:
        """Start `up` and wait until it prints its URL (which it does once /health is ok)."""
        self.starts += 1
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.spec.argv(self.port), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while b"is up" not in self.log_path.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`up` did not come up:\n{self.log_tail()}")
            time.sleep(0.1)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        """Ctrl-C, then kill whatever is left of the session; `up`'s exit code."""
        if self.proc is None:
            return None
        for child in self.children():  # a stopped child would ignore the SIGINT cascade
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGCONT)
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGINT)
        try:
            code: int | None = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            code = None
        kill_session(self.proc.pid)
        self.proc.wait()
        return code

    def children(self) -> list[Child]:
        if self.proc is None:
            return []
        out = []
        for pid in descendants(self.proc.pid):
            argv = _argv(pid)
            role = role_of(argv)
            if role is not None:
                out.append(Child(role, pid, argv))
        return out

    def ranks_of(self, engine: str) -> dict[int, int]:
        """World rank -> pid of the rank processes (ranks 1..N-1) of engine `engine`."""
        out = {}
        for pid in descendants(self.pid_of(engine)):
            argv = _argv(pid)
            if "gpu_worker.engine.rank" in argv:
                out[int(_flag(argv, "--rank"))] = pid
        return out

    def pid_of(self, role: str) -> int:
        pids = [c.pid for c in self.children() if c.role == role]
        assert len(pids) == 1, f"{role}: pids {pids}; children {self.children()}"
        return pids[0]

    def redis_url(self) -> str:
        """The mesh's Redis, as the index's user (it may read and write the index keys)."""
        creds = credentials_of(self.credentials_dir(), "redis", "index")
        return redis_url_as(self.plain_redis_url(), creds)

    def redis_options(self) -> dict[str, Any]:
        """redis-py options for the mesh's Redis: its CA where it serves TLS (`up --tls`)."""
        router = next(c for c in self.children() if c.role == "router")
        if "--redis-tls-ca-file" not in router.argv:
            return {}
        return {"ssl_ca_certs": _flag(router.argv, "--redis-tls-ca-file")}

    def plain_redis_url(self) -> str:
        """The mesh's Redis, with no user in the URL."""
        router = next(c for c in self.children() if c.role == "router")
        return _flag(router.argv, "--redis-url")

    def nats_url(self) -> str:
        router = next(c for c in self.children() if c.role == "router")
        return _flag(router.argv, "--nats-url")

    def credentials_dir(self) -> Path:
        """Where `up` made this mesh's credentials (the folder of the router's files)."""
        router = next(c for c in self.children() if c.role == "router")
        return Path(_flag(router.argv, "--nats-credentials")).parent.parent

    def log_tail(self, n: int = 60) -> str:
        lines = self.log_path.read_bytes().decode(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def signal(self, role: str, sig: signal.Signals) -> int:
        pid = self.pid_of(role)
        os.kill(pid, sig)
        return pid


@contextlib.contextmanager
def running_mesh(
    spec: MeshSpec, tmp: pytest.TempPathFactory, name: str, timeout_s: float = 180
) -> Iterator[UpMesh]:
    """`up` for a module's tests, its logs under $FAULT_MATRIX_LOG_DIR (else a temporary
    folder named `name`); it must stop cleanly."""
    log_dir = Path(os.environ.get("FAULT_MATRIX_LOG_DIR", tmp.mktemp(name)))
    log_dir.mkdir(parents=True, exist_ok=True)
    mesh = UpMesh(spec, log_dir)
    mesh.start(timeout_s=timeout_s)
    try:
        yield mesh
    finally:
        code = mesh.stop()
    assert code == 0, f"`up` did not stop cleanly: {code}\n{mesh.log_tail()}"


# ------------------------------------------------------------------ requests


@dataclass(frozen=True, slots=True)
class Req:
    prompt: tuple[int, ...]
    max_tokens: int
    stream: bool


@dataclass(frozen=True, slots=True)
class Answer:
    kind: str  # "ok" | "error" | "bad" | "hang"
    status: int
    detail: str
    tokens: tuple[int, ...] = ()
    engine: str = ""


def prompts(n: int = 8, length: int = 26) -> list[tuple[int, ...]]:
    """`n` distinct prompts that share no page, so each is a cache miss on its first send."""
    return [tuple((97 * k + 13 * i + 5) % 250 for i in range(length)) for k in range(n)]


def body_of(req: Req) -> dict[str, Any]:
    return {
        "prompt": list(req.prompt),
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": req.stream,
    }


def _is_error_body(data: Any) -> bool:
    err = data.get("error") if isinstance(data, dict) else None
    return isinstance(err, dict) and bool(err.get("message")) and bool(err.get("type"))


def parse_sse(raw: str) -> tuple[list[Any], bool, str]:
    """(events, ended with [DONE], a problem or ""): every block must be one `data:` line."""
    events: list[Any] = []
    done = False
    for block in raw.split("\n\n"):
        block = block.strip("\n")  # a stream read after its first line starts with "\n"
        if not block:
            continue
        if not block.startswith("data: ") or done:
            return events, done, f"malformed SSE block {block[:80]!r}"
        data = block[len("data: ") :]
        if data == "[DONE]":
            done = True
            continue
        try:
            events.append(orjson.loads(data))
        except orjson.JSONDecodeError:
            return events, done, f"event is not JSON: {data[:80]!r}"
    return events, done, ""


def classify_stream(raw: str, engine: str) -> Answer:
    events, done, problem = parse_sse(raw)
    if problem or not done:
        return Answer("bad", 200, problem or f"stream cut short: {raw[-120:]!r}", (), engine)
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    if errors:
        ok = all(_is_error_body(e) for e in errors)
        return Answer("error" if ok else "bad", 200, str(errors[0])[:200], (), engine)
    tokens = [t for e in events for c in e.get("choices", []) for t in c.get("token_ids", [])]
    return Answer("ok", 200, "", tuple(tokens), engine)


def classify_whole(status: int, raw: bytes, engine: str) -> Answer:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return Answer("bad", status, f"body is not JSON: {raw[:120]!r}", (), engine)
    if status == 200:
        try:
            tokens = tuple(data["choices"][0]["token_ids"])
        except (KeyError, IndexError, TypeError):
            return Answer("bad", status, f"200 without tokens: {raw[:120]!r}", (), engine)
        return Answer("ok", status, "", tokens, engine)
    kind = "error" if status >= 500 and _is_error_body(data) else "bad"
    return Answer(kind, status, raw[:200].decode(errors="replace"), (), engine)


async def send(http: aiohttp.ClientSession, url: str, req: Req) -> Answer:
    """One completion, classified; never raises for what the mesh does."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    try:
        async with http.post(f"{url}/v1/completions", json=body_of(req), timeout=timeout) as r:
            engine = r.headers.get("X-Hicache-Engine", "")
            raw = await r.read()
            if req.stream and r.status == 200:
                return classify_stream(raw.decode(errors="replace"), engine)
            return classify_whole(r.status, raw, engine)
    except TimeoutError:
        return Answer("hang", 0, f"no answer within {REQUEST_TIMEOUT_S}s")
    except aiohttp.ClientError as e:
        return Answer("bad", 0, f"{type(e).__name__}: {e}")


@dataclass
class Load:
    """`clients` loops, each sending the requests of its turn until `stop()`."""

    url: str
    reqs: Sequence[Req]
    expected: dict[Req, tuple[int, ...]]
    clients: int = 8
    answers: list[tuple[Req, Answer]] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Load:
        conn = aiohttp.TCPConnector(limit=self.clients + 8)
        self._http = aiohttp.ClientSession(connector=conn)
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.clients)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)  # each ends within one request bound
        assert self._http is not None
        await self._http.close()

    async def _client(self, i: int) -> None:
        assert self._http is not None
        turn = i
        while not self._stop.is_set():
            req = self.reqs[turn % len(self.reqs)]
            turn += self.clients
            answer = await send(self._http, self.url, req)
            if answer.kind == "ok" and answer.tokens != self.expected[req]:
                answer = Answer("bad", 200, f"tokens {answer.tokens} != {self.expected[req]}")
            self.answers.append((req, answer))
            if answer.kind != "ok":
                await asyncio.sleep(0.05)  # no busy loop against a 503

    async def wait_answers(self, n: int, timeout_s: float = 60.0) -> None:
        """Until `n` more answers have come in (the load is really running)."""
        target = len(self.answers) + n
        deadline = time.monotonic() + timeout_s
        while len(self.answers) < target:
            assert time.monotonic() < deadline, f"load stalled: {self.summary()}"
            await asyncio.sleep(0.02)

    def summary(self) -> str:
        kinds = Counter((a.kind, a.status) for _, a in self.answers)
        return ", ".join(f"{k}/{s}: {n}" for (k, s), n in sorted(kinds.items()))

    def problems(self, allowed: frozenset[str]) -> list[str]:
        return [f"{a.kind} {a.status} {a.detail}" for _, a in self.answers if a.kind not in allowed]


def workload(n_prompts: int = 8) -> list[Req]:
    """Plain and streamed requests over the same prompts (a stream repeats a plain one)."""
    reqs = []
    for p in prompts(n_prompts):
        reqs.append(Req(p, 6, False))
        reqs.append(Req(p, 6, True))
    return reqs


def cold_reference(
    reqs: Sequence[Req], model: str = "tiny", exact: bool = False
) -> dict[Req, tuple[int, ...]]:
    """Each request's greedy tokens from an in-process TP1 engine of `model` (float64)
    with the cache off; `exact`: batch-invariant, as `--enable-deterministic-inference`."""
    from gpu_worker.cache.hicache import CacheConfig
    from gpu_worker.engine.engine import Engine, EngineConfig
    from gpu_worker.model.sampling import SamplingParams

    cache = CacheConfig(page_size=PAGE, enable_radix_cache=False)
    eng = Engine(EngineConfig(model=model, cache=cache, batch_invariant=exact))
    try:
        return {
            r: tuple(
                eng.generate(
                    list(r.prompt), SamplingParams(max_new_tokens=r.max_tokens, ignore_eos=True)
                ).output_ids
            )
            for r in reqs
        }
    finally:
        eng.close()


async def send_all(url: str, reqs: Sequence[Req], clients: int = 8) -> list[Answer]:
    """Every request, `clients` at a time (the load's concurrency), answers in order."""
    sem = asyncio.Semaphore(clients)
    async with aiohttp.ClientSession() as http:

        async def one(req: Req) -> Answer:
            async with sem:
                return await send(http, url, req)

        return await asyncio.gather(*(one(r) for r in reqs))


async def baseline(url: str, reqs: Sequence[Req]) -> dict[Req, tuple[int, ...]]:
    """The greedy tokens of each request on the healthy mesh (plain and streamed agree)."""
    answers = await send_all(url, reqs)
    out = {}
    for req, a in zip(reqs, answers, strict=True):
        assert a.kind == "ok", f"baseline request failed: {a}"
        out[req] = a.tokens
    for req in reqs:
        twin = Req(req.prompt, req.max_tokens, not req.stream)
        assert out[req] == out[twin], "streamed and plain greedy tokens differ"
    return out


async def assert_repeat_is_cached(url: str, req: Req, want: tuple[int, ...]) -> None:
    """`req` again, plain: the same greedy tokens as `want`, with part of its prompt served
    from the cache."""
    body = {"prompt": list(req.prompt), "max_tokens": req.max_tokens, "temperature": 0}
    body["ignore_eos"] = True
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/completions", json=body) as r,
    ):
        data = await r.json()
    assert tuple(data["choices"][0]["token_ids"]) == want
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # served from cache


async def full_round(url: str, expected: dict[Req, tuple[int, ...]]) -> None:
    """Every request, 8 at a time: all 200 with the tokens of before the fault."""
    reqs = list(expected)
    answers = await send_all(url, reqs)
    bad = [(r, a) for r, a in zip(reqs, answers, strict=True) if a.kind != "ok"]
    assert not bad, f"after recovery: {bad[:3]}"
    wrong = [r for r, a in zip(reqs, answers, strict=True) if a.tokens != expected[r]]
    assert not wrong, f"after recovery {len(wrong)} requests gave other tokens"


async def held_stream(
    http: aiohttp.ClientSession,
    url: str,
    prompt: Sequence[int],
    engine: str | None = None,
    max_tokens: int = 200,
) -> tuple[aiohttp.ClientResponse, str]:
    """An open long stream whose first event arrived; retried until it lands on `engine`."""
    body = {"prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    for _ in range(40):
        timeout = aiohttp.ClientTimeout(total=STREAM_BOUND_S, sock_read=REQUEST_TIMEOUT_S)
        resp = await http.post(
            f"{url}/v1/completions", json=body | {"stream": True}, timeout=timeout
        )
        got = resp.headers.get("X-Hicache-Engine", "")
        assert resp.status == 200, await resp.text()
        if engine is None or got == engine:
            await resp.content.readline()  # the first event: the engine holds the request
            return resp, got
        resp.close()
    raise AssertionError(f"no stream landed on {engine}")


async def finish_stream(resp: aiohttp.ClientResponse) -> Answer:
    """The rest of a held stream, classified. A stream hangs when it goes quiet for the hang
    bound, or has not ended within `STREAM_BOUND_S`: a long stream that keeps sending is
    alive however slowly a loaded machine decodes (CI's 2 cores took over 60 s for 3000
    tokens beside three other test workers)."""
    engine = resp.headers.get("X-Hicache-Engine", "")
    parts: list[bytes] = []
    start = last = time.monotonic()
    try:
        async with asyncio.timeout(STREAM_BOUND_S):
            while part := await asyncio.wait_for(resp.content.readany(), REQUEST_TIMEOUT_S):
                parts.append(part)
                last = time.monotonic()
    except TimeoutError:
        got, quiet = b"".join(parts).count(b"\ndata:"), time.monotonic() - last
        detail = f"held stream never ended: {got} events in {last - start:.1f} s, then quiet {quiet:.1f} s"
        return Answer("hang", 200, detail, (), engine)
    except aiohttp.ClientError as e:
        return Answer("bad", 200, f"held stream broke: {type(e).__name__}: {e}", (), engine)
    finally:
        resp.release()
    return classify_stream(b"".join(parts).decode(errors="replace"), engine)


# ------------------------------------------------------------------ health and pools


async def _get_json(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
            return r.status, await r.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        return 0, str(e)


async def heal_problems(mesh: UpMesh, http: aiohttp.ClientSession) -> list[str]:
    """What still keeps the mesh from being whole; [] when every part serves."""
    if not mesh.alive:
        return ["`up` exited"]
    roles = Counter(c.role for c in mesh.children())
    need = ("nats", "redis", "index", "router", *mesh.spec.engine_ids)
    out = [f"{r}: {roles[r]} processes" for r in need if roles[r] != 1]
    status, health = await _get_json(http, f"{mesh.url}/health")
    if status != 200 or not isinstance(health, dict) or health.get("status") != "ok":
        return [*out, f"/health {status} {health}"]
    missing = set(mesh.spec.engine_ids) - set(health.get("live_engines", []))
    if missing:
        out.append(f"not live in the router: {sorted(missing)}")
    if not out:
        out += await _engine_problems(mesh, http)
    return out


async def _engine_problems(mesh: UpMesh, http: aiohttp.ClientSession) -> list[str]:
    """Every engine answers /stats over the bus (a killed engine's stale entry does not,
    and neither does its successor before it serves), and the index holds its epoch."""
    status, stats = await _get_json(http, f"{mesh.url}/stats")
    if status != 200 or not isinstance(stats, dict):
        return [f"/stats {status} {stats}"]
    got = stats.get("engines", {})
    problems = [f"{e}: {got.get(e)}" for e in mesh.spec.engine_ids if "epoch" not in got.get(e, {})]
    if problems:
        return problems
    return await _index_problems(mesh, {e: got[e]["epoch"] for e in mesh.spec.engine_ids})


async def _index_problems(mesh: UpMesh, epochs: dict[str, str]) -> list[str]:
    """Redis answers, and the index keeps every engine's liveness key at its current epoch
    and refreshes it now: its TTL rises at least once while watched for a few heartbeats (a
    key left by an index that lost NATS only counts down, then expires)."""
    r = aioredis.from_url(mesh.redis_url(), socket_timeout=2, **mesh.redis_options())
    keys = [rk.engine_alive(e) for e in epochs]
    try:
        alive = await r.mget(keys)
        stale = [
            f"index: {e} alive at {v!r}, serving epoch {epoch}"
            for (e, epoch), v in zip(epochs.items(), alive, strict=True)
            if v not in (str(epoch), str(epoch).encode())
        ]
        return stale or await _unrefreshed(r, keys, 3 * mesh.spec.heartbeat_s)
    except Exception as e:  # any Redis failure means "not healed yet"
        return [f"redis: {type(e).__name__}: {e}"]
    finally:
        await r.aclose()


async def _unrefreshed(r: aioredis.Redis, keys: list[str], watch_s: float) -> list[str]:
    """The keys whose TTL never rose while sampled every 0.1 s for `watch_s`."""
    last = await asyncio.gather(*(r.pttl(k) for k in keys))
    rose = [False] * len(keys)
    for _ in range(int(watch_s / 0.1)):
        await asyncio.sleep(0.1)
        now = await asyncio.gather(*(r.pttl(k) for k in keys))
        rose = [was or b > a for was, a, b in zip(rose, last, now, strict=True)]
        last = now
    return [f"index: {k} not refreshed" for k, ok in zip(keys, rose, strict=True) if not ok]


HEAL_TIMEOUT_S = 90.0  # "never heals", not a timing goal: engines start slowly on 2 busy cores


async def wait_healed(mesh: UpMesh, timeout_s: float = HEAL_TIMEOUT_S) -> float:
    """Seconds until the mesh is whole and serves one request; raises with the reasons."""
    started = time.monotonic()
    probe = Req(tuple(range(1, 9)), 2, False)
    problems: list[str] = []
    async with aiohttp.ClientSession() as http:
        while time.monotonic() - started < timeout_s:
            problems = await heal_problems(mesh, http)
            if not problems:
                answer = await send(http, mesh.url, probe)
                if answer.kind == "ok":
                    return time.monotonic() - started
                problems = [f"probe: {answer}"]
            await asyncio.sleep(0.1)
    raise AssertionError(f"not healed in {timeout_s}s: {problems}\n{mesh.log_tail()}")


Pools = dict[str, tuple[int, int]]  # engine id -> (device pages free, host pages free)


async def pools(url: str, engines: Sequence[str], timeout_s: float = 30.0) -> Pools:
    """Flush every engine, then read its page pools. Retried while an engine still refuses
    (busy) or is out of the router's view for a moment (one failed request marks it failed
    until its next heartbeat)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while True:
            flushed = await _flush(http, url)
            status, stats = await _get_json(http, f"{url}/stats")
            if flushed and status == 200 and set(engines) <= set(stats["engines"]):
                return {e: _free_pages(stats["engines"][e]) for e in engines}
            assert time.monotonic() < deadline, f"flush or stats: {flushed} {status} {stats}"
            await asyncio.sleep(0.2)


async def _flush(http: aiohttp.ClientSession, url: str) -> bool:
    async with http.post(f"{url}/flush_cache") as r:
        await r.read()
        return r.status == 200


def _free_pages(entry: dict[str, Any]) -> tuple[int, int]:
    s = entry["stats"]
    host_free = s["host_pages_free"]  # the host allocator's count, not host_pages - cached
    return int(s["device_pages_free"]), int(host_free)


async def epochs(url: str, engines: Sequence[str], timeout_s: float = 15.0) -> dict[str, str]:
    """Each engine's epoch from /stats (retried while one is out of the router's view)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while True:
            status, stats = await _get_json(http, f"{url}/stats")
            if status == 200 and set(engines) <= set(stats["engines"]):
                return {e: stats["engines"][e]["epoch"] for e in engines}
            assert time.monotonic() < deadline, f"/stats: {status} {stats}"
            await asyncio.sleep(0.1)
