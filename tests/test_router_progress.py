"""The router waits for a busy engine and gives up on a hung one (issue 19).

Scripted engines (tests/fake_engine.py) take longer than the router's timeout before their
first chunk (or their prefill frame, or their answer to a P/D admission). One that shows its
progress on the request (`bus_schemas.Progress`) is waited for and serves the request,
and stays in routing; one that heartbeats but shows none is timed out as before, and sits
out (`EngineTable.mark_failed`).
"""

from __future__ import annotations

from fake_engine import FakeDecode, FakePrefill, Mesh, expected_tokens, running_mesh

from router.keys import TABLE
from services.launch.servers import ServerProcess

PROMPT = "a prompt the engine is slow on"
BUSY_S = 1.5  # each engine's delay: three times the router's timeout
TIMEOUT_S = 0.5


async def errors(mesh: Mesh) -> dict[str, float]:
    """hicache_router_bus_errors_total by kind, those counted."""
    text = await (await mesh.client.get("/metrics")).text()
    name = "hicache_router_bus_errors_total{"
    return {
        line.split('"')[1]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name) and float(line.split()[-1])
    }


async def complete(mesh: Mesh) -> tuple[int, dict[str, object]]:
    body = {"prompt": PROMPT, "max_tokens": 2}
    r = await mesh.client.post("/v1/completions", json=body)
    return r.status, await r.json()


def tokens() -> list[int]:
    return expected_tokens(list(PROMPT.encode()), 2)


async def test_a_busy_engine_is_waited_for_and_a_hung_one_is_not(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    async with running_mesh(
        nats_server.url, redis_server.url, 1, request_timeout_s=TIMEOUT_S
    ) as mesh:
        (engine,) = mesh.engines
        engine.token_delay_s, engine.progress_every_s = BUSY_S, 0.1
        status, data = await complete(mesh)
        assert status == 200, data
        assert data["choices"][0]["token_ids"] == tokens()  # type: ignore[index]
        assert await errors(mesh) == {}
        assert mesh.client.app[TABLE].is_alive(engine.engine_id)
        engine.progress_every_s = 0  # heartbeats, works on nothing: hung
        status, data = await complete(mesh)
        assert status == 504 and "nor any progress" in str(data), data
        assert await errors(mesh) == {"timeout": 1}
        assert not mesh.client.app[TABLE].is_alive(engine.engine_id)  # sits out


async def test_pd_waits_for_a_busy_prefill_engine(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    async with running_mesh(
        nats_server.url,
        redis_server.url,
        roles=["prefill", "decode"],
        request_timeout_s=TIMEOUT_S,
        pd_transfer_timeout_s=30.0,  # the fake decode engine's own wait is not under test
    ) as mesh:
        (prefill,) = mesh.prefills
        prefill.prefill_delay_s, prefill.progress_every_s = BUSY_S, 0.1
        status, data = await complete(mesh)
        assert status == 200, data
        assert data["choices"][0]["token_ids"] == tokens()  # type: ignore[index]
        assert await errors(mesh) == {}
        prefill.progress_every_s = 0
        status, data = await complete(mesh)
        assert status == 504 and "nor any progress" in str(data), data


async def test_pd_admission_waits_for_a_busy_decode_engine(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    async with running_mesh(
        nats_server.url,
        redis_server.url,
        roles=["prefill", "decode"],
        pd_admit_timeout_s=TIMEOUT_S,
    ) as mesh:
        (decode,) = mesh.decodes
        assert isinstance(decode, FakeDecode) and isinstance(mesh.prefills[0], FakePrefill)
        decode.admit_delay_s, decode.progress_every_s = BUSY_S, 0.1
        status, data = await complete(mesh)
        assert status == 200, data
        assert data["choices"][0]["token_ids"] == tokens()  # type: ignore[index]
        assert await errors(mesh) == {}
        assert len({a.request_id for a in decode.admits}) == 1  # asked again, admitted once
        decode.progress_every_s = 0
        status, data = await complete(mesh)
        assert status == 504 and "did not answer" in str(data), data
