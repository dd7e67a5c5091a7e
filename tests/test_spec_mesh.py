"""Speculative decoding in a real mesh: `up --speculative-algorithm standalone
--speculative-draft-model-path self` answers through the router (plain and streamed) with
the greedy tokens of an in-process engine without speculation, a repeat is served from
the cache with the same tokens, and `/stats` shows the engine's verify rounds, every
proposal of the exact-copy draft accepted."""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import pytest
from fault_helpers import (
    MeshSpec,
    UpMesh,
    assert_repeat_is_cached,
    baseline,
    cold_reference,
    running_mesh,
    workload,
)

pytestmark = pytest.mark.timeout(300)

SPEC = (
    "--speculative-algorithm",
    "standalone",
    "--speculative-draft-model-path",
    "self",
    "--speculative-num-steps",
    "3",
    "--enable-deterministic-inference",
)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpMesh]:
    spec = MeshSpec(engines=1, extra=SPEC, host_tier=False)
    with running_mesh(spec, tmp_path_factory, "spec-self") as m:
        yield m


async def test_speculative_mesh_equals_speculation_off(mesh: UpMesh) -> None:
    reqs = workload(4)
    got = await baseline(mesh.url, reqs)
    assert got == cold_reference(reqs, exact=True)
    await assert_repeat_is_cached(mesh.url, reqs[0], got[reqs[0]])
    async with aiohttp.ClientSession() as http, http.get(f"{mesh.url}/stats") as r:
        assert r.status == 200, await r.text()
        stats = (await r.json())["engines"]["engine-0"]["stats"]
    assert stats["spec_verify_rounds"] > 0
    assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"] > 0
