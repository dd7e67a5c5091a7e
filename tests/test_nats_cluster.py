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
by the supervisor and routed again. The oracle: answers before and after the failover equal
a cold in-process float64 run of the same prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
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
        assert monitor(mon, "routez")["num_routes"] == SERVERS - 1, port
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
) -> None:
    """SIGKILL member `victim` (every process connected to it) under 8 clients: every
    answer clean, served again within the bound, every process on `successor`, `victim`
    restarted and routed again."""
    assert {n: connected(mesh).get(n) for n in MESH_CLIENTS} == dict.fromkeys(MESH_CLIENTS, victim)
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
    assert {n: where.get(n) for n in MESH_CLIENTS} == dict.fromkeys(MESH_CLIENTS, successor)
    # the supervisor restarted the lost member on its ports, and it rejoined the cluster
    await wait_for(lambda: members(mesh).get(victim, (pid,))[0] != pid, 15, "member restart")
    await wait_for(lambda: _routes(mon) == SERVERS - 1, 15, "routes of the restarted member")


def _routes(monitor_port: int) -> int:
    try:
        return int(monitor(monitor_port, "routez")["num_routes"])
    except OSError:
        return -1
