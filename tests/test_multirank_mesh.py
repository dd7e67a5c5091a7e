"""Multi-rank engines in a real mesh (issue 8, acceptance 1 and 3).

`hicache-mesh up --engines 2 --tp-size 2 --pp-size 2`: each engine service is rank 0 of a
world of 4 rank processes. Through the router, greedy outputs equal an in-process TP1
engine's, and a repeat hits the cache. Then one rank process of engine-0 is killed with
SIGKILL while it generates a long stream: the stream ends with a clear error within 10 s,
the next requests are served by engine-1, every process of the old engine-0 is gone, and
the supervisor brings engine-0 back (a new epoch) so the mesh is whole again.
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
    MeshSpec,
    UpMesh,
    assert_repeat_is_cached,
    baseline,
    cold_reference,
    epochs,
    finish_stream,
    full_round,
    held_stream,
    running_mesh,
    send_all,
    wait_healed,
    workload,
)

pytestmark = pytest.mark.timeout(400)

LONG_PROMPT = tuple(range(30, 50))
TP_PP = ("--tp-size", "2", "--pp-size", "2")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpMesh]:
    with running_mesh(MeshSpec(engines=2, extra=TP_PP), tmp_path_factory, "tp2pp2") as m:
        yield m


async def test_tp2_pp2_mesh_equals_tp1(mesh: UpMesh) -> None:
    reqs = workload()
    got = await baseline(mesh.url, reqs)  # plain and streamed, 8 clients at a time
    assert got == cold_reference(reqs)
    assert {len(ranks) for ranks in map(mesh.ranks_of, mesh.spec.engine_ids)} == {3}
    await assert_repeat_is_cached(mesh.url, reqs[0], got[reqs[0]])


async def test_rank_killed_mid_generation(mesh: UpMesh) -> None:
    reqs = workload()
    expected = await baseline(mesh.url, reqs)
    old_epoch = (await epochs(mesh.url, mesh.spec.engine_ids))["engine-0"]
    old = [mesh.pid_of("engine-0"), *mesh.ranks_of("engine-0").values()]
    async with aiohttp.ClientSession() as http:
        # 1000 tokens: still streaming when the kill lands, however fast the engine runs
        held, engine = await held_stream(
            http, mesh.url, LONG_PROMPT, engine="engine-0", max_tokens=1000
        )
        victim = mesh.ranks_of("engine-0")[3]  # PP1/TP1: the last stage, which samples
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        witness = asyncio.create_task(finish_stream(held))
        answers = await send_all(mesh.url, reqs)  # meanwhile: served by the survivor
        end = await witness
    took = time.monotonic() - killed_at
    print(f"\n[multirank] rank 3 of engine-0 killed: the held stream ended in {took:.2f}s")
    assert engine == "engine-0"
    assert end.kind == "error", f"the held stream must end with a clear error: {end}"
    assert took < 10, f"the held stream took {took:.1f}s to end"
    bad = [a for a in answers if a.kind != "ok"]
    assert not bad, f"requests after the kill: {bad[:3]}"
    assert {a.engine for a in answers} == {"engine-1"}
    assert [a.tokens for a in answers] == [expected[r] for r in reqs]

    deadline = time.monotonic() + 15
    while any(_alive(pid) for pid in old):
        assert time.monotonic() < deadline, f"left behind: {[p for p in old if _alive(p)]}"
        await asyncio.sleep(0.1)

    await wait_healed(mesh)  # the supervisor restarted engine-0: a new world, a new epoch
    assert (await epochs(mesh.url, mesh.spec.engine_ids))["engine-0"] != old_epoch
    assert len(mesh.ranks_of("engine-0")) == 3
    await full_round(mesh.url, expected)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"
