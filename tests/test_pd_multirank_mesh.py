"""P/D between multi-rank engines in a real mesh (issue 10, acceptance 3; issue 8).

`hicache-mesh up --pd --tp-size 2 --model M --dtype float64`: a prefill engine of two rank
processes packs each request's KV on rank 0 and sends it through NATS as frames to a decode
engine of two rank processes, which cuts and writes them on both ranks. For `tiny-tp` every
rank's KV heads travel; for `tiny-mla` the latent, the same on both TP ranks, travels once
(`ParallelConfig.kv_ranks`). Greedy outputs through the router, plain and streamed, equal
an in-process TP1 engine's cold run, and the answers name both engines (the requests were
disaggregated).
"""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import pytest
from fault_helpers import MeshSpec, UpMesh, baseline, cold_reference, running_mesh, workload

pytestmark = pytest.mark.timeout(400)

EXACT = ("--dtype", "float64", "--enable-deterministic-inference")


@pytest.fixture(scope="module", params=["tiny-tp", "tiny-mla"])
def mesh(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[UpMesh]:
    spec = MeshSpec(model=request.param, pd=True, extra=("--tp-size", "2", *EXACT))
    with running_mesh(spec, tmp_path_factory, request.param) as m:
        yield m


async def test_pd_between_tp2_engines_equals_tp1(mesh: UpMesh) -> None:
    model = mesh.spec.model
    reqs = workload()
    got = await baseline(mesh.url, reqs)  # plain and streamed, 8 clients at a time
    assert got == cold_reference(reqs, model, exact=True)
    assert {len(ranks) for ranks in map(mesh.ranks_of, mesh.spec.engine_ids)} == {1}
    async with aiohttp.ClientSession() as http:
        body = {"prompt": list(reqs[0].prompt), "max_tokens": 6, "temperature": 0}
        async with http.post(f"{mesh.url}/v1/completions", json=body | {"ignore_eos": True}) as r:
            assert r.status == 200, await r.text()
            data = await r.json()
            engines = (r.headers["X-Hicache-Prefill-Engine"], r.headers["X-Hicache-Engine"])
    assert engines == ("prefill-0", "decode-0")
    assert tuple(data["choices"][0]["token_ids"]) == got[reqs[0]]
