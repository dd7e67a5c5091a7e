"""Cache-aware routing under load: prefix lookup latency and fallbacks at 64 clients.

Starts nats-server, redis-server and a real router process (with a small wrapper that times
every `PrefixIndex.lookup` inside the router and writes the times at exit), two instant
engines in this process (heartbeats, one finished chunk per request, so the router is the
bottleneck), fills Redis with the prompts' pages held by one engine or the other, then
`--clients` clients send `--requests` `POST /generate` each. Prints lookup latency
percentiles as the router waited for them, and the routing decisions by reason (fallbacks:
`redis_down`, `redis_timeout`) and the lookup error counters from /metrics.

    .venv/bin/python benchmarks/bench_routing_load.py --clients 64 --requests 40
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter

import aiohttp
import nats
import redis.asyncio as aioredis
from nats.aio.msg import Msg

from bus_schemas import GenerateRequest, Heartbeat, TokenChunk, page_hashes, redis_keys
from bus_schemas import subjects as subj
from services.launch.servers import free_port, start_nats, start_redis

PAGE_SIZE = 16
NAMESPACE = "bench-ns"
VOCAB = 32000

LAUNCHER = """
import atexit, json, sys, time
import router.routing as routing
times = []
original = routing.PrefixIndex.lookup
async def timed(self, hashes):
    t0 = time.perf_counter()
    try:
        return await original(self, hashes)
    finally:
        times.append(time.perf_counter() - t0)
routing.PrefixIndex.lookup = timed
out = sys.argv.pop(1)
atexit.register(lambda: json.dump(times, open(out, "w")))
from router.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


class InstantEngine:
    """Heartbeats and one finished chunk per GenerateRequest: no compute."""

    def __init__(self, engine_id: str, nats_url: str) -> None:
        self.engine_id, self.nats_url = engine_id, nats_url
        self.nc: nats.NATS | None = None
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.nc = await nats.connect(self.nats_url)
        await self.nc.subscribe(subj.engine_generate(self.engine_id), cb=self.on_generate)
        self.task = asyncio.create_task(self.heartbeats())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if self.nc is not None:
            await self.nc.close()

    async def heartbeats(self) -> None:
        assert self.nc is not None
        while True:
            hb = Heartbeat(
                self.engine_id, "default", "1", "bench", NAMESPACE, PAGE_SIZE, 65536, VOCAB,
                [0], 0, 0, 0, 0.5,
            )  # fmt: skip
            await self.nc.publish(subj.heartbeat(self.engine_id), hb.encode())
            await asyncio.sleep(0.5)

    async def on_generate(self, msg: Msg) -> None:
        assert self.nc is not None
        req = GenerateRequest.decode(msg.data)
        chunk = TokenChunk(
            req.request_id, 0, [1], self.engine_id, len(req.input_ids), 0, 0, True, "length"
        )
        await self.nc.publish(req.reply_to, chunk.encode())


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def fill_redis(url: str, prompts: list[list[int]], engines: list[str]) -> None:
    r = aioredis.Redis.from_url(url)
    for i, ids in enumerate(prompts):
        owner = engines[i % len(engines)]
        for h in page_hashes(ids, PAGE_SIZE, NAMESPACE):
            await r.hset(redis_keys.page(h), owner, 1)
    await r.aclose()


async def client(
    http: aiohttp.ClientSession, base: str, prompts: list[list[int]], n: int, rng: random.Random
) -> list[int]:
    statuses = []
    for _ in range(n):
        body = {"input_ids": rng.choice(prompts), "sampling_params": {"max_new_tokens": 1}}
        async with http.post(base + "/generate", json=body) as r:
            await r.read()
            statuses.append(r.status)
    return statuses


def metric_lines(text: str, *names: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(names) and "#" not in line]


async def run(args: argparse.Namespace) -> None:
    nats_srv, redis_srv = start_nats(), start_redis()
    port = free_port()
    fd, times_file = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    router = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, times_file, "--port", str(port), "--log-level",
         "WARNING", "--nats-url", nats_srv.url, "--redis-url", redis_srv.url],
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    tag = uuid.uuid4().hex[:6]
    engines = [InstantEngine(f"bench{tag}-{c}", nats_srv.url) for c in "ab"]
    rng = random.Random(0)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(args.prompt_len)] for _ in range(32)]
    base = f"http://127.0.0.1:{port}"
    try:
        for e in engines:
            await e.start()
        await fill_redis(redis_srv.url, prompts, [e.engine_id for e in engines])
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=args.clients)
        ) as http:
            await wait_ready(http, base)
            t0 = time.perf_counter()
            per_client = await asyncio.gather(
                *(
                    client(http, base, prompts, args.requests, random.Random(i))
                    for i in range(args.clients)
                )
            )
            wall = time.perf_counter() - t0
            async with http.get(base + "/metrics") as r:
                text = await r.text()
    finally:
        router.send_signal(signal.SIGINT)
        router.wait(30)
        for e in engines:
            await e.stop()
        nats_srv.stop()
        redis_srv.stop()
    with open(times_file) as f:
        times = [1000 * t for t in json.load(f)]
    os.unlink(times_file)
    total = args.clients * args.requests
    statuses = Counter(s for c in per_client for s in c)
    print(f"{args.clients} clients x {args.requests} requests, prompt {args.prompt_len} tokens "
          f"({args.prompt_len // PAGE_SIZE} pages): {total / wall:.0f} req/s, "
          f"statuses {dict(statuses)}")  # fmt: skip
    print(f"lookup ms (n={len(times)}): p50 {pct(times, 0.5):.2f}  p90 {pct(times, 0.9):.2f}  "
          f"p99 {pct(times, 0.99):.2f}  max {max(times):.2f}")  # fmt: skip
    for line in metric_lines(
        text,
        "hicache_router_routing_decisions_total",
        "hicache_router_store_errors_total",
        "hicache_router_store_timeouts_total",
    ):
        print(line)


async def wait_ready(http: aiohttp.ClientSession, base: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            async with http.get(base + "/health") as r:
                body = await r.json()
                if r.status == 200 and len(body.get("live_engines", [])) == 2:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError("router not ready")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=40, help="per client")
    p.add_argument("--prompt-len", type=int, default=1024)
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
