"""What a NATS cluster costs and how fast the mesh comes back when a member dies (issue 24).

Bus: NATS request/reply round trips (a small payload, one at a time) in three arms, side by
side in interleaved rounds (each round runs every arm once, so a loaded machine's drift hits
all alike):
  - "1 server": requester and responder on one nats-server;
  - "cluster, same server": both on member 0 of a 3-server cluster (where a mesh's processes
    are: they all list the servers in the same order);
  - "cluster, via a route": requester on member 0, responder on member 1 (one route hop).
Then the bus failover: the requester (connected as a mesh process is, `connect_nats` with the
whole list) loses its server (SIGKILL); the time from the kill to its first reply.

End to end (`--e2e`, default on): two `hicache-mesh up` meshes of one `tiny` engine, one NATS
server vs `--nats-cluster 3`; completions of max_tokens=1 through the router, interleaved;
then, on the cluster mesh, SIGKILL of the member every process is on, and the time from the
kill to the first request served again (each member in turn; the supervisor restarts it).

    python benchmarks/bench_nats_cluster.py [--rounds 20] [--per-round 200] [--no-e2e]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import nats
from bench_record import stop
from machine_load import ForeignLoad
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bus_schemas.connection import connect_nats
from services.launch.nats_cluster import start_nats_cluster, wait_for_routes
from services.launch.servers import NATS as NATS_KIND
from services.launch.servers import free_port, start_server

Arm = Callable[[], Awaitable[float]]
CLUSTER_URLS: list[str] = []  # the bus failover's cluster, in its list order


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def row(name: str, us: list[float], base: float | None) -> str:
    p50 = pct(us, 0.5)
    added = "" if base is None else f"{p50 - base:+9.1f}"
    return f"{name:<26}{p50:>9.1f}{pct(us, 0.99):>9.1f}{statistics.fmean(us):>9.1f}{added:>11}"


HEADER = f"{'arm':<26}{'p50 us':>9}{'p99 us':>9}{'mean us':>9}{'p50 added':>11}"


async def pair(requester_url: str, responder_url: str, subject: str) -> tuple[NATS, NATS]:
    responder = await nats.connect(responder_url)

    async def echo(msg: Msg) -> None:
        await msg.respond(msg.data)

    await responder.subscribe(subject, cb=echo)
    await responder.flush()
    requester = await nats.connect(requester_url)
    for _ in range(100):  # the responder's interest crosses the route asynchronously
        with contextlib.suppress(nats.errors.NoRespondersError, nats.errors.TimeoutError):
            await requester.request(subject, b"x", timeout=1)
            break
        await asyncio.sleep(0.05)
    return requester, responder


async def bus(args: argparse.Namespace) -> None:
    single = start_server(NATS_KIND)
    cluster, members = start_nats_cluster(3)
    payload = b"x" * args.payload
    clients: list[NATS] = []
    try:
        arms: dict[str, Arm] = {}
        for name, req_url, resp_url in (
            ("1 server", single.url, single.url),
            ("cluster, same server", members[0].url, members[0].url),
            ("cluster, via a route", members[0].url, members[1].url),
        ):
            subject = f"bench.{len(arms)}"
            requester, responder = await pair(req_url, resp_url, subject)
            clients += [requester, responder]

            async def one(nc: NATS = requester, subject: str = subject) -> float:
                t0 = time.perf_counter()
                await nc.request(subject, payload, timeout=5)
                return (time.perf_counter() - t0) * 1e6

            arms[name] = one
        samples: dict[str, list[float]] = {name: [] for name in arms}
        for arm in arms.values():  # warm up
            for _ in range(args.per_round):
                await arm()
        for _ in range(args.rounds):
            for name, arm in arms.items():
                samples[name] += [await arm() for _ in range(args.per_round)]
        print(f"\nNATS request/reply round trip, {args.payload} B payload, {args.rounds} "
              f"interleaved rounds x {args.per_round} requests per arm")  # fmt: skip
        print(HEADER)
        base = pct(samples["1 server"], 0.5)
        for name, us in samples.items():
            print(row(name, us, None if name == "1 server" else base))
        for nc in clients:
            await nc.close()
        clients = []
        await bus_failover(args, cluster, members)
    finally:
        for nc in clients:
            await nc.close()
        single.stop()
        for m in members:
            m.stop()


async def bus_failover(args: argparse.Namespace, cluster: object, members: list) -> None:
    """Kill the requester's server `args.trials` times; kill -> first reply, each time."""
    from services.launch.nats_cluster import NatsCluster

    assert isinstance(cluster, NatsCluster)
    log = logging.getLogger("bench")
    log.addHandler(logging.NullHandler())
    log.propagate = False
    urls = cluster.urls()
    CLUSTER_URLS[:] = urls
    quiet = {"error_cb": _quiet, "disconnected_cb": _nothing}
    responder = await connect_nats(",".join(reversed(urls)), name="resp", log=log, **quiet)

    async def echo(msg: Msg) -> None:
        await msg.respond(msg.data)

    await responder.subscribe("bench.failover", cb=echo)
    requester = await connect_nats(",".join(urls), name="req", log=log, **quiet)
    moved, took = [], []
    try:
        for _ in range(args.trials):
            await _ask(requester, 10.0)
            assert requester.connected_url is not None
            victim = urls.index(requester.connected_url.geturl().rstrip("/"))
            members[victim].kill()
            t0 = time.perf_counter()
            while _on(requester) in (None, victim):
                await asyncio.sleep(0.0005)
            moved.append((time.perf_counter() - t0) * 1e3)
            await _ask(requester, 10.0)
            took.append((time.perf_counter() - t0) * 1e3)
            members[victim] = start_server(cluster.member(victim), cluster.ports[victim])
            wait_for_routes(cluster)
    finally:
        await requester.close()
        await responder.close()
    print(f"\nbus failover (the requester's server SIGKILLed, {args.trials} trials), ms:\n"
          f"  kill -> connected to another member: {_ms(moved)}\n"
          f"  kill -> first reply:                 {_ms(took)}")  # fmt: skip


def _ms(values: list[float]) -> str:
    return f"{', '.join(f'{t:.1f}' for t in values)} (median {statistics.median(values):.1f})"


def _on(nc: NATS) -> int | None:
    """The index of the cluster member `nc` is connected to (None: reconnecting)."""
    url = nc.connected_url if nc.is_connected else None
    return None if url is None else CLUSTER_URLS.index(url.geturl().rstrip("/"))


async def _quiet(_e: Exception) -> None:
    return None


async def _nothing() -> None:
    return None


async def _ask(nc: NATS, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await nc.request("bench.failover", b"x", timeout=0.05)  # one lost: ask again
            return
        except (nats.errors.Error, TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.001)


# ------------------------------------------------------------------ end to end


def start_up(workdir: Path, extra: list[str]) -> tuple[subprocess.Popen[bytes], str, Path]:
    port, status = free_port(), workdir / "status.json"
    argv = [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--model", "tiny"]
    argv += ["--engines", "1", "--page-size", "16", "--status-file", str(status), *extra]
    log_path = workdir / "up.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while b"is up" not in log_path.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(log_path.read_text(errors="replace")[-3000:])
        time.sleep(0.2)
    return proc, f"http://127.0.0.1:{port}", status


async def complete(http: aiohttp.ClientSession, url: str, prompt: list[int]) -> bool:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    try:
        async with http.post(f"{url}/v1/completions", json=body) as r:
            await r.read()
            return r.status == 200
    except aiohttp.ClientError:
        return False


async def e2e(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "one").mkdir()
        (Path(tmp) / "cluster").mkdir()
        one = start_up(Path(tmp) / "one", [])
        clustered = start_up(Path(tmp) / "cluster", ["--nats-cluster", "3"])
        try:
            await e2e_runs(args, {"1 server": one[1], "3-server cluster": clustered[1]})
            await e2e_recovery(args, clustered[1], clustered[2])
        finally:
            stop(one[0])
            stop(clustered[0])


async def e2e_runs(args: argparse.Namespace, urls: dict[str, str]) -> None:
    samples: dict[str, list[float]] = {name: [] for name in urls}
    prompt = list(range(1, 17))
    async with aiohttp.ClientSession() as http:
        for url in urls.values():  # warm up
            for _ in range(20):
                assert await complete(http, url, prompt)
        for _ in range(args.rounds):
            for name, url in urls.items():
                for _ in range(args.e2e_per_round):
                    t0 = time.perf_counter()
                    assert await complete(http, url, prompt)
                    samples[name].append((time.perf_counter() - t0) * 1e6)
    print(f"\nrouter completion, max_tokens=1 (tiny, 1 engine), {args.rounds} interleaved "
          f"rounds x {args.e2e_per_round} requests per mesh")  # fmt: skip
    print(HEADER)
    base = pct(samples["1 server"], 0.5)
    for name, us in samples.items():
        print(row(name, us, None if name == "1 server" else base))


async def e2e_recovery(args: argparse.Namespace, url: str, status_path: Path) -> None:
    """SIGKILL the member every process is on (nats-0, then nats-1, then nats-2: each loss
    moves them all to the next); kill -> first completion served again."""
    took = []
    prompt = list(range(100, 116))
    async with aiohttp.ClientSession() as http:
        for i in range(3):
            status = json.loads(status_path.read_text())
            pid = status["children"][f"nats-{i}"]["pid"]
            os.kill(pid, signal.SIGKILL)
            t0 = time.perf_counter()
            while not await complete(http, url, prompt):
                assert time.perf_counter() - t0 < 30, "the mesh did not recover"
                await asyncio.sleep(0.001)
            took.append((time.perf_counter() - t0) * 1e3)
            await asyncio.sleep(2.0)  # the supervisor restarts the member (0.5 s backoff)
    print(f"\nmesh failover (the connected member SIGKILLed, each member in turn): kill -> "
          f"first completion ms: {', '.join(f'{t:.1f}' for t in took)}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--per-round", type=int, default=200, help="bus requests per arm per round")
    p.add_argument("--e2e-per-round", type=int, default=10)
    p.add_argument("--payload", type=int, default=64, help="bytes per bus request")
    p.add_argument("--trials", type=int, default=5, help="bus failovers to time")
    p.add_argument("--no-e2e", dest="e2e", action="store_false")
    args = p.parse_args()
    foreign = ForeignLoad()
    asyncio.run(bus(args))
    if args.e2e:
        asyncio.run(e2e(args))
    cores = foreign.cores()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nload average {load}; other processes used "
          f"{'n/a' if cores is None else f'{cores:.2f}'} cores; {os.cpu_count()} CPUs")  # fmt: skip


if __name__ == "__main__":
    main()
