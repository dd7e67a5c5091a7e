"""P/D through the whole mesh (`hicache-mesh up --pd`): router, prefill and decode engines,
index, real nats-server and redis-server, real HTTP.

Turn after turn, greedy outputs equal the cold run with decode reuse on and off; each
request moves exactly prompt_len - decode_prefix_len tokens; decode's host tier feeds
decode_prefix_len; a restore that fails is retried without reuse, not answered with a 500.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from services.cli import build_parser
from services.launch.servers import free_port
from services.launch.up import Mesh

PAGE = 4
MAX_NEW = 4


def start_mesh(*flags: str) -> Mesh:
    args = build_parser().parse_args(
        [
            "up",
            "--pd",
            "--port",
            str(free_port()),
            "--model",
            "tiny",
            "--page-size",
            str(PAGE),
            "--heartbeat-interval",
            "0.2",
            "--enable-hierarchical-cache",
            *flags,
        ]
    )
    mesh = Mesh(args)
    mesh.start()
    return mesh


@pytest.fixture(scope="module")
def reuse_mesh() -> Iterator[Mesh]:
    # decode's device pool holds ~2 turns, so older history spills to its host tier; its first
    # host load fails (test hook), which the router must retry without reuse
    mesh = start_mesh(
        "--disaggregation-decode-enable-radix-cache",
        "--max-total-tokens",
        "4096",
        "--decode-max-total-tokens",
        "128",
        "--hicache-ratio",
        "16",
        "--debug-fail-loads",
        "1",
    )
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def baseline_mesh() -> Iterator[Mesh]:
    mesh = start_mesh("--max-total-tokens", "4096")
    yield mesh
    mesh.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


def conversation(turns: int = 5, seed: int = 11) -> list[list[int]]:
    """Each turn resends the history plus a new question (answers are not appended, so the
    prompts are known up front)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(256) for _ in range(30)]
    out = []
    for _ in range(turns):
        prompt = prompt + [rng.randrange(256) for _ in range(9)]
        out.append(prompt)
    return out


def cold(prompts: list[list[int]]) -> list[list[int]]:
    eng = Engine(EngineConfig(cache=CacheConfig(page_size=PAGE, enable_radix_cache=False)))
    sp = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    return [eng.generate(p, sp).output_ids for p in prompts]


async def complete(
    http: aiohttp.ClientSession, mesh: Mesh, prompt: list[int], stream: bool = False
) -> tuple[list[int], dict[str, Any]]:
    url = f"http://{mesh.args.host}:{mesh.args.port}/v1/completions"
    body = {
        "prompt": prompt,
        "max_tokens": MAX_NEW,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with http.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        if not stream:
            data = await resp.json()
            return data["choices"][0]["token_ids"], data["usage"]
        from fake_engine import read_sse

        events, done = await read_sse(resp)
    assert done
    tokens = [t for e in events for c in e.get("choices", []) for t in c.get("token_ids", [])]
    return tokens, events[-1]["usage"]


async def metric(http: aiohttp.ClientSession, mesh: Mesh, name: str) -> float:
    async with http.get(f"http://{mesh.args.host}:{mesh.args.port}/metrics") as resp:
        text = await resp.text()
    values = [
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith(f"{name}_created")
    ]
    return sum(values)


async def run_turns(http: aiohttp.ClientSession, mesh: Mesh) -> list[dict[str, Any]]:
    """Three conversations, turns interleaved: each one's history leaves decode's device pool
    while the others run, and comes back from its host tier."""
    convs = [conversation(seed=s) for s in (11, 12, 13)]
    prompts = [c[t] for t in range(len(convs[0])) for c in convs]
    want = cold(prompts)
    pd = []
    for i, prompt in enumerate(prompts):
        tokens, usage = await complete(http, mesh, prompt, stream=bool(i % 2))
        assert tokens == want[i], f"turn {i}"
        d = usage["disaggregation"]
        assert d["transferred_tokens"] == len(prompt) - d["decode_prefix_len"]
        assert d["decode_prefix_len"] % PAGE == 0
        pd.append(d)
    return pd


async def test_decode_reuse_moves_only_the_missing_suffix(
    reuse_mesh: Mesh, http: aiohttp.ClientSession
) -> None:
    pd = await run_turns(http, reuse_mesh)
    assert [d["decode_prefix_len"] for d in pd[:3]] == [0, 0, 0]  # first turns
    assert sum(d["decode_prefix_len"] > 0 for d in pd[3:]) >= len(pd[3:]) - 1  # one retried
    assert sum(d["decode_cached_host"] for d in pd) > 0, "decode's host tier was never used"
    # the first host load failed: exactly one request was retried with reuse off
    assert await metric(http, reuse_mesh, "hicache_router_pd_restore_retries") == 1


async def test_without_decode_reuse_every_turn_moves_everything(
    baseline_mesh: Mesh, http: aiohttp.ClientSession
) -> None:
    pd = await run_turns(http, baseline_mesh)
    assert [d["decode_prefix_len"] for d in pd] == [0] * len(pd)
    assert pd[-1]["prefill_cached_device"] > 0  # prefill still reuses its own cache
