"""A context-parallel engine in a real mesh (issue 22, acceptance 1: "through the mesh").

`hicache-mesh up --engines 1 --cp-size 2 --enable-kv-cache-sharding`: the engine service
is rank 0 of a world of 2 rank processes, each holding half the device pool's pages and
gathering a layer's pages before attending. Through the router, greedy outputs (plain and
streamed) equal an in-process CP1 engine's, and a repeat is served from the sharded cache.

Then (acceptance 5) the other CP rank, world rank 1, is killed with SIGKILL under load (8
clients, plus a long stream and a round of requests sent just before the kill): every
request in flight ends within 10 s, the long stream with a clear error and the others
served or failed clearly (none hangs, none is malformed), every process of the old engine
exits, `up`'s supervisor restarts the engine (a new world, a new epoch), and the mesh
serves again with the greedy outputs of before.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from fault_helpers import (
    Answer,
    Load,
    MeshSpec,
    Req,
    UpMesh,
    assert_repeat_is_cached,
    baseline,
    cold_reference,
    epochs,
    finish_stream,
    full_round,
    held_stream,
    running_mesh,
    send,
    wait_healed,
    workload,
)

pytestmark = pytest.mark.timeout(300)

CP_SHARDED = ("--cp-size", "2", "--enable-kv-cache-sharding")
LONG_PROMPT = tuple(range(30, 50))
# four more long requests (plain and streamed) that the kill must fail
LONG = [Req(tuple(range(60 + k, 80 + k)), 1000, k % 2 == 1) for k in range(4)]
FAIL_WITHIN_S = 10.0  # acceptance 5: a killed rank's requests end with an error within it


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpMesh]:
    spec = MeshSpec(engines=1, extra=CP_SHARDED, host_tier=False)
    with running_mesh(spec, tmp_path_factory, "cp2sharded") as m:
        yield m


async def test_cp2_sharded_mesh_equals_cp1(mesh: UpMesh) -> None:
    reqs = workload()
    got = await baseline(mesh.url, reqs)  # plain and streamed, 8 clients at a time
    assert got == cold_reference(reqs)
    assert len(mesh.ranks_of("engine-0")) == 1  # rank 1: the other CP rank
    assert "engine world TP1/PP1/CP2 sharded up" in mesh.log_path.read_text()
    await assert_repeat_is_cached(mesh.url, reqs[0], got[reqs[0]])


async def test_cp_rank_killed_under_load(mesh: UpMesh) -> None:
    reqs = workload()
    expected = await baseline(mesh.url, reqs)
    old_epoch = (await epochs(mesh.url, mesh.spec.engine_ids))["engine-0"]
    old = [mesh.pid_of("engine-0"), *mesh.ranks_of("engine-0").values()]
    async with Load(mesh.url, reqs, expected) as load, aiohttp.ClientSession() as http:
        await load.wait_answers(8)
        # 1000 tokens: still streaming when the kill lands, however fast the engine runs
        held, engine = await held_stream(http, mesh.url, LONG_PROMPT, max_tokens=1000)
        inflight = [asyncio.create_task(_timed(http, mesh.url, r)) for r in reqs + LONG]
        await asyncio.sleep(0.5)  # they reach the engine; the short ones may end first
        killed_at = time.monotonic()
        os.kill(mesh.ranks_of("engine-0")[1], signal.SIGKILL)
        end = await finish_stream(held)
        held_took = time.monotonic() - killed_at
        ended = await asyncio.gather(*inflight)
        await _gone(old)
        healed_in = await wait_healed(mesh)  # the supervisor restarted engine-0
        await load.wait_answers(8)  # the load is served again
    took = max(held_took, *(t - killed_at for _, t in ended))
    print(
        f"\n[cp] rank 1 of engine-0 killed: in-flight requests ended within {took:.2f}s, "
        f"healed {healed_in:.1f}s later; load: {load.summary()}"
    )
    assert engine == "engine-0"
    assert end.kind == "error", f"the held stream must end with a clear error: {end}"
    assert took < FAIL_WITHIN_S, f"requests in flight took {took:.1f}s to end"
    assert [a.kind for a, _ in ended[len(reqs) :]] == ["error"] * len(LONG)
    wrong = [
        (r, a)
        for r, (a, _) in zip(reqs, ended[: len(reqs)], strict=True)
        if a.kind not in ("ok", "error") or (a.kind == "ok" and a.tokens != expected[r])
    ]
    assert not wrong, f"requests in flight at the kill: {wrong[:3]}"
    assert not load.problems(frozenset({"ok", "error"})), load.summary()  # no hang, no junk
    assert (await epochs(mesh.url, mesh.spec.engine_ids))["engine-0"] != old_epoch
    assert mesh.pid_of("engine-0") not in old and len(mesh.ranks_of("engine-0")) == 1
    await full_round(mesh.url, expected)


async def _timed(http: aiohttp.ClientSession, url: str, req: Req) -> tuple[Answer, float]:
    answer = await send(http, url, req)
    return answer, time.monotonic()


async def _gone(pids: list[int], timeout_s: float = 15.0) -> None:
    """Until every process of `pids` has exited (a zombie counts as exited)."""
    deadline = time.monotonic() + timeout_s
    while alive := [p for p in pids if _alive(p)]:
        assert time.monotonic() < deadline, f"left behind: {alive}"
        await asyncio.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"
