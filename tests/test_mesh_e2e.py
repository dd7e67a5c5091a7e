"""The whole mesh as processes, started the way `hicache-mesh up` starts it.

Real nats-server and redis-server on free ports, the index, two engine services and the
router; requests over real HTTP. Tests in this module share one mesh and run in file order;
the destructive ones (Redis stopped, an engine killed) come last.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from bus_helpers import redis_url_as, spawn_engine
from fake_engine import read_sse

from bus_schemas import make_namespace, page_hashes
from bus_schemas import redis_keys as rk
from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.model.weights import weights_digest
from services.cli import build_parser
from services.launch.servers import free_port
from services.launch.up import Mesh

PAGE = 4
NAMESPACE = make_namespace("tiny", "float64", PAGE, weights_digest("tiny", 0))


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    args = build_parser().parse_args(
        [
            "up",
            "--port",
            str(free_port()),
            "--model",
            "tiny",
            "--engines",
            "2",
            "--page-size",
            str(PAGE),
            "--max-total-tokens",
            "4096",
            "--enable-hierarchical-cache",
            "--heartbeat-interval",
            "0.2",
            "--startup-timeout",
            "120",
        ]
    )
    m = Mesh(args)
    m.start()
    yield m
    m.stop()
    for name, child in m.supervisor.children.items():
        assert child.proc is None or child.proc.poll() is not None, f"{name} left running"


def url(mesh: Mesh) -> str:
    return f"http://{mesh.args.host}:{mesh.args.port}"


def redis_url(mesh: Mesh) -> str:
    """The mesh's Redis as the index's user (it reads and writes the index keys)."""
    return redis_url_as(str(mesh.supervisor.extra_status["redis_url"]), mesh.creds.redis["index"])


def proc_of(mesh: Mesh, name: str) -> subprocess.Popen[bytes]:
    """The running process of child `name` (this test drives no supervisor poll: nothing is
    restarted behind its back)."""
    proc = mesh.supervisor.children[name].proc
    assert proc is not None
    return proc


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


def reference(prompt: list[int], max_new: int) -> list[int]:
    eng = Engine(EngineConfig(cache=CacheConfig(page_size=PAGE, enable_radix_cache=False)))
    return eng.generate(prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True)).output_ids


async def complete(
    http: aiohttp.ClientSession, mesh: Mesh, prompt: list[int], max_tokens: int, **extra: Any
) -> tuple[dict[str, Any], str]:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    async with http.post(f"{url(mesh)}/v1/completions", json=body) as resp:
        data = await resp.json()
        assert resp.status == 200, data
        return data, resp.headers["X-Hicache-Engine"]


def cached(data: dict[str, Any]) -> tuple[int, int, int]:
    d = data["usage"]["prompt_tokens_details"]
    return (
        d["cached_tokens"],
        d["cached_tokens_by_tier"]["device"],
        d["cached_tokens_by_tier"]["host"],
    )


async def wait_for(predicate: Any, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout_s}s")


async def holders(mesh: Mesh, prompt: list[int], salt: str = "") -> dict[str, int]:
    """Engine -> leading pages of `prompt` the index says it holds (the router's own query)."""
    r = aioredis.from_url(redis_url(mesh))
    try:
        argv = rk.lookup_argv(page_hashes(prompt, PAGE, NAMESPACE, salt))
        flat = await r.eval(rk.PREFIX_LOOKUP_LUA, 0, *argv)
    finally:
        await r.aclose()
    return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 3)}


async def test_completions_equal_the_engine_and_report_cached_tokens(
    mesh: Mesh, http: aiohttp.ClientSession
) -> None:
    prompt = list(range(20, 63))  # 43 tokens
    want = reference(prompt, 6)
    first, _ = await complete(http, mesh, prompt, 6)
    assert first["choices"][0]["token_ids"] == want
    assert cached(first)[0] == 0
    second, _ = await complete(http, mesh, prompt, 6)
    assert second["choices"][0]["token_ids"] == want
    assert cached(second) == (40, 40, 0)  # (43 - 1) // 4 * 4, from the device

    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    async with http.post(f"{url(mesh)}/v1/completions", json=body) as resp:
        assert resp.status == 200
        events, done = await read_sse(resp)
    assert done
    streamed = [t for e in events for c in e.get("choices", []) for t in c.get("token_ids", [])]
    assert streamed == want
    assert cached(events[-1])[0] == 40


async def test_requests_go_to_the_engine_holding_their_prefix(
    mesh: Mesh, http: aiohttp.ClientSession
) -> None:
    for k in range(4):
        prompt = [(7 * k + i) % 256 for i in range(60)]
        _, owner = await complete(http, mesh, prompt, 2)
        await wait_for(lambda p=prompt, o=owner: _holds(mesh, p, o))
        longer = [*prompt, 1, 2, 3, 4, 5, 6, 7, 8]
        data, chosen = await complete(http, mesh, longer, 2)
        assert chosen == owner
        assert cached(data)[0] >= 56  # at least the prompt's whole pages


async def _holds(mesh: Mesh, prompt: list[int], engine: str) -> bool:
    return (await holders(mesh, prompt)).get(engine, 0) >= len(prompt) // PAGE - 1


async def test_cache_salts_never_share_tokens(mesh: Mesh, http: aiohttp.ClientSession) -> None:
    prompt = list(range(150, 190))
    a1, _ = await complete(http, mesh, prompt, 3, cache_salt="tenant-a")
    b1, _ = await complete(http, mesh, prompt, 3, cache_salt="tenant-b")
    a2, _ = await complete(http, mesh, prompt, 3, cache_salt="tenant-a")
    u1, _ = await complete(http, mesh, prompt, 3, user="someone")
    assert cached(a1)[0] == 0 and cached(b1)[0] == 0 and cached(u1)[0] == 0
    assert cached(a2)[0] == 36
    assert a1["choices"][0]["token_ids"] == b1["choices"][0]["token_ids"]


async def test_openai_user_is_the_cache_salt(mesh: Mesh, http: aiohttp.ClientSession) -> None:
    """OpenAI's `user` isolates the cache when no cache_salt is given: another user (or no
    user) never gets a user's cached tokens; the same user does."""
    prompt = list(range(60, 100))  # 40 tokens, in no other test
    want = reference(prompt, 3)
    plain, _ = await complete(http, mesh, prompt, 3)
    await wait_for(lambda: _held_anywhere(mesh, prompt, ""))  # routable to, if user were ignored
    alice, _ = await complete(http, mesh, prompt, 3, user="alice")
    assert cached(alice)[0] == 0, "a user got the cached tokens of a request without one"
    await wait_for(lambda: _held_anywhere(mesh, prompt, "alice"))
    bob, _ = await complete(http, mesh, prompt, 3, user="bob")
    assert cached(bob)[0] == 0, "a user got another user's cached tokens"
    alice_again, _ = await complete(http, mesh, prompt, 3, user="alice")
    assert cached(alice_again) == (36, 36, 0)  # (40 - 1) // 4 * 4, her own
    assert all(d["choices"][0]["token_ids"] == want for d in (plain, alice, bob, alice_again))


async def _held_anywhere(mesh: Mesh, prompt: list[int], salt: str) -> bool:
    held = await holders(mesh, prompt, salt)
    return max(held.values(), default=0) >= len(prompt) // PAGE - 1


async def test_bad_requests_change_nothing(mesh: Mesh, http: aiohttp.ClientSession) -> None:
    bad: list[Any] = [
        b"{not json",
        {"prompt": ""},
        {"prompt": [1, 999]},
        {"prompt": [1], "n": 17},
        {"prompt": [1], "max_tokens": -1},
        {"prompt": list(range(200)) * 60},
        {"prompt": [1], "temperature": "hot"},
    ]
    for body in bad:
        kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
        async with http.post(f"{url(mesh)}/v1/completions", **kwargs) as resp:
            assert 400 <= resp.status < 500
            err = (await resp.json())["error"]
            assert err["message"] and "type" in err
    await complete(http, mesh, [1, 2, 3], 2)


async def test_engine_restart_with_new_epoch_drops_its_entries(
    mesh: Mesh, http: aiohttp.ClientSession
) -> None:
    prompt = [(3 * i + 11) % 256 for i in range(48)]
    _, owner = await complete(http, mesh, prompt, 2)
    await wait_for(lambda: _holds(mesh, prompt, owner))
    old = proc_of(mesh, owner)
    old.send_signal(signal.SIGKILL)  # no goodbye: only the new epoch can fence it
    old.wait()
    nats_url = str(mesh.supervisor.extra_status["nats_url"])
    creds = mesh.creds.nats_file(mesh.creds_dir, f"engine.{owner}")
    new = spawn_engine(
        nats_url,
        owner,
        "--nats-credentials",
        str(creds),
        "--model",
        "tiny",
        "--heartbeat-interval",
        "0.2",
        "--page-size",
        str(PAGE),
        "--max-total-tokens",
        "4096",
        "--enable-hierarchical-cache",
    )
    mesh.supervisor.children[owner].proc = new  # stopped with the mesh

    r = aioredis.from_url(redis_url(mesh))
    old_epoch = await r.hget(rk.engine_meta(owner), "epoch")

    async def back_with_new_epoch() -> bool:
        alive = await r.get(rk.engine_alive(owner))
        return alive is not None and alive != old_epoch

    await wait_for(back_with_new_epoch, timeout_s=60)
    await r.aclose()
    assert owner not in await holders(mesh, prompt)  # nothing stale survives the restart
    async with http.get(f"{url(mesh)}/health") as resp:
        assert resp.status == 200


async def test_redis_down_keeps_serving(mesh: Mesh, http: aiohttp.ClientSession) -> None:
    redis_server = proc_of(mesh, "redis")
    redis_server.kill()
    redis_server.wait()
    prompts = [[(i * j) % 256 for i in range(30)] for j in range(1, 5)]
    for p in prompts:
        data, _ = await complete(http, mesh, p, 2)
        assert len(data["choices"][0]["token_ids"]) == 2
    async with http.get(f"{url(mesh)}/metrics") as resp:
        text = await resp.text()
    errors = [line for line in text.splitlines() if line.startswith("hicache_router_store_errors")]
    assert errors and any(float(line.split()[-1]) > 0 for line in errors), errors


async def test_engine_killed_mid_stream_fails_fast_and_is_avoided(
    mesh: Mesh, http: aiohttp.ClientSession
) -> None:
    body = {
        "prompt": list(range(10, 30)),
        "max_tokens": 2000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.monotonic()
    async with http.post(f"{url(mesh)}/v1/completions", json=body) as resp:
        assert resp.status == 200
        victim = resp.headers["X-Hicache-Engine"]
        await resp.content.readline()  # the first event is flowing
        os.kill(proc_of(mesh, victim).pid, signal.SIGKILL)
        raw = (await resp.read()).decode()
    assert time.monotonic() - started < 20
    assert '"error"' in raw and raw.rstrip().endswith("data: [DONE]")
    for _ in range(3):
        _, chosen = await complete(http, mesh, [5, 6, 7, 8, 9], 2)
        assert chosen != victim
