"""Speculative decoding in a real mesh: `up --speculative-algorithm standalone
--speculative-draft-model-path self --enable-hierarchical-cache` answers through the router
(plain and streamed) with the greedy tokens of an in-process engine without speculation, a
repeat is served from the cache with the same tokens, and `/stats` shows the engine's
verify rounds, every proposal of the exact-copy draft accepted. The device pool holds two
requests or so, so the workload sent again is served from the host tier, where the draft's
rows are packed into the target's (`self` has its row shape): the same tokens, and still
every proposal accepted (the draft's state came back with the target's). A second mesh
forces the same draft into a sidecar host pool (`--speculative-draft-host-mode sidecar`):
a request served again from the host gives the same tokens and, like its cold run,
accepts every proposal. (`tiny-draft`, the sidecar by shape, accepts almost nothing
greedily: too little to tell a restored draft from a lost one through `/generate`'s
counts; `test_spec_tiers.py` compares its rounds in process.) The native `/generate` reports the request's
verify rounds and accepted tokens in its meta info, and `/metrics` the engine's
`sglang:spec_accept_length` and `sglang:spec_accept_rate` (from its heartbeats)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from fault_helpers import (
    MeshSpec,
    Req,
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
    # a small device pool: earlier requests' pages move to the host tier as later ones run
    spec = MeshSpec(engines=1, extra=SPEC, host_tier=True, max_total_tokens=96)
    with running_mesh(spec, tmp_path_factory, "spec-self") as m:
        yield m


async def test_speculative_mesh_equals_speculation_off(mesh: UpMesh) -> None:
    reqs = workload(4)
    got = await baseline(mesh.url, reqs)
    assert got == cold_reference(reqs, exact=True)
    await assert_repeat_is_cached(mesh.url, reqs[0], got[reqs[0]])
    again = await baseline(mesh.url, reqs)  # the earlier prompts come back from the host
    assert again == got
    async with aiohttp.ClientSession() as http, http.get(f"{mesh.url}/stats") as r:
        assert r.status == 200, await r.text()
        stats = (await r.json())["engines"]["engine-0"]["stats"]
    assert stats["spec_verify_rounds"] > 0
    assert stats["cached_tokens_host"] > 0 and stats["loads"] > 0, stats
    assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"] > 0


async def test_meta_info_and_metrics_report_acceptance(mesh: UpMesh) -> None:
    body = {
        "input_ids": [5, 6, 7, 8, 9],
        "sampling_params": {"max_new_tokens": 9, "temperature": 0, "ignore_eos": True},
    }
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{mesh.url}/generate", json=body) as r:
            assert r.status == 200, await r.text()
            meta = (await r.json())["meta_info"]
        # 8 tokens after prefill's: two rounds of 3 proposals (4 tokens each), all accepted
        assert meta["spec_verify_ct"] == 2
        assert meta["spec_draft_token_num"] == meta["spec_accept_token_num"] == 6
        assert meta["spec_accept_rate"] == 1.0 and meta["spec_accept_length"] == 4.0
        for _ in range(40):  # the next heartbeat carries the counters
            async with http.get(f"{mesh.url}/metrics") as r:
                text = await r.text()
            rate = re.search(
                r'^sglang:spec_accept_rate\{[^}]*engine_id="engine-0"[^}]*\} (\S+)$', text, re.M
            )
            length = re.search(
                r'^sglang:spec_accept_length\{[^}]*engine_id="engine-0"[^}]*\} (\S+)$', text, re.M
            )
            if rate and float(rate.group(1)) > 0 and length:
                break
            await asyncio.sleep(0.25)
    assert rate is not None and float(rate.group(1)) == 1.0, text[-2000:]
    assert length is not None and float(length.group(1)) > 1.0


async def generate(url: str, ids: list[int]) -> tuple[list[int], dict[str, Any]]:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
    }
    async with aiohttp.ClientSession() as http, http.post(f"{url}/generate", json=body) as r:
        assert r.status == 200, await r.text()
        data = await r.json()
    return data["output_ids"], data["meta_info"]


async def test_a_sidecar_draft_restored_from_the_host_through_the_mesh(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    extra = (*SPEC, "--speculative-draft-host-mode", "sidecar")
    spec = MeshSpec(engines=1, extra=extra, host_tier=True, max_total_tokens=96)
    fresh = [[(31 * k + 7 * i + 3) % 250 for i in range(27)] for k in range(3)]
    with running_mesh(spec, tmp_path_factory, "spec-sidecar") as m:
        cold = [await generate(m.url, ids) for ids in fresh]
        # other requests push the fresh ones out of the small device pool and write over
        # their device pages: a repeat loads them back from the host
        reqs = workload(2)
        assert await baseline(m.url, reqs) == cold_reference(reqs, exact=True)
        again = [await generate(m.url, ids) for ids in fresh]
        async with aiohttp.ClientSession() as http, http.get(f"{m.url}/stats") as r:
            stats = (await r.json())["engines"]["engine-0"]["stats"]
    assert stats["cached_tokens_host"] > 0, stats
    assert any(meta["cached_tokens_host"] > 0 for _, meta in again), again
    for (want, cold_meta), (got, meta) in zip(cold, again, strict=True):
        assert got == want
        assert meta["spec_draft_token_num"] == cold_meta["spec_draft_token_num"]
        assert meta["spec_accept_token_num"] == cold_meta["spec_accept_token_num"]
    assert all(m["spec_accept_token_num"] == m["spec_draft_token_num"] > 0 for _, m in again)
    plain = [Req(tuple(ids), 12, False) for ids in fresh]  # speculation off, no cache
    assert [tuple(t) for t, _ in cold] == list(cold_reference(plain, exact=True).values())
