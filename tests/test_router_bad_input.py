"""Bad requests get an exact 4xx status and an OpenAI-style error, and reach no engine.

Status rule (router/errors.py): 400 for anything wrong in the body, 404 for an unknown path
or model, 405 for a wrong method, 413 for a body over the size limit.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from fake_engine import Mesh, expected_tokens, running_mesh

from services.launch.servers import ServerProcess

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60)]

MAX_BODY = 64 * 1024
CONTEXT_LEN = 256
OK = {"prompt": "hi"}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}

# (name, method, path, body (bytes are sent raw), status, code, param)
CASES: list[tuple[str, str, str, Any, int, str, str | None]] = [
    ("malformed json", "POST", "/v1/completions", b'{"prompt": ', 400, "invalid_json", None),
    ("empty body", "POST", "/v1/completions", b"", 400, "invalid_json", None),
    ("body is a list", "POST", "/v1/completions", [1, 2], 400, "invalid_json", None),
    ("body is a string", "POST", "/v1/chat/completions", "hi", 400, "invalid_json", None),
    (
        "NaN literal",
        "POST",
        "/v1/completions",
        b'{"prompt":"hi","temperature":NaN}',
        400,
        "invalid_json",
        None,
    ),
    (
        "integer beyond 64 bits",
        "POST",
        "/v1/completions",
        b'{"prompt": "hi", "max_tokens": 18446744073709551616}',  # parsed as a float
        400,
        "invalid_type",
        "max_tokens",
    ),
    (
        "prompt missing",
        "POST",
        "/v1/completions",
        {"max_tokens": 3},
        400,
        "missing_required",
        "prompt",
    ),
    ("prompt empty string", "POST", "/v1/completions", {"prompt": ""}, 400, "empty", "prompt"),
    ("prompt empty list", "POST", "/v1/completions", {"prompt": []}, 400, "empty", "prompt"),
    ("prompt is a number", "POST", "/v1/completions", {"prompt": 5}, 400, "invalid_type", "prompt"),
    (
        "prompt is an object",
        "POST",
        "/v1/completions",
        {"prompt": {"a": 1}},
        400,
        "invalid_type",
        "prompt",
    ),
    (
        "prompt float id",
        "POST",
        "/v1/completions",
        {"prompt": [1, 2.5]},
        400,
        "invalid_token_id",
        "prompt",
    ),
    (
        "prompt negative id",
        "POST",
        "/v1/completions",
        {"prompt": [-1]},
        400,
        "invalid_token_id",
        "prompt",
    ),
    (
        "prompt bool id",
        "POST",
        "/v1/completions",
        {"prompt": [True]},
        400,
        "invalid_token_id",
        "prompt",
    ),
    (
        "prompt string id",
        "POST",
        "/v1/completions",
        {"prompt": [1, "2"]},
        400,
        "invalid_token_id",
        "prompt",
    ),
    (
        "prompt id == vocab",
        "POST",
        "/v1/completions",
        {"prompt": [1, 260]},
        400,
        "invalid_token_id",
        "prompt",
    ),
    (
        "prompt id huge",
        "POST",
        "/v1/completions",
        {"prompt": [10**15]},
        400,
        "invalid_token_id",
        "prompt",
    ),
    (
        "two prompts",
        "POST",
        "/v1/completions",
        {"prompt": ["a", "b"]},
        400,
        "unsupported_value",
        "prompt",
    ),
    ("n = 17", "POST", "/v1/completions", OK | {"n": 17}, 400, "invalid_value", "n"),
    ("n = 0", "POST", "/v1/completions", OK | {"n": 0}, 400, "invalid_value", "n"),
    (
        "best_of = 3",
        "POST",
        "/v1/completions",
        OK | {"best_of": 3},
        400,
        "unsupported_value",
        "best_of",
    ),
    ("echo", "POST", "/v1/completions", OK | {"echo": True}, 400, "unsupported_parameter", "echo"),
    (
        "suffix",
        "POST",
        "/v1/completions",
        OK | {"suffix": "x"},
        400,
        "unsupported_parameter",
        "suffix",
    ),
    (
        "logprobs 21",
        "POST",
        "/v1/completions",
        OK | {"logprobs": 21},
        400,
        "invalid_value",
        "logprobs",
    ),
    (
        "logprobs bool",
        "POST",
        "/v1/completions",
        OK | {"logprobs": True},
        400,
        "invalid_type",
        "logprobs",
    ),
    ("top_k -2", "POST", "/v1/completions", OK | {"top_k": -2}, 400, "invalid_value", "top_k"),
    ("top_k float", "POST", "/v1/completions", OK | {"top_k": 2.5}, 400, "invalid_type", "top_k"),
    ("min_p 2", "POST", "/v1/completions", OK | {"min_p": 2}, 400, "invalid_value", "min_p"),
    (
        "repetition_penalty 0",
        "POST",
        "/v1/completions",
        OK | {"repetition_penalty": 0},
        400,
        "invalid_value",
        "repetition_penalty",
    ),
    (
        "presence_penalty 3",
        "POST",
        "/v1/completions",
        OK | {"presence_penalty": 3},
        400,
        "invalid_value",
        "presence_penalty",
    ),
    (
        "frequency_penalty -2.5",
        "POST",
        "/v1/completions",
        OK | {"frequency_penalty": -2.5},
        400,
        "invalid_value",
        "frequency_penalty",
    ),
    (
        "logit_bias list",
        "POST",
        "/v1/completions",
        OK | {"logit_bias": [1, 2]},
        400,
        "invalid_type",
        "logit_bias",
    ),
    (
        "logit_bias word key",
        "POST",
        "/v1/completions",
        OK | {"logit_bias": {"hello": 1}},
        400,
        "invalid_value",
        "logit_bias",
    ),
    (
        "logit_bias 101",
        "POST",
        "/v1/completions",
        OK | {"logit_bias": {"5": 101}},
        400,
        "invalid_value",
        "logit_bias",
    ),
    (
        "logit_bias id out of vocab",
        "POST",
        "/v1/completions",
        OK | {"logit_bias": {"260": 1}},
        400,
        "invalid_token_id",
        "logit_bias",
    ),
    (
        "stream_options without stream",
        "POST",
        "/v1/completions",
        OK | {"stream_options": {"include_usage": True}},
        400,
        "invalid_value",
        "stream_options",
    ),
    (
        "stream_options string",
        "POST",
        "/v1/completions",
        OK | {"stream": True, "stream_options": "usage"},
        400,
        "invalid_type",
        "stream_options",
    ),
    (
        "include_usage string",
        "POST",
        "/v1/completions",
        OK | {"stream": True, "stream_options": {"include_usage": "yes"}},
        400,
        "invalid_type",
        "stream_options.include_usage",
    ),
    (
        "max_tokens negative",
        "POST",
        "/v1/completions",
        OK | {"max_tokens": -1},
        400,
        "invalid_value",
        "max_tokens",
    ),
    (
        "max_tokens string",
        "POST",
        "/v1/completions",
        OK | {"max_tokens": "8"},
        400,
        "invalid_type",
        "max_tokens",
    ),
    (
        "max_tokens float",
        "POST",
        "/v1/completions",
        OK | {"max_tokens": 1.5},
        400,
        "invalid_type",
        "max_tokens",
    ),
    (
        "max_tokens huge",
        "POST",
        "/v1/completions",
        OK | {"max_tokens": 10**9},
        400,
        "context_length_exceeded",
        "max_tokens",
    ),
    (
        "prompt + max_tokens > ctx",
        "POST",
        "/v1/completions",
        {"prompt": [1] * 250, "max_tokens": 7},
        400,
        "context_length_exceeded",
        "max_tokens",
    ),
    (
        "prompt alone > ctx",
        "POST",
        "/v1/completions",
        {"prompt": "x" * 300},
        400,
        "context_length_exceeded",
        "prompt",
    ),
    (
        "temperature negative",
        "POST",
        "/v1/completions",
        OK | {"temperature": -0.5},
        400,
        "invalid_value",
        "temperature",
    ),
    (
        "temperature string",
        "POST",
        "/v1/completions",
        OK | {"temperature": "hot"},
        400,
        "invalid_type",
        "temperature",
    ),
    (
        "temperature bool",
        "POST",
        "/v1/completions",
        OK | {"temperature": True},
        400,
        "invalid_type",
        "temperature",
    ),
    ("top_p zero", "POST", "/v1/completions", OK | {"top_p": 0}, 400, "invalid_value", "top_p"),
    (
        "top_p above one",
        "POST",
        "/v1/completions",
        OK | {"top_p": 1.5},
        400,
        "invalid_value",
        "top_p",
    ),
    ("seed negative", "POST", "/v1/completions", OK | {"seed": -1}, 400, "invalid_value", "seed"),
    ("seed too big", "POST", "/v1/completions", OK | {"seed": 2**63}, 400, "invalid_value", "seed"),
    (
        "stream string",
        "POST",
        "/v1/completions",
        OK | {"stream": "yes"},
        400,
        "invalid_type",
        "stream",
    ),
    ("stop number", "POST", "/v1/completions", OK | {"stop": 5}, 400, "invalid_type", "stop"),
    (
        "stop empty string",
        "POST",
        "/v1/completions",
        OK | {"stop": [""]},
        400,
        "invalid_value",
        "stop",
    ),
    (
        "too many stops",
        "POST",
        "/v1/completions",
        OK | {"stop": ["s"] * 17},
        400,
        "invalid_value",
        "stop",
    ),
    (
        "ignore_eos string",
        "POST",
        "/v1/completions",
        OK | {"ignore_eos": "no"},
        400,
        "invalid_type",
        "ignore_eos",
    ),
    (
        "cache_salt number",
        "POST",
        "/v1/completions",
        OK | {"cache_salt": 5},
        400,
        "invalid_type",
        "cache_salt",
    ),
    ("user number", "POST", "/v1/completions", OK | {"user": 5}, 400, "invalid_type", "user"),
    ("model number", "POST", "/v1/completions", OK | {"model": 5}, 400, "invalid_type", "model"),
    (
        "unknown model",
        "POST",
        "/v1/completions",
        OK | {"model": "gpt-9"},
        404,
        "model_not_found",
        "model",
    ),
    (
        "messages missing",
        "POST",
        "/v1/chat/completions",
        {"model": "tiny-test"},
        400,
        "missing_required",
        "messages",
    ),
    ("messages empty", "POST", "/v1/chat/completions", {"messages": []}, 400, "empty", "messages"),
    (
        "messages string",
        "POST",
        "/v1/chat/completions",
        {"messages": "hi"},
        400,
        "invalid_type",
        "messages",
    ),
    (
        "message not object",
        "POST",
        "/v1/chat/completions",
        {"messages": ["hi"]},
        400,
        "invalid_type",
        "messages[0]",
    ),
    (
        "unknown role",
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "robot", "content": "x"}]},
        400,
        "invalid_value",
        "messages[0].role",
    ),
    (
        "content number",
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": 3}]},
        400,
        "invalid_type",
        "messages[0].content",
    ),
    (
        "content missing",
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user"}]},
        400,
        "invalid_type",
        "messages[0].content",
    ),
    (
        "image part",
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "invalid_value",
        "messages[0].content",
    ),
    (
        "max_completion_tokens negative",
        "POST",
        "/v1/chat/completions",
        CHAT | {"max_completion_tokens": -5},
        400,
        "invalid_value",
        "max_completion_tokens",
    ),
    ("chat n = 0", "POST", "/v1/chat/completions", CHAT | {"n": 0}, 400, "invalid_value", "n"),
    (
        "chat tools",
        "POST",
        "/v1/chat/completions",
        CHAT | {"tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "unsupported_parameter",
        "tools",
    ),
    (
        "chat tool_choice",
        "POST",
        "/v1/chat/completions",
        CHAT | {"tool_choice": "auto"},
        400,
        "unsupported_parameter",
        "tool_choice",
    ),
    (
        "chat response_format json",
        "POST",
        "/v1/chat/completions",
        CHAT | {"response_format": {"type": "json_object"}},
        400,
        "unsupported_parameter",
        "response_format",
    ),
    (
        "chat top_logprobs without logprobs",
        "POST",
        "/v1/chat/completions",
        CHAT | {"top_logprobs": 2},
        400,
        "invalid_value",
        "top_logprobs",
    ),
    (
        "chat logprobs number",
        "POST",
        "/v1/chat/completions",
        CHAT | {"logprobs": 2},
        400,
        "invalid_type",
        "logprobs",
    ),
    (
        "chat audio",
        "POST",
        "/v1/chat/completions",
        CHAT | {"audio": {"voice": "alloy", "format": "mp3"}},
        400,
        "unsupported_parameter",
        "audio",
    ),
    (
        "generate top_logprobs_num 25",
        "POST",
        "/generate",
        {"text": "a", "return_logprob": True, "top_logprobs_num": 25},
        400,
        "invalid_value",
        "top_logprobs_num",
    ),
    (
        "generate text and ids",
        "POST",
        "/generate",
        {"text": "a", "input_ids": [1]},
        400,
        "missing_prompt",
        "text",
    ),
    (
        "generate no prompt",
        "POST",
        "/generate",
        {"sampling_params": {}},
        400,
        "missing_prompt",
        "text",
    ),
    ("generate text number", "POST", "/generate", {"text": 1}, 400, "invalid_type", "text"),
    (
        "generate ids out of vocab",
        "POST",
        "/generate",
        {"input_ids": [300]},
        400,
        "invalid_token_id",
        "prompt",
    ),
    (
        "generate unknown field",
        "POST",
        "/generate",
        {"text": "a", "return_hidden_states": True},
        400,
        "unknown_field",
        "return_hidden_states",
    ),
    (
        "sampling_params list",
        "POST",
        "/generate",
        {"text": "a", "sampling_params": [1]},
        400,
        "invalid_type",
        "sampling_params",
    ),
    (
        "unknown sampling param",
        "POST",
        "/generate",
        {"text": "a", "sampling_params": {"regex": "a+"}},
        400,
        "unknown_field",
        "sampling_params.regex",
    ),
    (
        "max_new_tokens negative",
        "POST",
        "/generate",
        {"text": "a", "sampling_params": {"max_new_tokens": -2}},
        400,
        "invalid_value",
        "sampling_params.max_new_tokens",
    ),
    (
        "max_new_tokens beyond ctx",
        "POST",
        "/generate",
        {"text": "a", "sampling_params": {"max_new_tokens": 256}},
        400,
        "context_length_exceeded",
        "sampling_params.max_new_tokens",
    ),
    (
        "stop_token_ids out of vocab",
        "POST",
        "/generate",
        {"text": "a", "sampling_params": {"stop_token_ids": [999]}},
        400,
        "invalid_token_id",
        "sampling_params.stop_token_ids",
    ),
    (
        "sampling temperature inf-like",
        "POST",
        "/generate",
        {"text": "a", "sampling_params": {"temperature": -1e308}},
        400,
        "invalid_value",
        "sampling_params.temperature",
    ),
    (
        "generate stream number",
        "POST",
        "/generate",
        {"text": "a", "stream": 1},
        400,
        "invalid_type",
        "stream",
    ),
    (
        "body too large",
        "POST",
        "/v1/completions",
        {"prompt": "x" * (MAX_BODY + 10)},
        413,
        "body_too_large",
        None,
    ),
    ("wrong method", "GET", "/v1/completions", None, 405, "method_not_allowed", None),
    ("wrong method flush", "GET", "/flush_cache", None, 405, "method_not_allowed", None),
    ("unknown path", "POST", "/v1/embeddings", OK, 404, "not_found", None),
    ("unknown path get", "GET", "/nothing/here", None, 404, "not_found", None),
]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def mesh(nats_server: ServerProcess, redis_server: ServerProcess) -> AsyncIterator[Mesh]:
    async with running_mesh(
        nats_server.url,
        redis_server.url,
        num_engines=1,
        engine_kw={"context_len": CONTEXT_LEN, "interval_s": 0.5},
        max_body_bytes=MAX_BODY,
    ) as m:
        yield m


async def test_corpus_is_large_and_distinct() -> None:
    assert len(CASES) >= 30
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code", "param"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
async def test_bad_request(
    mesh: Mesh,
    redis_server: ServerProcess,
    method: str,
    path: str,
    body: Any,
    status: int,
    code: str,
    param: str | None,
) -> None:
    r = aioredis.Redis.from_url(redis_server.url)
    keys_before = await r.dbsize()
    data = body if isinstance(body, bytes) or body is None else orjson.dumps(body)
    headers = {"Content-Type": "application/json"}
    resp = await mesh.client.request(method, path, data=data, headers=headers)
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"
    err = await resp.json()
    assert list(err) == ["error"]
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert isinstance(err["error"]["message"], str) and err["error"]["message"]
    assert err["error"]["type"] == "invalid_request_error"
    assert err["error"]["code"] == code
    assert err["error"]["param"] == param
    if status == 405:
        assert "Allow" in resp.headers
    await mesh.sync()
    engine = mesh.engines[0]
    assert engine.received == [] and engine.aborts == [] and engine.flushes == 0
    assert await r.dbsize() == keys_before
    await r.aclose()


async def test_good_request_after_the_corpus_works(mesh: Mesh) -> None:
    engine = mesh.engines[0]
    assert engine.received == []  # nothing from any bad request, even late
    # unknown top-level fields of OpenAI requests are ignored (clients send many)
    extra = {"metadata": {"a": "b"}, "store": False, "service_tier": "auto", "logprobs": None}
    extra |= {"frequency_penalty": 0, "tools": [], "tool_choice": "none", "echo": False}
    extra |= {"response_format": {"type": "text"}, "stream_options": None}
    body = {"prompt": [1, 2, 3], "max_tokens": 4} | extra
    r = await mesh.client.post("/v1/completions", json=body)
    assert r.status == 200, await r.text()
    assert (await r.json())["choices"][0]["token_ids"] == expected_tokens([1, 2, 3], 4)
    assert len(engine.received) == 1
