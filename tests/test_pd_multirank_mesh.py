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

import os
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from fault_helpers import PAGE, MeshSpec, Req, UpMesh, baseline, workload

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams

pytestmark = pytest.mark.timeout(400)

EXACT = ("--dtype", "float64", "--enable-deterministic-inference")


@pytest.fixture(scope="module", params=["tiny-tp", "tiny-mla"])
def mesh(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[UpMesh]:
    model = request.param
    log_dir = Path(os.environ.get("FAULT_MATRIX_LOG_DIR", tmp_path_factory.mktemp(model)))
    log_dir.mkdir(parents=True, exist_ok=True)
    m = UpMesh(MeshSpec(pd=True, extra=("--tp-size", "2", "--model", model, *EXACT)), log_dir)
    m.start(timeout_s=180)
    try:
        yield m
    finally:
        code = m.stop()
    assert code == 0, f"`up` did not stop cleanly: {code}\n{m.log_tail()}"


def tp1_reference(model: str, reqs: list[Req]) -> dict[Req, tuple[int, ...]]:
    cache = CacheConfig(page_size=PAGE, enable_radix_cache=False)
    eng = Engine(EngineConfig(model=model, dtype="float64", cache=cache, batch_invariant=True))
    out = {}
    for r in reqs:
        sp = SamplingParams(max_new_tokens=r.max_tokens, ignore_eos=True)
        out[r] = tuple(eng.generate(list(r.prompt), sp).output_ids)
    eng.close()
    return out


async def test_pd_between_tp2_engines_equals_tp1(mesh: UpMesh) -> None:
    model = mesh.spec.extra[mesh.spec.extra.index("--model") + 1]
    reqs = workload()
    got = await baseline(mesh.url, reqs)  # plain and streamed, 8 clients at a time
    assert got == tp1_reference(model, reqs)
    assert {len(ranks) for ranks in map(mesh.ranks_of, mesh.spec.engine_ids)} == {1}
    async with aiohttp.ClientSession() as http:
        body = {"prompt": list(reqs[0].prompt), "max_tokens": 6, "temperature": 0}
        async with http.post(f"{mesh.url}/v1/completions", json=body | {"ignore_eos": True}) as r:
            assert r.status == 200, await r.text()
            data = await r.json()
            engines = (r.headers["X-Hicache-Prefill-Engine"], r.headers["X-Hicache-Engine"])
    assert engines == ("prefill-0", "decode-0")
    assert tuple(data["choices"][0]["token_ids"]) == got[reqs[0]]
