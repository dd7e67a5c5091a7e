"""A context-parallel engine in a real mesh (issue 22, acceptance 1: "through the mesh").

`hicache-mesh up --engines 1 --cp-size 2 --enable-kv-cache-sharding`: the engine service
is rank 0 of a world of 2 rank processes, each holding half the device pool's pages and
gathering a layer's pages before attending. Through the router, greedy outputs (plain and
streamed) equal an in-process CP1 engine's, and a repeat is served from the sharded cache.
"""

from __future__ import annotations

from collections.abc import Iterator

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

CP_SHARDED = ("--cp-size", "2", "--enable-kv-cache-sharding")


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
