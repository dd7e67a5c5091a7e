"""Router added latency: max_tokens=1 requests through the router vs straight to the engine.

Starts a real mesh on loopback (nats-server, redis-server, index, one engine, router), then
alternates rounds of the same request sent (a) as a GenerateRequest on the engine's NATS
subject and (b) as `POST /generate` through the router (which also hashes the prompt and
asks Redis for the cached prefix). Reports p50/p99 latency of each path, the difference
(the router's added latency) and sequential / concurrent requests per second.

    .venv/bin/python benchmarks/bench_router.py --requests 300
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
import uuid

import aiohttp
import nats
from nats.aio.client import Client as NATS
from tqdm import tqdm

from bus_schemas import GenerateRequest, Heartbeat, Sampling, TokenChunk
from bus_schemas import subjects as subj
from services.launch.servers import free_port, start_nats, start_redis


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def direct_once(nc: NATS, engine_id: str, ids: list[int]) -> float:
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    req = GenerateRequest(uuid.uuid4().hex, ids, Sampling(max_new_tokens=1), inbox)
    start = time.perf_counter()
    await nc.publish(subj.engine_generate(engine_id), req.encode())
    while not TokenChunk.decode((await sub.next_msg(timeout=30)).data).finished:
        pass
    elapsed = time.perf_counter() - start
    await sub.unsubscribe()
    return elapsed


async def router_once(http: aiohttp.ClientSession, url: str, ids: list[int]) -> float:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
    start = time.perf_counter()
    async with http.post(f"{url}/generate", json=body) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"router answered {resp.status}")
    return time.perf_counter() - start


async def wait_ready(nc: NATS, http: aiohttp.ClientSession, url: str) -> str:
    got: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def on(msg) -> None:  # type: ignore[no-untyped-def]
        if not got.done():
            got.set_result(Heartbeat.decode(msg.data).engine_id)

    sub = await nc.subscribe(subj.HEARTBEAT, cb=on)
    engine_id = await asyncio.wait_for(got, 120)
    await sub.unsubscribe()
    for _ in range(600):
        try:
            async with http.get(f"{url}/health") as resp:
                if resp.status == 200:
                    return engine_id
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise TimeoutError("router never became healthy")


async def measure(args: argparse.Namespace, nats_url: str, url: str) -> None:
    nc = await nats.connect(nats_url)
    async with aiohttp.ClientSession() as http:
        engine_id = await wait_ready(nc, http, url)
        ids = list(range(1, args.prompt_len + 1))
        for _ in range(20):  # warm-up both paths (and the engine's cache)
            await direct_once(nc, engine_id, ids)
            await router_once(http, url, ids)
        direct, routed = [], []
        for _ in tqdm(range(args.requests), desc="alternating requests"):
            direct.append(await direct_once(nc, engine_id, ids))
            routed.append(await router_once(http, url, ids))

        async def burst(fn, n: int) -> float:  # type: ignore[no-untyped-def]
            sem = asyncio.Semaphore(args.concurrency)

            async def one() -> None:
                async with sem:
                    await fn()

            start = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(n)))
            return n / (time.perf_counter() - start)

        rps_direct = await burst(lambda: direct_once(nc, engine_id, ids), args.requests)
        rps_router = await burst(lambda: router_once(http, url, ids), args.requests)
    await nc.drain()

    d50, d99 = pct(direct, 0.5) * 1e3, pct(direct, 0.99) * 1e3
    r50, r99 = pct(routed, 0.5) * 1e3, pct(routed, 0.99) * 1e3
    print(
        f"\nmax_tokens=1, prompt {args.prompt_len} tokens, {args.requests} requests per path, "
        f"alternating; concurrency {args.concurrency} for req/s"
    )
    print(f"{'path':<22} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'req/s':>8}")
    print(
        f"{'engine subject':<22} {d50:>8.3f} {d99:>8.3f} "
        f"{statistics.mean(direct) * 1e3:>8.3f} {rps_direct:>8.1f}"
    )
    print(
        f"{'router /generate':<22} {r50:>8.3f} {r99:>8.3f} "
        f"{statistics.mean(routed) * 1e3:>8.3f} {rps_router:>8.1f}"
    )
    print(
        f"router added latency: p50 {r50 - d50:.3f} ms, p99 {r99 - d99:.3f} ms; "
        f"req/s ratio {rps_router / rps_direct:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    nats_server, redis_server = start_nats(), start_redis()
    port = free_port()
    py = sys.executable
    procs = [
        subprocess.Popen(
            [
                py,
                "-m",
                "services.index",
                "--nats-url",
                nats_server.url,
                "--redis-url",
                redis_server.url,
            ]
        ),
        subprocess.Popen(
            [
                py,
                "-m",
                "services.engine",
                "--engine-id",
                "bench-0",
                "--nats-url",
                nats_server.url,
                "--dtype",
                "float32",
                "--log-level",
                "WARNING",
            ]
        ),
        subprocess.Popen(
            [
                py,
                "-m",
                "router",
                "--port",
                str(port),
                "--nats-url",
                nats_server.url,
                "--redis-url",
                redis_server.url,
            ]
        ),
    ]
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
