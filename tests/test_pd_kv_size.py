"""P/D with a real model's KV size through a real mesh (issue 19, defect 1).

`tiny-smollm2-kv` holds SmolLM2-135M's 46,080 KV bytes a token (15 layers x 3 KV heads x 64 x
K,V in float64, what SmolLM2's 30 layers hold in float32), so a 4K-token prompt moves 184 MB
prefill -> decode. Before frames were sized in bytes, every prompt past ~180 tokens failed
(frames of 11.8 MB against NATS's 8 MiB) with a 504 after 48 s. Two meshes of `up --pd`:
pages of 16 tokens (frames of 11 pages), and pages of 256 tokens, whose 11.8 MB shard of one
page is over the server's limit and goes out in parts. Each serves a 4K-token prompt, then
a longer second turn that the decode engine partly holds: the output tokens equal a cold
in-process run with the cache off, and so do their float64 logprobs, bit for bit on the
first turn. On the second, prefill's own cache hit makes it compute the 300 new tokens in
other chunks than the cold run, which moves the last bits (the batch-invariant mode that
would keep them takes minutes for 4K tokens on a CPU): within 1e-12, where a page of KV out
of place moves them by far more. The second turn's `cached_tokens` is the decode engine's
reuse (defect 11).
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from bus_helpers import connect_as

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from services.cli import build_parser
from services.launch.servers import free_port
from services.launch.up import Mesh

pytestmark = pytest.mark.timeout(600)

MODEL = "tiny-smollm2-kv"
TOKEN_BYTES = 46_080  # SmolLM2-135M's KV bytes a token in float32
MAX_NEW = 6
_rng = random.Random(19)
TURN1 = [_rng.randrange(256) for _ in range(4000)]
TURN2 = [*TURN1, *(_rng.randrange(256) for _ in range(300))]


@pytest.fixture(scope="module", params=[16, 256], ids=lambda p: f"page{p}")
def page_size(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture(scope="module")
def mesh(page_size: int) -> Iterator[Mesh]:
    args = build_parser().parse_args(
        [
            "up",
            "--pd",
            "--model",
            MODEL,
            "--port",
            str(free_port()),
            "--page-size",
            str(page_size),
            "--max-total-tokens",
            "8192",
            "--heartbeat-interval",
            "0.5",
            "--disaggregation-decode-enable-radix-cache",
        ]
    )
    m = Mesh(args)
    m.start()
    yield m
    m.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        yield session


def cold(page_size: int, prompt: list[int]) -> tuple[list[int], list[float | None]]:
    """Greedy ids and their logprobs with the cache off, in this process."""
    engine = Engine(
        EngineConfig(
            model=MODEL,
            cache=CacheConfig(
                page_size=page_size,
                num_device_pages=8192 // page_size,
                enable_radix_cache=False,
            ),
        )
    )
    try:
        req = engine.submit(
            prompt, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
        )
        (out,) = engine.run([req])
        return out.output_ids, [lp for lp, _ in req.logprobs]
    finally:
        engine.close()


async def complete(http: aiohttp.ClientSession, mesh: Mesh, prompt: list[int]) -> dict[str, Any]:
    url = f"http://{mesh.args.host}:{mesh.args.port}/v1/completions"
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": MAX_NEW,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
    }
    async with http.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return dict(await resp.json())


async def test_4k_prompts_of_smollm2_sized_kv_equal_the_cold_run(
    mesh: Mesh, page_size: int, http: aiohttp.ClientSession
) -> None:
    nc = await connect_as(mesh.supervisor.extra_status["nats_url"], mesh.creds.nats["router"])
    max_payload = nc.max_payload  # what the mesh's server announces (8 MiB)
    await nc.close()
    # pages of 256 tokens: one page's KV is over the server's limit, so it must go in parts
    assert (page_size * TOKEN_BYTES > max_payload) == (page_size == 256)
    for turn, prompt in enumerate((TURN1, TURN2)):
        body = await complete(http, mesh, prompt)
        want_ids, want_logprobs = cold(page_size, prompt)
        choice = body["choices"][0]
        assert choice["token_ids"] == want_ids, f"turn {turn}"
        got = choice["logprobs"]["token_logprobs"]
        assert got[0] is None  # sampled by the prefill engine, which reports none
        if turn == 0:  # nothing cached anywhere: the very same float64 computation
            assert got[1:] == want_logprobs[1:], "logprobs differ from the cold run"
        else:  # prefill's cache hit computes the new tokens in other chunks than cold
            diff = max(abs(a - b) for a, b in zip(got[1:], want_logprobs[1:], strict=True))
            assert diff < 1e-12, f"turn 2: logprobs differ from the cold run by {diff:.3g}"
        usage = body["usage"]
        pd = usage["disaggregation"]
        assert pd["transferred_tokens"] == len(prompt) - pd["decode_prefix_len"]
        pages = -(-pd["transferred_tokens"] // page_size)
        assert pd["transferred_bytes"] == pages * page_size * TOKEN_BYTES
        # turn 2 resends turn 1's prompt (not its answer): decode holds its whole pages
        want_reuse = 0 if turn == 0 else len(TURN1) // page_size * page_size
        assert pd["decode_prefix_len"] == want_reuse
        # what the response counts as cached is the decode engine's reuse (defect 11)
        details = usage["prompt_tokens_details"]
        assert details["cached_tokens"] == want_reuse
        assert sum(details["cached_tokens_by_tier"].values()) == want_reuse
        if turn == 1:  # prefill's own cache held turn 1's prompt
            assert pd["prefill_cached_device"] == len(TURN1) // page_size * page_size
