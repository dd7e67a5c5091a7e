"""Recovery time after a Redis failover (issue 24, acceptance 3): `hicache-mesh up
--redis-replicas 1` (a Valkey primary, one replica, 3 sentinels with down-after 1000 ms; the
tiny model on 2 engines), and per round, under a light load (2 clients):

    kill -9 the primary -> Sentinel names the replica (promoted)
                        -> the index has resynced it (`hc:index:synced` = its run id)
                        -> the router routes by prefix again (a repeated prompt is routed
                           with reason "cache" and served from the cache)
                        -> the killed node is back as a replica of the new primary

Each stage is timed from the kill. Usage: `python benchmarks/bench_redis_failover.py
[--rounds 3]`. Prints one line per round, then min / median / max per stage, the load
average before and after and the CPU (the machine is shared).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bus_schemas.connection import read_credentials
from bus_schemas.sentinel import DEFAULT_MASTER, INDEX_SYNCED
from services.launch.servers import free_port

STAGES = ("promoted", "resynced", "prefix_again", "rejoined")


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip() if os.path.exists("/proc/loadavg") else "?"


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


class Mesh:
    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.status = workdir / "status.json"
        self.log = workdir / "up.log"
        argv = [sys.executable, "-m", "services.cli", "up", "--port", str(self.port)]
        argv += ["--model", "tiny", "--engines", "2", "--page-size", "4"]
        argv += ["--max-total-tokens", "4096", "--heartbeat-interval", "0.5"]
        argv += ["--redis-replicas", "1", "--status-file", str(self.status)]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while b"is up" not in self.log.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(self.log.read_text()[-3000:])
            time.sleep(0.1)

    def children(self) -> dict[str, dict[str, Any]]:
        return dict(json.loads(self.status.read_text())["children"])

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(60)


async def cache_decisions(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(f"{url}/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith('hicache_router_routing_decisions_total{reason="cache"}'):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def complete(http: aiohttp.ClientSession, url: str, prompt: list[int]) -> int:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    async with http.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {await r.text()}")
        data = await r.json()
    return int(data["usage"]["prompt_tokens_details"]["cached_tokens"])


async def load(http: aiohttp.ClientSession, url: str, stop: asyncio.Event, k: int) -> int:
    """A client sending distinct prompts until `stop`; the number of failed requests."""
    failed, i = 0, 0
    while not stop.is_set():
        i += 1
        try:
            await complete(http, url, [(31 * k + 7 * i + j) % 250 for j in range(24)])
        except (RuntimeError, aiohttp.ClientError):
            failed += 1
    return failed


async def one_round(
    mesh: Mesh, sentinel: aioredis.Redis, node: Any, prompt: list[int]
) -> dict[str, float]:
    url = mesh.url
    async with aiohttp.ClientSession() as http:
        await complete(http, url, prompt)
        while await complete(http, url, prompt) == 0:  # routed by prefix before the kill
            await asyncio.sleep(0.1)
        _h, port = await sentinel.execute_command(
            "SENTINEL", "get-master-addr-by-name", DEFAULT_MASTER
        )
        old = int(port)
        name = next(n for n, c in mesh.children().items() if c.get("port") == old)
        stop = asyncio.Event()
        clients = [asyncio.create_task(load(http, url, stop, k)) for k in range(2)]
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        os.kill(mesh.children()[name]["pid"], signal.SIGKILL)
        out: dict[str, float] = {}
        new = old
        while new == old:
            _h, p = await sentinel.execute_command(
                "SENTINEL", "get-master-addr-by-name", DEFAULT_MASTER
            )
            new = int(p)
            await asyncio.sleep(0.02)
        out["promoted"] = time.monotonic() - t0
        primary = node(new)
        while True:
            marker, info = await primary.get(INDEX_SYNCED), await primary.info("server")
            if marker == info["run_id"]:
                break
            await asyncio.sleep(0.02)
        out["resynced"] = time.monotonic() - t0
        while True:
            before = await cache_decisions(http, url)
            cached = await complete(http, url, prompt)
            if cached > 0 and await cache_decisions(http, url) > before:
                break
            await asyncio.sleep(0.02)
        out["prefix_again"] = time.monotonic() - t0
        stop.set()
        failed = sum(await asyncio.gather(*clients))
        back = node(old)
        while True:
            try:
                info = await back.info("replication")
                linked = info.get("master_link_status") == "up"
                if linked and int(info.get("master_port", 0)) == new:
                    break
            except (aioredis.RedisError, OSError):
                pass
            await asyncio.sleep(0.05)
        out["rejoined"] = time.monotonic() - t0
        out["failed"] = failed
        return out


async def run(rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mesh = Mesh(Path(tmp))
        try:
            status = json.loads(mesh.status.read_text())
            root = Path(status["credentials_dir"])
            index = read_credentials(root / "redis" / "index")
            sent = read_credentials(root / "redis" / "sentinels")
            children = mesh.children()
            sentinel = aioredis.Redis(
                port=children["redis-sentinel-1"]["port"],
                username=sent.user,
                password=sent.password,
                decode_responses=True,
            )
            clients: dict[int, aioredis.Redis] = {}

            def node(port: int) -> aioredis.Redis:
                if port not in clients:
                    clients[port] = aioredis.Redis(
                        port=port,
                        username=index.user,
                        password=index.password,
                        decode_responses=True,
                        socket_timeout=1.0,
                    )
                return clients[port]

            print(f"cpu: {cpu_model()}; load before: {loadavg()}", flush=True)
            results = []
            for r in range(rounds):
                prompt = [(13 * r + 5 * j + 1) % 250 for j in range(26)]
                res = await one_round(mesh, sentinel, node, prompt)
                results.append(res)
                stages = "  ".join(f"{s} {res[s]:.2f}s" for s in STAGES)
                print(f"round {r + 1}: {stages}  failed requests {int(res['failed'])}", flush=True)
            for s in STAGES:
                xs = [r[s] for r in results]
                print(
                    f"{s:>13}: min {min(xs):.2f}s  median {statistics.median(xs):.2f}s  "
                    f"max {max(xs):.2f}s"
                )
            print(f"load after: {loadavg()}")
            await sentinel.aclose()
            for c in clients.values():
                await c.aclose()
        finally:
            mesh.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    asyncio.run(run(ap.parse_args().rounds))


if __name__ == "__main__":
    main()
