"""Buckets through the mesh (issue 10, build 5): a conversation that outgrows the short
bucket moves to the long one, which reads what the short one stored.

`hicache-mesh up --bucket short:tp=1,max_len=64,engines=1 --bucket long:tp=2,engines=1` with
one `file` store and the unified key scheme (head partition 2, layer partition 4 on
`tiny-tp`): turn 1 fits the short bucket (a TP1 engine) and is written through to the store;
turn 2, the same history plus more, is too long for it and goes to the long bucket (a TP2
engine), whose usage reports the short bucket's pages as storage hits. Both turns' tokens
equal an offline TP1 engine's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import aiohttp
import pytest
import redis.asyncio as aioredis
from fault_helpers import MeshSpec, UpMesh, running_mesh

from bus_schemas import redis_keys
from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)

PAGE = 4
TURN1 = [(i * 31 + 7) % 250 for i in range(41)]
NEW = [(i * 17 + 3) % 250 for i in range(30)]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpMesh]:
    store = tmp_path_factory.mktemp("store")
    extra = ("--bucket", "short:tp=1,max_len=64,engines=1")
    extra += ("--bucket", "long:tp=2,engines=1", "--hicache-storage-backend", "file")
    extra += ("--hicache-storage-dir", str(store), "--hicache-storage-key-scheme", "unified")
    extra += ("--hicache-storage-layer-partition", "4", "--hicache-storage-head-partition", "2")
    extra += ("--hicache-storage-prefetch-policy", "wait_complete")
    with running_mesh(
        MeshSpec(model="tiny-tp", engines=1, extra=extra), tmp_path_factory, "buckets"
    ) as m:
        yield m


def offline(prompt: list[int], n: int) -> list[int]:
    eng = Engine(EngineConfig(model="tiny-tp", cache=CacheConfig(page_size=PAGE)))
    out = eng.generate(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True)).output_ids
    eng.close()
    return out


async def complete(
    http: aiohttp.ClientSession, mesh: UpMesh, prompt: list[int]
) -> tuple[str, dict[str, object]]:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    async with http.post(f"{mesh.url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["X-Hicache-Engine"], await resp.json()


async def test_a_conversation_moves_to_the_long_bucket_and_reads_the_short_ones_pages(
    mesh: UpMesh,
) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        engine1, first = await complete(http, mesh, TURN1)
        assert engine1 == "short-0"
        out1 = first["choices"][0]["token_ids"]  # type: ignore[index]
        assert out1 == offline(TURN1, 4)
        # the short bucket's pages reach the store (and the index: its storage events)
        r = aioredis.Redis.from_url(mesh.redis_url(), decode_responses=True)
        try:
            deadline, stored = time.monotonic() + 30, 0
            while stored < 11 and time.monotonic() < deadline:
                stored = len([k async for k in r.scan_iter(match=redis_keys.STORE_PREFIX + "*")])
                await asyncio.sleep(0.1)
            assert stored >= 11  # (41 + 4 - 1) // 4 pages of the short engine's KV
        finally:
            await r.aclose()
        turn2 = TURN1 + out1 + NEW  # 75 tokens + 4: past the short bucket's 64
        engine2, second = await complete(http, mesh, turn2)
    assert engine2 == "long-0"
    tiers = second["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]  # type: ignore[index]
    # the short engine's KV covers TURN1 + out1 but its last token: 44 tokens, 11 whole pages
    assert tiers == {"device": 0, "host": 0, "storage": 44}
    assert second["choices"][0]["token_ids"] == offline(turn2, 4)  # type: ignore[index]
