"""Two engines share one store through the mesh (issue 9, acceptance 5), and L3 through HTTP.

`hicache-mesh up --engines 2` with one `file` store directory for both. A prompt served by
one engine is written through to the store, and its storage pages reach Redis (the index,
from the engine's "storage" KV events). That engine is then frozen (SIGSTOP): the router
routes around it, and the other engine, which never saw the prompt, serves it from the
store: usage reports the storage tier through HTTP, and the output equals the first one.
A forged object in that store (issue 20, finding 6) is quarantined through the mesh, not served.
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
import redis.asyncio as aioredis
from fault_helpers import PAGE, MeshSpec, UpMesh, running_mesh
from test_storage_auth import forge

from bus_schemas import redis_keys
from gpu_worker.storage.file_format import HEADER
from gpu_worker.storage.file_quarantine import QUARANTINE_DIR

pytestmark = pytest.mark.timeout(300)

PROMPT = [(i * 29 + 3) % 250 for i in range(41)]  # 10 whole pages before the last token


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, store: Path) -> Iterator[UpMesh]:
    extra = ("--hicache-storage-backend", "file", "--hicache-storage-dir", str(store))
    extra += ("--hicache-storage-prefetch-policy", "wait_complete")
    with running_mesh(MeshSpec(engines=2, extra=extra), tmp_path_factory, "l3mesh") as m:
        try:
            yield m
        finally:
            for child in m.children():  # a frozen engine would ignore Ctrl-C
                os.kill(child.pid, signal.SIGCONT)


async def complete(
    http: aiohttp.ClientSession, mesh: UpMesh, prompt: list[int] = PROMPT
) -> tuple[str, dict[str, object]]:
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    async with http.post(f"{mesh.url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["X-Hicache-Engine"], await resp.json()


async def test_an_engine_serves_what_another_one_stored(mesh: UpMesh) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        first_engine, first = await complete(http, mesh)
        r = aioredis.Redis.from_url(mesh.redis_url(), decode_responses=True)
        try:
            deadline = time.monotonic() + 30
            stored: list[str] = []
            while len(stored) < 10 and time.monotonic() < deadline:
                stored = [k async for k in r.scan_iter(match=redis_keys.STORE_PREFIX + "*")]
                await asyncio.sleep(0.1)
            # the prompt's 10 whole pages and the outputs' (one store: both engines share it)
            assert len(stored) >= 10, "the prompt's pages never reached the index as stored"
            assert len({k.split(":")[2] for k in stored}) == 1
            written = 0.0
            while written == 0 and time.monotonic() < deadline:  # the next heartbeat has it
                async with http.get(f"{mesh.url}/metrics") as resp:
                    text = await resp.text()
                for line in text.splitlines():
                    if line.startswith("hicache_engine_storage_written_pages") and (
                        f'engine_id="{first_engine}"' in line
                    ):
                        written = float(line.rsplit(" ", 1)[1])
                await asyncio.sleep(0.1)
            assert written >= 10
        finally:
            await r.aclose()
        pid = mesh.signal(first_engine, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 30
            while True:  # the router routes around the frozen engine
                async with http.get(f"{mesh.url}/health") as resp:
                    live = (await resp.json())["live_engines"]
                if first_engine not in live:
                    break
                assert time.monotonic() < deadline, "the frozen engine stayed live"
                await asyncio.sleep(0.2)
            second_engine, second = await complete(http, mesh)
        finally:
            os.kill(pid, signal.SIGCONT)
    assert second_engine != first_engine
    tiers = second["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]  # type: ignore[index]
    assert tiers == {"device": 0, "host": 0, "storage": (len(PROMPT) - 1) // PAGE * PAGE}
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]  # type: ignore[index]


def objects(store: Path) -> set[Path]:
    """The store's objects (a write renames its finished file into place: never partial)."""
    return {p for p in store.glob("??/*") if p.is_file() and ".tmp" not in p.name}


async def test_a_forged_object_in_the_store_is_quarantined_not_served(
    mesh: UpMesh, store: Path
) -> None:
    """Someone who can write the store directory but lacks its MAC key (issue 20, finding 6)
    swaps each object a prompt wrote for another page's KV, with the payload digest made to
    fit. After every cache is flushed the prompt is served as a cold one: nothing from
    storage, the same tokens, and the forged object set aside in the quarantine."""
    prompt = [(i * 31 + 7) % 250 for i in range(41)]
    before = objects(store)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        _, first = await complete(http, mesh, prompt)
        deadline = time.monotonic() + 30
        while len(objects(store) - before) < 10 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        written = sorted(objects(store) - before)
        assert len(written) >= 10, "the prompt's pages never reached the store"
        payloads = []
        for path in written:
            raw = path.read_bytes()
            payloads.append(raw[len(raw) - HEADER.unpack_from(raw)[3] :])
        for path, other in zip(written, payloads[1:] + payloads[:1], strict=True):
            forge(path, other)
        async with http.post(f"{mesh.url}/flush_cache") as resp:
            assert resp.status == 200, await resp.text()
        _, second = await complete(http, mesh, prompt)
    tiers = second["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]  # type: ignore[index]
    assert tiers == {"device": 0, "host": 0, "storage": 0}
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]  # type: ignore[index]
    held = [p.name for p in (store / QUARANTINE_DIR).iterdir()]
    assert any(name.endswith(".unauthenticated") for name in held), held


@pytest.fixture(scope="module")
def pd_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpMesh]:
    store = tmp_path_factory.mktemp("pdstore")
    extra = ("--hicache-storage-backend", "file", "--hicache-storage-dir", str(store))
    extra += ("--hicache-storage-prefetch-policy", "wait_complete")
    with running_mesh(MeshSpec(pd=True, extra=extra), tmp_path_factory, "l3pd") as m:
        yield m


async def test_pd_usage_reports_what_prefill_read_from_storage(pd_mesh: UpMesh) -> None:
    """Prefill writes the prompt through to the store; after every cache is flushed, the
    prefill engine reads it back, and the P/D block says so (usage's own cached tokens are
    the decode engine's reuse: none after the flush)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        _, first = await complete(http, pd_mesh)
        r = aioredis.Redis.from_url(pd_mesh.redis_url(), decode_responses=True)
        try:
            deadline, stored = time.monotonic() + 30, 0
            while stored < 10 and time.monotonic() < deadline:
                stored = len([k async for k in r.scan_iter(match=redis_keys.STORE_PREFIX + "*")])
                await asyncio.sleep(0.1)
            assert stored >= 10, "the prompt's pages never reached the store"
        finally:
            await r.aclose()
        async with http.post(f"{pd_mesh.url}/flush_cache") as resp:
            assert resp.status == 200, await resp.text()
        _, second = await complete(http, pd_mesh)
    want = (len(PROMPT) - 1) // PAGE * PAGE
    usage = second["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens_by_tier"] == {  # type: ignore[index]
        "device": 0,
        "host": 0,
        "storage": 0,
    }
    assert usage["disaggregation"]["prefill_cached_storage"] == want  # type: ignore[index]
    assert usage["disaggregation"]["decode_prefix_len"] == 0  # type: ignore[index]
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]  # type: ignore[index]
