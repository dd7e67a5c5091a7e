"""Router added latency: max_tokens=1 requests through the router vs straight to the engine.

Starts a real mesh on loopback (nats-server, redis-server, index, `--engines` engines of the
tiny model with a `--context-length` that fits the longest prompt, router), then for every
prompt length runs rounds of the same request sent these ways, in turn:

- direct: a GenerateRequest on engine 0's NATS subject (encode, publish, the engine, decode),
  from a client as lean as the router's own (one wildcard reply subscription; uvloop, which
  the router runs on too);
- router: `POST /generate` on one keep-alive HTTP/1.1 connection, written in one call and read
  by Content-Length (HTTP, validation, page hashing, with two or more engines one Redis
  `EVALSHA` for the cached prefix, routing, NATS, the response);
- aiohttp: the same POST through an `aiohttp.ClientSession`, a typical Python client, whose
  own cost (0.2-0.5 ms at these body sizes) is reported apart;
- baseline (with `--baseline DIR`): the same POST to a second router started from DIR, e.g.
  `git archive HEAD router bus_schemas | tar -x -C DIR`: before/after under the same load.

Prompt ids are drawn below the vocabulary size the engine announces in its heartbeat. The
engine's time grows with the prompt (~170 ms at 32K tokens) and varies by more than the
router costs, so next to the end-to-end difference (`added`: the median over rounds of
router minus direct, with its bootstrap 95% interval) every router request also gives the
router's own time exactly: its total minus the `engine` stage of the router's
`Server-Timing` header, which times what the direct path times but the request's encoding
(publish, the engine, the replies; the router encodes during its Redis lookup, in `route`).
`own` is HTTP both ways, parsing, routing and the response, without the engine's noise;
`parse` and `route` are its stages from the same header, and `lookup` the part of `route`
from the Redis lookup's send to its answer (the encoding runs inside it).

Two columns say how fast the machine was, since every path slows with it: `other load`, the
CPU (in cores) that processes outside this benchmark used during the row (on two vCPUs that
share a core a busy sibling halves the other's speed; above ~0.1 the row is not clean), and
`cpu check`, the median milliseconds of a fixed Python loop (`cpu_check`) taken every 25
rounds: a shared host's speed drifts by 2x over minutes, and that shows nowhere else.

    .venv/bin/python benchmarks/bench_router.py --requests 300
    .venv/bin/python benchmarks/bench_router.py --prompt-len 1024 --engines 1
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import nats
import orjson
import uvloop
from machine_load import ForeignLoad, cpu_check
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bus_schemas import GenerateRequest, Heartbeat, Progress, Sampling, SchemaError, TokenChunk
from bus_schemas import subjects as subj
from bus_schemas.token_ids import TokenIds, as_token_ids
from router.outcome import parse_server_timing
from services.launch.servers import free_port, start_nats, start_redis

PROMPT_LENS = (64, 1024, 8192, 32768)
PAGE_SIZE = 64
JSON_HEADERS = {"Content-Type": "application/json"}
BOOTSTRAP_ROUNDS = 2000


@dataclass(slots=True)
class Row:
    """One prompt length's samples (milliseconds; req/s None when not measured)."""

    prompt_len: int
    direct: list[float] = field(default_factory=list)
    routed: list[float] = field(default_factory=list)  # lean HTTP client
    routed_aiohttp: list[float] = field(default_factory=list)
    baseline: list[float] = field(default_factory=list)  # --baseline's router, lean client
    own: list[float] = field(default_factory=list)  # routed minus the router's engine stage
    parse: list[float] = field(default_factory=list)  # Server-Timing stages
    route: list[float] = field(default_factory=list)
    lookup: list[float] = field(default_factory=list)  # of route: the Redis round trip
    foreign_cores: float | None = None  # ForeignLoad over the measured rounds
    cpu_checks: list[float] = field(default_factory=list)  # cpu_check() every 25 rounds
    rps_direct: float | None = None
    rps_router: float | None = None


@dataclass(frozen=True, slots=True)
class Ports:
    router: int
    baseline: int | None  # --baseline's router


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def paired_median(a: list[float], b: list[float], seed: int) -> tuple[float, float, float]:
    """Median of a[i] - b[i], and its bootstrap 95% interval."""
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    rng = random.Random(seed)
    boot = sorted(
        statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(BOOTSTRAP_ROUNDS)
    )
    lo, hi = boot[int(0.025 * BOOTSTRAP_ROUNDS)], boot[int(0.975 * BOOTSTRAP_ROUNDS) - 1]
    return statistics.median(diffs), lo, hi


class HttpConnection:
    """One keep-alive HTTP/1.1 connection that does the least client work: each request is
    one write, each reply is read by its Content-Length (the router sends one on every
    non-streamed reply). Reopened when the router closed it (idle past its keep-alive, as
    during a 32K prefill)."""

    def __init__(
        self, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.port, self.reader, self.writer = port, reader, writer

    @classmethod
    async def open(cls, port: int) -> HttpConnection:
        return cls(port, *await asyncio.open_connection("127.0.0.1", port))

    async def post(self, path: str, body: bytes) -> tuple[float, dict[str, str]]:
        """Seconds from the write to the whole reply, and the reply's headers (lower case)."""
        if self.reader.at_eof() or self.writer.is_closing():
            self.writer.close()
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        start = time.perf_counter()
        self.writer.write(head + body)
        status, *lines = (await self.reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines if line)
        headers = {k.lower(): v for k, v in headers.items()}
        reply = await self.reader.readexactly(int(headers["content-length"]))
        elapsed = time.perf_counter() - start
        if not status.startswith("HTTP/1.1 200"):
            raise RuntimeError(f"router answered {status}: {reply.decode()}")
        return elapsed, headers

    def close(self) -> None:
        self.writer.close()


class DirectClient:
    """Requests straight to an engine's subject, as lean as the router's own bus client: one
    wildcard reply subscription for all of them (no SUB/UNSUB per request)."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.prefix = nc.new_inbox()
        self._waiting: dict[str, asyncio.Queue[bytes]] = {}
        self._next = 0

    async def start(self) -> None:
        await self.nc.subscribe(f"{self.prefix}.*", cb=self._on_msg)

    async def _on_msg(self, msg: Msg) -> None:
        queue = self._waiting.get(msg.subject)
        if queue is not None:
            queue.put_nowait(msg.data)

    async def once(self, engine_id: str, ids: TokenIds, timeout: float = 60) -> float:
        """Seconds from encoding the GenerateRequest to the decoded last chunk."""
        self._next += 1
        inbox = f"{self.prefix}.{self._next}"
        queue = self._waiting[inbox] = asyncio.Queue()
        try:
            req = GenerateRequest(uuid.uuid4().hex, ids, Sampling(max_new_tokens=1), inbox)
            start = time.perf_counter()
            await self.nc.publish(subj.engine_generate(engine_id), req.encode())
            async with asyncio.timeout(timeout):
                while not _finished(await queue.get()):
                    pass
            return time.perf_counter() - start
        finally:
            del self._waiting[inbox]


def _finished(data: bytes) -> bool:
    """Whether a message of a stream is its last chunk (an engine's `Progress` is not)."""
    try:
        return TokenChunk.decode(data).finished
    except SchemaError:
        Progress.decode(data)
        return False


async def aiohttp_once(http: aiohttp.ClientSession, url: str, body: bytes) -> float:
    """`body` is encoded once by the caller: the client's JSON encoding is not the router's."""
    start = time.perf_counter()
    async with http.post(f"{url}/generate", data=body, headers=JSON_HEADERS) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"router answered {resp.status}: {await resp.text()}")
    return time.perf_counter() - start


async def wait_ready(
    nc: NATS, http: aiohttp.ClientSession, ports: Ports, engines: int
) -> Heartbeat:
    """Engine 0's heartbeat, once every engine heartbeats and the router(s) are healthy."""
    seen: dict[str, Heartbeat] = {}
    all_in = asyncio.Event()

    async def on(msg: Msg) -> None:
        hb = Heartbeat.decode(msg.data)
        seen[hb.engine_id] = hb
        if len(seen) >= engines:
            all_in.set()

    sub = await nc.subscribe(subj.HEARTBEAT_ALL, cb=on)
    await asyncio.wait_for(all_in.wait(), 180)
    await sub.unsubscribe()
    for port in (ports.router, ports.baseline):
        if port is not None:
            await wait_healthy(http, f"http://127.0.0.1:{port}")
    return seen["bench-0"]


async def wait_healthy(http: aiohttp.ClientSession, url: str) -> None:
    for _ in range(600):
        try:
            async with http.get(f"{url}/health") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise TimeoutError(f"the router at {url} never became healthy")


async def burst(fn: Callable[[], Awaitable[float]], n: int, concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            await fn()

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return n / (time.perf_counter() - start)


@dataclass(frozen=True, slots=True)
class Clients:
    direct: DirectClient
    http: aiohttp.ClientSession
    conn: HttpConnection  # to the router
    baseline: HttpConnection | None  # to --baseline's router
    url: str  # the router's


async def measure_one(args: argparse.Namespace, c: Clients, hb: Heartbeat, prompt_len: int) -> Row:
    rng = random.Random(prompt_len)
    ids = as_token_ids([rng.randrange(hb.vocab_size) for _ in range(prompt_len)])
    body = orjson.dumps({"input_ids": ids.tolist(), "sampling_params": {"max_new_tokens": 1}})
    # the first request prefills the prompt on the CPU: minutes at 32K tokens
    await c.direct.once(hb.engine_id, ids, timeout=3600)
    for _ in range(args.warmup):  # every path, and the engines' caches
        await c.direct.once(hb.engine_id, ids)
        await c.conn.post("/generate", body)
        await aiohttp_once(c.http, c.url, body)
        if c.baseline is not None:
            await c.baseline.post("/generate", body)
    row = Row(prompt_len)
    foreign = ForeignLoad()
    for i in range(args.requests):
        if i % 25 == 0:
            row.cpu_checks.append(cpu_check())
        row.direct.append(await c.direct.once(hb.engine_id, ids) * 1e3)
        elapsed, headers = await c.conn.post("/generate", body)
        timing = parse_server_timing(headers["server-timing"])
        row.routed.append(elapsed * 1e3)
        row.own.append(elapsed * 1e3 - timing["engine"])
        row.parse.append(timing["parse"])
        row.route.append(timing["route"])
        row.lookup.append(timing.get("lookup", 0.0))  # (a router from before the stage: 0)
        row.routed_aiohttp.append(await aiohttp_once(c.http, c.url, body) * 1e3)
        if c.baseline is not None:
            row.baseline.append((await c.baseline.post("/generate", body))[0] * 1e3)
    row.foreign_cores = foreign.cores()
    if args.concurrency > 1:
        row.rps_direct = await burst(
            lambda: c.direct.once(hb.engine_id, ids), args.requests, args.concurrency
        )
        row.rps_router = await burst(
            lambda: aiohttp_once(c.http, c.url, body), args.requests, args.concurrency
        )
    return row


async def measure(args: argparse.Namespace, nats_url: str, ports: Ports) -> None:
    """Prints the table's header, then each prompt length's row as soon as it is measured."""
    nc = await nats.connect(nats_url, max_reconnect_attempts=0)
    async with aiohttp.ClientSession() as http:
        hb = await wait_ready(nc, http, ports, args.engines)
        too_long = [n for n in args.prompt_lens if n + 1 > hb.context_len]
        if too_long:
            raise SystemExit(f"prompts {too_long} do not fit the context length {hb.context_len}")
        conn = await HttpConnection.open(ports.router)
        baseline = None
        if ports.baseline is not None:
            baseline = await HttpConnection.open(ports.baseline)
        direct = DirectClient(nc)
        await direct.start()
        clients = Clients(direct, http, conn, baseline, f"http://127.0.0.1:{ports.router}")
        print_header(args)
        try:
            for n in args.prompt_lens:
                print_row(await measure_one(args, clients, hb, n))
        finally:
            conn.close()
            if baseline is not None:
                baseline.close()
    await nc.drain()


def print_header(args: argparse.Namespace) -> None:
    paths = "direct, router, aiohttp" + (", baseline" if args.baseline else "")
    print(
        f"\nmax_tokens=1, {args.requests} rounds per prompt length ({paths} in turn); "
        f"{args.engines} engine(s), page {PAGE_SIZE}"
        + (f"; concurrency {args.concurrency} for req/s" if args.concurrency > 1 else "")
        + (
            f"; router on CPU {args.router_cpu}, the rest on CPUs {sorted(os.sched_getaffinity(0))}"
            if args.router_cpu is not None
            else ""
        )
    )
    head = (
        f"{'prompt':>7} {'engine p50':>10} {'router p50':>10} {'added p50 [95% CI]':>22} "
        f"{'own p50':>8} {'own p99':>8} {'parse':>6} {'route':>6} {'lookup':>6} "
        f"{'aiohttp added':>13} "
        f"{'other load':>10} {'cpu check':>9}"
    )
    if args.concurrency > 1:
        head += f" {'req/s ratio':>11}"
    print(head + "   (ms; other load in cores)", flush=True)


def print_row(r: Row) -> None:
    added, lo, hi = paired_median(r.routed, r.direct, r.prompt_len)
    aio_added = statistics.median(x - y for x, y in zip(r.routed_aiohttp, r.direct, strict=True))
    interval = f"{added:.3f} [{lo:.2f}, {hi:.2f}]"
    foreign = "-" if r.foreign_cores is None else f"{r.foreign_cores:.2f}"
    line = (
        f"{r.prompt_len:>7} {pct(r.direct, 0.5):>10.3f} {pct(r.routed, 0.5):>10.3f} "
        f"{interval:>22} {pct(r.own, 0.5):>8.3f} {pct(r.own, 0.99):>8.3f} "
        f"{pct(r.parse, 0.5):>6.3f} {pct(r.route, 0.5):>6.3f} {pct(r.lookup, 0.5):>6.3f} "
        f"{aio_added:>13.3f} {foreign:>10} "
        f"{statistics.median(r.cpu_checks):>9.2f}"
    )
    if r.rps_direct and r.rps_router:
        line += f" {r.rps_router / r.rps_direct:>11.2f}"
    print(line, flush=True)
    if r.baseline:
        base_added = statistics.median(x - y for x, y in zip(r.baseline, r.direct, strict=True))
        diff, lo, hi = paired_median(r.routed, r.baseline, r.prompt_len)
        print(
            f"{'':>7} baseline: added p50 {base_added:.3f}; "
            f"router - baseline p50 {diff:+.3f} [{lo:+.2f}, {hi:+.2f}]",
            flush=True,
        )


def spawn(
    args: argparse.Namespace, nats_url: str, redis_url: str, ports: Ports
) -> list[subprocess.Popen[bytes]]:
    py = sys.executable
    context = max(args.prompt_lens) + 64
    bus = ["--nats-url", nats_url]
    procs = [subprocess.Popen([py, "-m", "services.index", *bus, "--redis-url", redis_url])]
    for i in range(args.engines):
        engine = [py, "-m", "services.engine", "--engine-id", f"bench-{i}", *bus]
        engine += ["--model", "tiny", "--dtype", "float32", "--log-level", "WARNING"]
        engine += ["--page-size", str(PAGE_SIZE)]
        engine += ["--context-length", str(context)]
        engine += ["--max-total-tokens", str(2 * context), "--chunked-prefill-size", "4096"]
        procs.append(subprocess.Popen(engine))
    router = [py, "-m", "router", *bus, "--redis-url", redis_url]
    pin = (
        None
        if args.router_cpu is None
        else functools.partial(os.sched_setaffinity, 0, {args.router_cpu})
    )  # run in the child before exec: every thread it starts inherits the CPU
    procs.append(subprocess.Popen([*router, "--port", str(ports.router)], preexec_fn=pin))
    if args.baseline:
        env = dict(os.environ, PYTHONPATH=args.baseline)
        baseline = [*router, "--port", str(ports.baseline)]
        procs.append(subprocess.Popen(baseline, cwd=args.baseline, env=env, preexec_fn=pin))
    return procs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="rounds per length")
    parser.add_argument("--warmup", type=int, default=20, help="rounds per length")
    parser.add_argument(
        "--prompt-len",
        dest="prompt_lens",
        type=int,
        action="append",
        help=f"prompt tokens; repeat for several (default: {', '.join(map(str, PROMPT_LENS))})",
    )
    parser.add_argument(
        "--engines", type=int, default=2, help="2+: the router asks Redis for the cached prefix"
    )
    parser.add_argument(
        "--concurrency", type=int, default=0, help="also measure req/s with this many clients"
    )
    parser.add_argument(
        "--baseline",
        metavar="DIR",
        help="also time a router started from DIR (its router/ and bus_schemas/) side by side",
    )
    parser.add_argument(
        "--router-cpu",
        type=int,
        metavar="CPU",
        help="run the router(s) on this CPU alone and everything else (engines, index, nats, "
        "redis, this client) on the other CPUs: a router with a core of its own, as deployed",
    )
    args = parser.parse_args()
    args.prompt_lens = args.prompt_lens or list(PROMPT_LENS)
    if args.router_cpu is not None:
        cpus = os.sched_getaffinity(0)
        rest = cpus - {args.router_cpu}
        if args.router_cpu not in cpus or not rest:
            raise SystemExit(f"--router-cpu {args.router_cpu}: this process may use CPUs {cpus}")
        os.sched_setaffinity(0, rest)  # before anything starts: the children inherit it
    nats_server, redis_server = start_nats(), start_redis()
    ports = Ports(free_port(), free_port() if args.baseline else None)
    procs = spawn(args, nats_server.url, redis_server.url, ports)
    try:
        uvloop.run(measure(args, nats_server.url, ports))  # the router's loop too
    finally:
        stop_all(procs)
        redis_server.stop()
        nats_server.stop()


def stop_all(procs: list[subprocess.Popen[bytes]], timeout_s: float = 30.0) -> None:
    """SIGTERM every service at once, then SIGKILL what has not exited by `timeout_s`: none
    may outlive the benchmark (a caller reading its output would wait on their pipes)."""
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"{p.args!r} ignored SIGTERM: killed", file=sys.stderr)
            p.kill()
            p.wait()


if __name__ == "__main__":
    main()
