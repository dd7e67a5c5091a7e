"""`sglang:gen_throughput` and the output tokens each engine streamed (issue 19, defect 11).

A real mesh (`up --model tiny`): while a long completion streams, the engine's heartbeats
carry its output tokens per second over the last interval, which the router exports as
SGLang's per-engine `sglang:gen_throughput` gauge; `hicache_engine_generation_tokens_total`
counts every token it streamed. Rates are wall-clock figures: the test asserts only that one
is reported and positive while tokens flow, never a value.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import aiohttp
import pytest

from services.cli import build_parser
from services.launch.servers import free_port
from services.launch.up import Mesh

pytestmark = pytest.mark.timeout(300)

MAX_NEW = 600


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    args = build_parser().parse_args(
        [
            "up",
            "--model",
            "tiny",
            "--port",
            str(free_port()),
            "--page-size",
            "16",
            "--max-total-tokens",
            "2048",
            "--heartbeat-interval",
            # 3 missed intervals mark an engine lost and fail its stream: 0.2 s (0.6 s of
            # slack) lost a stream to a scheduling stall on a loaded 2-core CI machine
            "0.5",
        ]
    )
    m = Mesh(args)
    m.start()
    yield m
    m.stop()


def sample(text: str, name: str, engine_id: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and f'engine_id="{engine_id}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


async def test_engines_report_their_generation_throughput(mesh: Mesh) -> None:
    base = f"http://{mesh.args.host}:{mesh.args.port}"
    body = {"prompt": "hello", "max_tokens": MAX_NEW, "ignore_eos": True, "stream": True}
    rates: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:

        async def watch(until: asyncio.Event) -> None:
            while not until.is_set():
                async with http.get(f"{base}/metrics") as resp:
                    rate = sample(await resp.text(), "sglang:gen_throughput", "engine-0")
                if rate is not None:
                    rates.append(rate)
                await asyncio.sleep(0.05)

        done = asyncio.Event()
        watcher = asyncio.create_task(watch(done))
        async with http.post(f"{base}/v1/completions", json=body) as resp:
            assert resp.status == 200
            engine = resp.headers["X-Hicache-Engine"]
            events = (await resp.read()).decode().split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""], events[-3:]  # not cut short by an error
        await asyncio.sleep(1.0)  # the heartbeat after the last tokens reports them too
        done.set()
        await watcher
        assert engine == "engine-0"
        assert rates and max(rates) > 0.0, rates
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            async with http.get(f"{base}/metrics") as resp:
                text = await resp.text()
            total = sample(text, "hicache_engine_generation_tokens_total", engine)
            if total == MAX_NEW:
                break
            await asyncio.sleep(0.1)
        assert total == MAX_NEW
        assert sample(text, "sglang:gen_throughput", engine) == 0.0  # idle again
