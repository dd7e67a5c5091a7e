"""A NATS cluster (issue 24, build 1): `hicache-mesh up --nats-cluster 3` runs three
nats-servers with authenticated routes, every process gets all three URLs, and the mesh
survives the loss of the server it is connected to.

Real processes: `up` as a subprocess (fault_helpers.UpMesh), three nats-servers, Redis, the
index, two `tiny` engines and the router. Which server a process is connected to comes from
each member's monitoring `/connz` (connections by client name). Every process lists the
servers in the same order and does not shuffle them, so all are on the first; SIGKILL of
that one under 8 concurrent clients must leave every request answered within the hang bound
(a 200 with the cold greedy tokens, or a clean 5xx / SSE error), the mesh serving again
within 10 s from the kill, every process on the NEXT server of its list (not back on the
restarted first one: failover, not waiting out a restart), and the killed member restarted
by the supervisor and routed again; then the same for the second server (the list is walked
on), and once in a P/D mesh (KV frames and ACKs on the bus). The oracle: answers before and
after the failover equal a cold in-process float64 run of the same prompts. The cluster
alone: a TLS cluster (client and route TLS) fails over, and a server with a wrong route
password never joins.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import signal
import subprocess
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import nats
import nats.errors
import orjson
import pytest
from fault_helpers import (
    Answer,
    Load,
    MeshSpec,
    Req,
    UpMesh,
    cold_reference,
    full_round,
    prompts,
    running_mesh,
    send,
    workload,
)
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bus_schemas.connection import Credentials, connect_nats
from services.launch.nats_cluster import NatsCluster, route_peers, start_nats_cluster
from services.launch.servers import free_port, nats_argv, nats_kind
from services.launch.tls import make_tls

pytestmark = pytest.mark.timeout(300)  # a hang guard only: the module takes ~30 s

SERVERS = 3
RECOVERY_BOUND_S = 10.0  # from the kill to the first request served again
FRESH = Req(prompts(9)[8], 4, False)  # the recovery probe: not in the load's workload


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpMesh]:
    spec = MeshSpec(extra=("--nats-cluster", str(SERVERS)))
    with running_mesh(spec, tmp_path_factory, "nats-cluster") as m:
        yield m


@pytest.fixture(scope="module")
def cold() -> dict[Req, tuple[int, ...]]:
    """The oracle: every request's greedy tokens from a cold float64 engine, cache off."""
    return cold_reference([*workload(), FRESH])


# ------------------------------------------------------------------ the cluster, seen from outside


def members(mesh: UpMesh) -> dict[int, tuple[int, int]]:
    """Client port -> (pid, monitoring port) of every live cluster member."""
    out = {}
    for child in mesh.children():
        if child.role == "nats":
            argv = list(child.argv)
            out[int(argv[argv.index("-p") + 1])] = (child.pid, int(argv[argv.index("-m") + 1]))
    return out


def monitor(port: int, endpoint: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/{endpoint}", timeout=5) as r:
        data: dict[str, Any] = orjson.loads(r.read())
    return data


def connected(mesh: UpMesh) -> dict[str, int]:
    """Client name -> the client port of the member it is connected to."""
    out = {}
    for port, (_, mon) in members(mesh).items():
        with contextlib.suppress(OSError):  # a member (re)starting
            for conn in monitor(mon, "connz?limit=1024")["connections"]:
                out[conn.get("name", "")] = port
    return out


def url_list(mesh: UpMesh) -> list[int]:
    """The client ports of the router's `--nats-url` list, in its order."""
    return [int(u.rsplit(":", 1)[1]) for u in mesh.nats_url().split(",")]


MESH_CLIENTS = ("hicache-router", "hicache-index", "engine-engine-0", "engine-engine-1")


async def wait_for(check: Any, timeout_s: float, what: str) -> float:
    """Poll `check()` until true; the seconds it took."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout_s, f"{what} not within {timeout_s}s"
        await asyncio.sleep(0.1)
    return time.monotonic() - t0


# ------------------------------------------------------------------ tests


async def test_every_process_gets_every_server_and_the_same_auth(mesh: UpMesh) -> None:
    ports = url_list(mesh)
    assert len(ports) == SERVERS and set(ports) == set(members(mesh))
    for child in mesh.children():
        if child.role not in ("nats", "redis"):  # router, index, engines: the whole list
            argv = list(child.argv)
            assert argv[argv.index("--nats-url") + 1] == mesh.nats_url(), child
    where = connected(mesh)
    assert {name: where.get(name) for name in MESH_CLIENTS} == dict.fromkeys(
        MESH_CLIENTS, ports[0]
    )  # the first of the list, for every process: one server, no hop over a route
    for port, (_, mon) in members(mesh).items():
        assert route_peers(f"http://127.0.0.1:{mon}") == SERVERS - 1, port
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(f"nats://127.0.0.1:{port}", allow_reconnect=False)


async def test_losing_the_connected_server_under_load(
    mesh: UpMesh, cold: dict[Req, tuple[int, ...]]
) -> None:
    """All on the list's first server; it dies: all on the second. Once the first is back,
    the second dies too: all on the third (the list is walked on, never retrying a dead
    server while another is up)."""
    expected = {r: cold[r] for r in workload()}
    await full_round(mesh.url, expected)  # the oracle before the faults
    ports = url_list(mesh)
    for victim, successor in itertools.pairwise(ports):
        await _kill_connected(mesh, victim, successor, expected, cold[FRESH])
    await full_round(mesh.url, expected)  # the oracle after the failovers


async def _kill_connected(
    mesh: UpMesh,
    victim: int,
    successor: int,
    expected: dict[Req, tuple[int, ...]],
    fresh_tokens: tuple[int, ...],
    clients: tuple[str, ...] = MESH_CLIENTS,
) -> None:
    """SIGKILL member `victim` (every process connected to it) under 8 clients: every
    answer clean, served again within the bound, every process on `successor`, `victim`
    restarted and routed again."""
    assert {n: connected(mesh).get(n) for n in clients} == dict.fromkeys(clients, victim)
    pid, mon = members(mesh)[victim]
    async with Load(mesh.url, workload(), expected) as load, aiohttp.ClientSession() as http:
        await load.wait_answers(8)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        probe: Answer | None = None
        while probe is None or probe.kind != "ok":
            assert time.monotonic() - t0 < RECOVERY_BOUND_S, f"no recovery: {probe}"
            probe = await send(http, mesh.url, FRESH)
        recovered_s = time.monotonic() - t0
        assert probe.tokens == fresh_tokens
        await load.wait_answers(16)
    errors = Counter(a.detail[:90] for _, a in load.answers if a.kind == "error")
    print(f"\n[nats-cluster] killed :{victim}; served again {recovered_s:.2f}s after the kill; "
          f"{load.summary()}; errors {dict(errors)}")  # fmt: skip
    problems = load.problems(frozenset({"ok", "error"}))  # no hang, no unclean answer
    assert not problems, f"{len(problems)} unclean answers: {problems[:5]}"
    assert recovered_s < RECOVERY_BOUND_S
    # failed over to the next server of the list, not back to the restarted victim
    where = connected(mesh)
    assert {n: where.get(n) for n in clients} == dict.fromkeys(clients, successor)
    # the supervisor restarted the lost member on its ports, and it rejoined the cluster
    await wait_for(lambda: members(mesh).get(victim, (pid,))[0] != pid, 15, "member restart")
    await wait_for(
        lambda: route_peers(f"http://127.0.0.1:{mon}") == SERVERS - 1, 15, "the member's routes"
    )


@pytest.fixture(scope="module")
def pd_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpMesh]:
    spec = MeshSpec(pd=True, extra=("--nats-cluster", str(SERVERS)))
    with running_mesh(spec, tmp_path_factory, "nats-cluster-pd") as m:
        yield m


async def test_pd_survives_losing_the_connected_server(
    pd_mesh: UpMesh, cold: dict[Req, tuple[int, ...]]
) -> None:
    """P/D (KV frames and their ACKs on the bus): the same failover, the same oracle."""
    expected = {r: cold[r] for r in workload()}
    await full_round(pd_mesh.url, expected)
    first, second = url_list(pd_mesh)[:2]
    names = ("hicache-router", "hicache-index", "engine-prefill-0", "engine-decode-0")
    await _kill_connected(pd_mesh, first, second, expected, cold[FRESH], names)
    await full_round(pd_mesh.url, expected)


# ------------------------------------------------------------------ the cluster alone


def test_nats_url_takes_a_list_comma_separated_or_repeated() -> None:
    from router.__main__ import build_parser

    parser = build_parser()
    args = parser.parse_args(["--nats-url", "nats://a:1,nats://b:2", "--nats-url", "nats://c:3"])
    assert args.nats_url == "nats://a:1,nats://b:2,nats://c:3"
    assert parser.parse_args([]).nats_url == "nats://127.0.0.1:4222"  # the default alone
    with pytest.raises(SystemExit):
        parser.parse_args(["--nats-url", " , "])


async def test_tls_cluster_fails_over_and_refuses_a_route_without_the_password(
    tmp_path: Path,
) -> None:
    """`start_nats_cluster` with TLS (clients and routes): a reply crosses a route between two
    clients on different members; the connected member dies and the client fails over to the
    next in its list; a server dialing a member's route port with a wrong route password
    never joins."""
    tls = make_tls(tmp_path / "tls")
    cluster, servers = start_nats_cluster(3, kind=nats_kind(tls=tls), tls=tls)
    try:
        urls = cluster.urls()
        assert all(u.startswith("tls://") for u in urls)
        log = logging.getLogger("test")
        ca = str(tls.ca_file)
        asker = await connect_nats(",".join(urls), name="asker", log=log, tls_ca_file=ca)
        answerer = await connect_nats(urls[2], name="answerer", log=log, tls_ca_file=ca)

        async def answer(msg: Msg) -> None:
            await msg.respond(b"pong")

        await answerer.subscribe("ping", cb=answer)
        await answerer.flush()
        assert await _ask(asker) == b"pong"
        assert asker.connected_url is not None and asker.connected_url.port == cluster.ports[0]
        servers[0].kill()  # what the asker wrote to it before it saw the EOF is lost
        await wait_for(lambda: _port(asker) == cluster.ports[1], 5, "failover to member 1")
        assert await _ask(asker) == b"pong"
        await asker.close()
        await answerer.close()
        intruder = _intruder(cluster, tmp_path, password="wrong")
        try:
            await asyncio.sleep(1.5)  # a route attempt each second: well past the first
            assert cluster.routes(1) == 1 and cluster.routes(2) == 1  # each other, not it
        finally:
            intruder.kill()
            intruder.wait()
    finally:
        for server in servers:
            server.stop()


async def _ask(nc: NATS, timeout_s: float = 10.0) -> bytes:
    """A reply to "ping": asked again while the answerer's interest has not yet crossed
    the routes to the asker's server (no responders), within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return bytes((await nc.request("ping", b"", timeout=1)).data)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


def _port(nc: NATS) -> int | None:
    url = nc.connected_url if nc.is_connected else None
    return None if url is None else url.port


def _intruder(cluster: NatsCluster, tmp: Path, password: str) -> subprocess.Popen[bytes]:
    """A nats-server routing to member 1 as the route user with `password`."""
    wrong = dataclasses.replace(cluster, route=Credentials(cluster.route.user, password))
    workdir = tmp / "intruder"
    workdir.mkdir()
    port, route_port = free_port(cluster.ports), free_port(cluster.route_ports)
    block = wrong.block(0).replace(f':{cluster.route_ports[0]}"', f':{route_port}"', 1)
    argv = nats_argv(port, str(workdir), tls=cluster.tls, cluster=block)
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_reconnects_walk_the_list_never_the_lost_server_first() -> None:
    """`next_server`: the lost server is tried after the others, at once while one has not
    been tried; a failed attempt counts against its server; with one server, the wait is
    the backoff (as before a cluster)."""
    from urllib.parse import urlparse

    from nats.aio.client import Server

    from bus_schemas.connection import Backoff, next_server

    def pool(*reconnects: int) -> list[Server]:
        return [Server(urlparse(f"nats://h{i}:4222"), n) for i, n in enumerate(reconnects)]

    backoff = Backoff(0.1, 5.0)
    chosen, wait = next_server(pool(0, 0, 0), "h0:4222", backoff)
    assert (chosen.uri.netloc, wait) == ("h1:4222", 0.0)  # the next, at once
    chosen, wait = next_server(pool(0, 1, 0), "h1:4222", backoff)
    assert (chosen.uri.netloc, wait) == ("h0:4222", 0.0)  # walks around the list
    chosen, wait = next_server(pool(0, 1, 1), "h0:4222", backoff)
    assert (chosen.uri.netloc, wait) == ("h0:4222", 0.1)  # every other one failed
    chosen, wait = next_server(pool(2, 1, 1), "h0:4222", backoff)
    assert (chosen.uri.netloc, wait) == ("h1:4222", 0.2)  # fewest failures, backing off
    chosen, wait = next_server(pool(0), "h0:4222", backoff)
    assert (chosen.uri.netloc, wait) == ("h0:4222", 0.1)  # one server: as before
