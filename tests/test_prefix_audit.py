"""Predicted against delivered prefix hits (issue 12, build 5 and acceptance 5).

A real mesh (`hicache-mesh up --engines 2`: two engines, so the router asks the index for
every request). In steady state, once each request's pages reached Redis, the prefix the
index predicts equals what the engine delivers: the audit counts only exact predictions.
Then both engines flush behind the index's back (`--debug-silent-flush`: no KV events), and
the next request is predicted a prefix its engine no longer holds: the audit reports the
error in /stats and /metrics.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from fault_helpers import PAGE, MeshSpec, UpMesh, running_mesh

from bus_schemas import redis_keys

pytestmark = pytest.mark.timeout(180)

PROMPT = [(i * 29 + 11) % 250 for i in range(41)]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpMesh]:
    spec = MeshSpec(engines=2, extra=("--debug-silent-flush",))
    with running_mesh(spec, tmp_path_factory, "audit", timeout_s=120) as m:
        yield m


async def complete(http: aiohttp.ClientSession, mesh: UpMesh, prompt: list[int]) -> Any:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    async with http.post(f"{mesh.url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def pages_indexed(r: aioredis.Redis, want: int) -> None:
    """Wait until the index holds `want` pages (the steady state)."""
    deadline, held = time.monotonic() + 20, -1
    while time.monotonic() < deadline:
        held = len([k async for k in r.scan_iter(match=redis_keys.PAGE_PREFIX + "*")])
        if held == want:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the index holds {held} pages, expected {want}")


async def audit(http: aiohttp.ClientSession, mesh: UpMesh) -> dict[str, Any]:
    async with http.get(f"{mesh.url}/stats") as resp:
        assert resp.status == 200
        summary: dict[str, Any] = (await resp.json())["router"]["prefix_prediction"]
        return summary


async def metric(http: aiohttp.ClientSession, mesh: UpMesh, result: str) -> float:
    async with http.get(f"{mesh.url}/metrics") as resp:
        text = await resp.text()
    line = f'hicache_router_prefix_predictions_total{{result="{result}"}} '
    values = [float(s[len(line) :]) for s in text.splitlines() if s.startswith(line)]
    return values[0] if values else 0.0


async def test_predictions_are_exact_in_steady_state_and_a_silent_flush_shows(
    mesh: UpMesh,
) -> None:
    r = aioredis.Redis.from_url(mesh.redis_url(), decode_responses=True)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            first = await complete(http, mesh, PROMPT)
            out = first["choices"][0]["token_ids"]
            held = (len(PROMPT) + MAX_TOKENS - 1) // PAGE  # the KV of all but the last token
            await pages_indexed(r, held)
            again = await complete(http, mesh, PROMPT)
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 40
            longer = PROMPT + out + [7] * 16  # the history and a new turn
            grown = await complete(http, mesh, longer)
            assert grown["usage"]["prompt_tokens_details"]["cached_tokens"] == held * PAGE
            steady = await audit(http, mesh)
            assert steady["requests"] == 3 and steady["exact"] == 3, steady
            assert steady["max_abs_error_tokens"] == 0 and await metric(http, mesh, "over") == 0

            # both engines drop their caches without telling the index
            async with http.post(f"{mesh.url}/flush_cache") as resp:
                assert resp.status == 200, await resp.text()
            stale = await complete(http, mesh, PROMPT)
            assert stale["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            after = await audit(http, mesh)
    finally:
        await r.aclose()
    assert after["requests"] == 4 and after["over"] == 1, after
    assert after["max_abs_error_tokens"] == 40 and after["mean_abs_error_tokens"] == 10.0
    (miss,) = after["recent_mispredictions"]
    assert miss["predicted"] == 40 and miss["delivered"] == 0
    assert miss["engine_id"] in mesh.spec.engine_ids
    async with aiohttp.ClientSession() as http:
        assert await metric(http, mesh, "over") == 1
