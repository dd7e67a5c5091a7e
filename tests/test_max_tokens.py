"""How long a request may generate when it names no limit (issue 19, defect 6).

A chat request without `max_tokens` used to stop at 16 tokens ("length"), and an overflow
error said "plus max_tokens (16)" to a client that sent none. Now, as OpenAI and vLLM:
completions and chat without `max_tokens` generate up to what the context leaves after the
prompt (in a bucket with `max_len`, what that leaves), capped by the router's
`--default-max-tokens` when set; `max_tokens: 0` is a 400. `/generate` keeps SGLang's default
`max_new_tokens` of 128 (cut to the context) and its `max_new_tokens: 0`. An engine's context
length is bounded by its device pool (a request reserves pages for every token it may write).
The router runs against fake engines of context length 256 here.
"""

from __future__ import annotations

from typing import Any

import pytest
from fake_engine import FakeEngine, Mesh, running_mesh

from router.buckets import Bucket
from services.launch.servers import ServerProcess

pytestmark = pytest.mark.timeout(120)

CONTEXT_LEN = 256  # the fake engines'
CHAT = [{"role": "user", "content": "hi"}]


async def _post(mesh: Mesh, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    resp = await mesh.client.post(path, json=body)
    return resp.status, await resp.json()


def _sent(engine: FakeEngine) -> int:
    """The max_new_tokens of the last request `engine` received."""
    return engine.received[-1].sampling.max_new_tokens


async def test_no_max_tokens_means_up_to_the_context(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    async with running_mesh(nats_server.url, redis_server.url, 1) as mesh:
        engine = mesh.engines[0]
        status, body = await _post(mesh, "/v1/chat/completions", {"messages": CHAT})
        assert status == 200, body
        prompt_len = body["usage"]["prompt_tokens"]
        assert _sent(engine) == CONTEXT_LEN - prompt_len
        assert body["usage"]["completion_tokens"] == CONTEXT_LEN - prompt_len
        assert body["choices"][0]["finish_reason"] == "length"  # the fake never stops

        status, body = await _post(mesh, "/v1/completions", {"prompt": [1] * 200})
        assert status == 200, body
        assert _sent(engine) == CONTEXT_LEN - 200
        # a given max_tokens is sent as given
        status, _ = await _post(mesh, "/v1/completions", {"prompt": [1] * 200, "max_tokens": 3})
        assert status == 200 and _sent(engine) == 3

        # /generate: SGLang's default of 128 new tokens, cut to what the context leaves
        status, body = await _post(mesh, "/generate", {"input_ids": [1, 2, 3]})
        assert status == 200 and _sent(engine) == 128
        assert body["meta_info"]["completion_tokens"] == 128
        status, _ = await _post(mesh, "/generate", {"input_ids": [1] * 200})
        assert status == 200 and _sent(engine) == CONTEXT_LEN - 200
        # ... and SGLang's max_new_tokens 0: nothing generated, not an error
        zero = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 0}}
        status, body = await _post(mesh, "/generate", zero)
        assert status == 200 and body["output_ids"] == [], body


async def test_errors_name_only_what_the_client_sent(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    async with running_mesh(nats_server.url, redis_server.url, 1) as mesh:
        full = [1] * CONTEXT_LEN
        status, body = await _post(mesh, "/v1/completions", {"prompt": full})
        assert status == 400
        assert body["error"] == {
            "message": "the prompt (256 tokens) leaves no room for output in the context "
            "length 256",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": "context_length_exceeded",
        }
        long_chat = [{"role": "user", "content": "x" * 300}]
        status, body = await _post(mesh, "/v1/chat/completions", {"messages": long_chat})
        assert status == 400 and body["error"]["param"] == "messages", body
        assert "max_tokens" not in body["error"]["message"]
        status, body = await _post(mesh, "/generate", {"input_ids": full})
        assert status == 400 and "max_new_tokens" not in body["error"]["message"], body
        # a limit the client did send is named
        status, body = await _post(mesh, "/v1/completions", {"prompt": [1] * 250, "max_tokens": 7})
        assert status == 400
        assert body["error"]["message"] == (
            "the prompt (250 tokens) plus max_tokens (7) exceeds the context length 256"
        )
        generate = {"input_ids": [1] * 250, "sampling_params": {"max_new_tokens": 7}}
        status, body = await _post(mesh, "/generate", generate)
        assert status == 400 and body["error"]["param"] == "sampling_params.max_new_tokens"
        assert "plus max_new_tokens (7)" in body["error"]["message"]

        # max_tokens 0 is refused, as OpenAI refuses it
        for path, field, request in (
            ("/v1/completions", "max_tokens", {"prompt": "hi"}),
            ("/v1/chat/completions", "max_tokens", {"messages": CHAT}),
            ("/v1/chat/completions", "max_completion_tokens", {"messages": CHAT}),
        ):
            status, body = await _post(mesh, path, request | {field: 0})
            assert status == 400, (path, field, body)
            assert body["error"]["param"] == field
            assert body["error"]["message"] == f"'{field}' must be >= 1, got 0"
        assert mesh.engines[0].received == []  # nothing refused reached the engine


async def test_a_bucket_bounds_the_default(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    """In a bucket with max_len, a request without max_tokens ends within it."""
    buckets = (Bucket("default", 64), Bucket("long"))
    async with running_mesh(nats_server.url, redis_server.url, 1, buckets=buckets) as mesh:
        engine = mesh.engines[0]  # in bucket "default": max_len 64 (its context: 256)
        status, _ = await _post(mesh, "/v1/completions", {"prompt": [1] * 10})
        assert status == 200 and _sent(engine) == 64 - 10
        status, _ = await _post(mesh, "/v1/completions", {"prompt": [1] * 10, "max_tokens": 50})
        assert status == 200 and _sent(engine) == 50


async def test_the_router_may_cap_the_default(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    """--default-max-tokens caps the OpenAI endpoints' default, not a given max_tokens,
    nor /generate's (SGLang's 128)."""
    async with running_mesh(nats_server.url, redis_server.url, 1, default_max_tokens=100) as mesh:
        engine = mesh.engines[0]
        status, _ = await _post(mesh, "/v1/completions", {"prompt": [1] * 10})
        assert status == 200 and _sent(engine) == 100
        status, _ = await _post(mesh, "/v1/completions", {"prompt": [1] * 200})
        assert status == 200 and _sent(engine) == CONTEXT_LEN - 200
        status, _ = await _post(mesh, "/v1/completions", {"prompt": [1] * 10, "max_tokens": 150})
        assert status == 200 and _sent(engine) == 150
        status, _ = await _post(mesh, "/generate", {"input_ids": [1] * 10})
        assert status == 200 and _sent(engine) == 128


def test_an_engines_context_is_bounded_by_its_device_pool() -> None:
    """A request reserves pages for every token it may write: the longest one an engine can
    serve (its heartbeat's and model card's context length) is at most its pool."""
    import argparse

    from gpu_worker.engine.engine import Engine
    from services.engine.config import engine_config_from_args
    from services.engine.flags import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = ["--model", "tiny", "--page-size", "16", "--max-total-tokens", "1024"]
    engine = Engine(engine_config_from_args(parser.parse_args(flags)))
    try:
        assert engine.model_config.context_len == 8192
        assert engine.context_len == 1024
    finally:
        engine.close()
