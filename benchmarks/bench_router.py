"""Router added latency: max_tokens=1 requests through the router vs straight to the engine.

Starts a real mesh on loopback (nats-server, redis-server, index, `--engines` engines of the
tiny model with a `--context-length` that fits the longest prompt, router), then for every
prompt length alternates rounds of the same request sent (a) as a GenerateRequest on engine
0's NATS subject and (b) as `POST /generate` through the router (HTTP, validation, page
hashing, and with two or more engines one Redis `EVALSHA` for the cached prefix, routing,
NATS). Prompt ids are drawn below the vocabulary size the engine announces in its heartbeat.
Reports p50/p99 of each path, the difference (the router's added latency) and, with
`--concurrency`, requests per second of each path under that many clients.

    .venv/bin/python benchmarks/bench_router.py --requests 300
    .venv/bin/python benchmarks/bench_router.py --prompt-len 1024 --engines 1
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import nats
import orjson
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bus_schemas import GenerateRequest, Heartbeat, Sampling, TokenChunk
from bus_schemas import subjects as subj
from bus_schemas.token_ids import TokenIds, as_token_ids
from services.launch.servers import free_port, start_nats, start_redis

PROMPT_LENS = (64, 1024, 8192, 32768)
PAGE_SIZE = 64
JSON_HEADERS = {"Content-Type": "application/json"}


@dataclass(frozen=True, slots=True)
class Row:
    """One prompt length's result (milliseconds; req/s None when not measured)."""

    prompt_len: int
    direct: list[float]
    routed: list[float]
    rps_direct: float | None
    rps_router: float | None


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def direct_once(nc: NATS, engine_id: str, ids: TokenIds, timeout: float = 60) -> float:
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    req = GenerateRequest(uuid.uuid4().hex, ids, Sampling(max_new_tokens=1), inbox)
    start = time.perf_counter()
    await nc.publish(subj.engine_generate(engine_id), req.encode())
    while not TokenChunk.decode((await sub.next_msg(timeout=timeout)).data).finished:
        pass
    elapsed = time.perf_counter() - start
    await sub.unsubscribe()
    return elapsed


async def router_once(http: aiohttp.ClientSession, url: str, body: bytes) -> float:
    """`body` is encoded once by the caller: the client's JSON encoding is not the router's."""
    start = time.perf_counter()
    async with http.post(f"{url}/generate", data=body, headers=JSON_HEADERS) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"router answered {resp.status}: {await resp.text()}")
    return time.perf_counter() - start


async def wait_ready(nc: NATS, http: aiohttp.ClientSession, url: str, engines: int) -> Heartbeat:
    """Engine 0's heartbeat, once every engine heartbeats and the router is healthy."""
    seen: dict[str, Heartbeat] = {}
    all_in = asyncio.Event()

    async def on(msg: Msg) -> None:
        hb = Heartbeat.decode(msg.data)
        seen[hb.engine_id] = hb
        if len(seen) >= engines:
            all_in.set()

    sub = await nc.subscribe(subj.HEARTBEAT, cb=on)
    await asyncio.wait_for(all_in.wait(), 180)
    await sub.unsubscribe()
    for _ in range(600):
        try:
            async with http.get(f"{url}/health") as resp:
                if resp.status == 200:
                    return seen["bench-0"]
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise TimeoutError("router never became healthy")


async def burst(fn: Callable[[], Awaitable[float]], n: int, concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            await fn()

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return n / (time.perf_counter() - start)


async def measure_one(
    args: argparse.Namespace,
    nc: NATS,
    http: aiohttp.ClientSession,
    url: str,
    hb: Heartbeat,
    prompt_len: int,
) -> Row:
    rng = random.Random(prompt_len)
    ids = as_token_ids([rng.randrange(hb.vocab_size) for _ in range(prompt_len)])
    body = orjson.dumps({"input_ids": ids.tolist(), "sampling_params": {"max_new_tokens": 1}})
    # the first request prefills the prompt on the CPU: minutes at 32K tokens
    await direct_once(nc, hb.engine_id, ids, timeout=3600)
    for _ in range(args.warmup):  # both paths, and the engines' caches
        await direct_once(nc, hb.engine_id, ids)
        await router_once(http, url, body)
    direct, routed = [], []
    for _ in range(args.requests):
        direct.append(await direct_once(nc, hb.engine_id, ids) * 1e3)
        routed.append(await router_once(http, url, body) * 1e3)
    rps_direct = rps_router = None
    if args.concurrency > 1:
        rps_direct = await burst(
            lambda: direct_once(nc, hb.engine_id, ids), args.requests, args.concurrency
        )
        rps_router = await burst(
            lambda: router_once(http, url, body), args.requests, args.concurrency
        )
    return Row(prompt_len, direct, routed, rps_direct, rps_router)


async def measure(args: argparse.Namespace, nats_url: str, url: str) -> None:
    """Prints the table's header, then each prompt length's row as soon as it is measured."""
    nc = await nats.connect(nats_url, max_reconnect_attempts=0)
    async with aiohttp.ClientSession() as http:
        hb = await wait_ready(nc, http, url, args.engines)
        too_long = [n for n in args.prompt_lens if n + 1 > hb.context_len]
        if too_long:
            raise SystemExit(f"prompts {too_long} do not fit the context length {hb.context_len}")
        print_header(args)
        for n in args.prompt_lens:
            print_row(await measure_one(args, nc, http, url, hb, n))
    await nc.drain()


def print_header(args: argparse.Namespace) -> None:
    print(
        f"\nmax_tokens=1, {args.requests} requests per path and prompt length, alternating; "
        f"{args.engines} engine(s), page {PAGE_SIZE}"
        + (f"; concurrency {args.concurrency} for req/s" if args.concurrency > 1 else "")
    )
    head = (
        f"{'prompt':>7} {'engine p50':>10} {'router p50':>10} {'added p50':>9} "
        f"{'engine p99':>10} {'router p99':>10} {'added p99':>9} {'mean added':>10}"
    )
    if args.concurrency > 1:
        head += f" {'req/s ratio':>11}"
    print(head + "   (ms)", flush=True)


def print_row(r: Row) -> None:
    d50, r50 = pct(r.direct, 0.5), pct(r.routed, 0.5)
    d99, r99 = pct(r.direct, 0.99), pct(r.routed, 0.99)
    mean = statistics.mean(r.routed) - statistics.mean(r.direct)
    line = (
        f"{r.prompt_len:>7} {d50:>10.3f} {r50:>10.3f} {r50 - d50:>9.3f} "
        f"{d99:>10.3f} {r99:>10.3f} {r99 - d99:>9.3f} {mean:>10.3f}"
    )
    if r.rps_direct and r.rps_router:
        line += f" {r.rps_router / r.rps_direct:>11.2f}"
    print(line, flush=True)


def spawn(
    args: argparse.Namespace, nats_url: str, redis_url: str, port: int
) -> list[subprocess.Popen[bytes]]:
    py = sys.executable
    context = max(args.prompt_lens) + 64
    bus = ["--nats-url", nats_url]
    procs = [subprocess.Popen([py, "-m", "services.index", *bus, "--redis-url", redis_url])]
    for i in range(args.engines):
        engine = [py, "-m", "services.engine", "--engine-id", f"bench-{i}", *bus]
        engine += ["--dtype", "float32", "--log-level", "WARNING", "--page-size", str(PAGE_SIZE)]
        engine += ["--context-length", str(context)]
        engine += ["--max-total-tokens", str(2 * context), "--chunked-prefill-size", "4096"]
        procs.append(subprocess.Popen(engine))
    router = [py, "-m", "router", "--port", str(port), *bus, "--redis-url", redis_url]
    procs.append(subprocess.Popen(router))
    return procs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="per path and length")
    parser.add_argument("--warmup", type=int, default=20, help="per path and length")
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
    args = parser.parse_args()
    args.prompt_lens = args.prompt_lens or list(PROMPT_LENS)
    nats_server, redis_server = start_nats(), start_redis()
    port = free_port()
    procs = spawn(args, nats_server.url, redis_server.url, port)
    try:
        asyncio.run(measure(args, nats_server.url, f"http://127.0.0.1:{port}"))
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(30)
        redis_server.stop()
        nats_server.stop()


if __name__ == "__main__":
    main()
