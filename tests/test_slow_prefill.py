"""A forward slower than the router's `--request-timeout`, through a real mesh (issue 19).

Every decoder layer of every forward sleeps (`--debug-layer-delay-ms`, on every engine), so
one prefill step takes longer than the router's timeout, and so does each decode step after
it. The engine shows its progress on the request (`bus_schemas.Progress`): the request is
answered 200 with the tokens of an engine without the delay, nothing counts as a bus error,
and the next request is served at once by the same engine (it was never marked failed).
Under P/D the decode engine's KV watchdog (0.8 x the timeout) waits for the slow prefill
engine too, and so does the router, which watches it. A forward that does not come back (a
layer that sleeps for minutes: a hung step loop, whose heartbeats go on) shows no progress
and is still timed out.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from services.cli import build_parser
from services.launch.servers import free_port
from services.launch.up import Mesh

PAGE = 4
TIMEOUT_S = 3.0
# tiny has 4 layers: a forward (a prefill step, a decode step) takes 4 s > TIMEOUT_S
LAYER_DELAY_MS = 1000
PROMPT = list(range(40, 80))


@contextlib.contextmanager
def running(*flags: str, layer_delay_ms: int = LAYER_DELAY_MS) -> Iterator[Mesh]:
    args = build_parser().parse_args(
        [
            "up",
            "--model",
            "tiny",
            *flags,
            "--port",
            str(free_port()),
            "--page-size",
            str(PAGE),
            "--heartbeat-interval",
            "0.2",
            "--request-timeout",
            str(TIMEOUT_S),
            "--debug-layer-delay-ms",
            str(layer_delay_ms),
        ]
    )
    mesh = Mesh(args)
    try:
        mesh.start()
        yield mesh
    finally:
        mesh.stop()


@pytest.fixture(params=["colocated", "pd"])
def mesh(request: pytest.FixtureRequest) -> Iterator[Mesh]:
    with running(*(["--pd"] if request.param == "pd" else [])) as mesh:
        yield mesh


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


def reference(prompt: list[int], max_new: int) -> list[int]:
    engine = Engine(EngineConfig(model="tiny", cache=CacheConfig(page_size=PAGE)))
    sampling = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    return engine.generate(prompt, sampling).output_ids


async def complete(
    http: aiohttp.ClientSession, mesh: Mesh, prompt: list[int], max_tokens: int
) -> tuple[int, list[int], dict[str, str], str]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with http.post(f"{_base(mesh)}/v1/completions", json=body) as resp:
        text = await resp.text()
        tokens = (await resp.json())["choices"][0]["token_ids"] if resp.status == 200 else []
        return resp.status, tokens, dict(resp.headers), text


async def bus_errors(http: aiohttp.ClientSession, mesh: Mesh) -> dict[str, float]:
    async with http.get(f"{_base(mesh)}/metrics") as resp:
        text = await resp.text()
    name = "hicache_router_bus_errors_total{"
    return {
        line.split('"')[1]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name) and float(line.split()[-1])
    }


def _base(mesh: Mesh) -> str:
    return f"http://{mesh.args.host}:{mesh.args.port}"


async def test_a_prefill_slower_than_the_timeout_is_served_by_its_engine(
    mesh: Mesh, http: aiohttp.ClientSession
) -> None:
    router = mesh.supervisor.children["router"].spec.argv
    assert router[router.index("--request-timeout") + 1] == str(TIMEOUT_S)  # `up` passed it on
    pd = mesh.args.pd
    served_by = ("decode-0", "prefill-0") if pd else ("engine-0", None)
    status, tokens, headers, text = await complete(http, mesh, PROMPT, 2)
    assert status == 200, text
    assert tokens == reference(PROMPT, 2)
    assert (headers["X-Hicache-Engine"], headers.get("X-Hicache-Prefill-Engine")) == served_by
    # the engine was never marked failed: the next request goes to it, at once
    status, tokens, headers, text = await complete(http, mesh, PROMPT[:20], 1)
    assert status == 200, text
    assert tokens == reference(PROMPT[:20], 1)
    assert (headers["X-Hicache-Engine"], headers.get("X-Hicache-Prefill-Engine")) == served_by
    assert await bus_errors(http, mesh) == {}


async def test_a_forward_that_hangs_is_still_timed_out(http: aiohttp.ClientSession) -> None:
    with running(layer_delay_ms=600_000) as mesh:  # the first layer sleeps for 10 minutes
        status, _, _, text = await complete(http, mesh, PROMPT, 2)
        assert status == 504 and "nor any progress" in text, text
        assert await bus_errors(http, mesh) == {"timeout": 1}

        async def ready() -> list[str]:
            async with http.get(f"{_base(mesh)}/health") as resp:
                return list((await resp.json()).get("ready_engines", []))

        for _ in range(100):  # its heartbeats went on all along: back in routing
            if await ready() == ["engine-0"]:
                break
            await asyncio.sleep(0.1)
        assert await ready() == ["engine-0"]


def test_up_passes_on_the_router_timeouts_it_is_given() -> None:
    def router_argv(*flags: str) -> list[str]:
        mesh = Mesh(build_parser().parse_args(["up", "--model", "tiny", *flags]))
        try:
            return mesh.router_argv("nats://n", "redis://r")
        finally:
            mesh.workdir.cleanup()

    given = ["--request-timeout", "120.0", "--pd-admit-timeout", "60.0"]
    given += ["--pd-transfer-timeout", "90.0", "--read-timeout", "5.0"]
    argv = router_argv(*given)
    assert " ".join(given) in " ".join(argv)
    assert not {"--request-timeout", "--pd-admit-timeout"} & set(router_argv())  # its defaults
    with pytest.raises(SystemExit):
        router_argv("--request-timeout", "0")
    with pytest.raises(ValueError, match="heartbeat"):  # progress comes once per heartbeat
        router_argv("--request-timeout", "2", "--heartbeat-interval", "1")
