"""Prompt ids are compact from JSON decode on (array('I')), with the same checks and messages.

The router's checks are vectorised (issue 7, acceptance 3); these tests pin that the fast
path changes nothing a client sees: each bad id is still named by its index, and the
`GenerateRequest` an engine receives carries exactly the ids sent. `bench_router.py` is run
once for real at 1,024 tokens: its ids used to exceed the tiny model's vocabulary (defect 13).
"""

from __future__ import annotations

import subprocess
import sys
from array import array
from pathlib import Path
from typing import Any

import orjson
import pytest

from bus_schemas import GenerateRequest, ModelCard, Sampling
from router.errors import ApiError
from router.models import served_model
from router.protocol import check_limits, parse_chat, parse_completion, parse_generate

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 260
TOK = served_model(ModelCard("m", "m", "bytes", "", None, [257], None, 512, VOCAB))


def generate(ids: Any) -> Any:
    return parse_generate({"input_ids": ids}, TOK, 4)


def error_of(fn: Any, *args: Any) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(*args)
    return e.value


def test_prompt_ids_are_an_array_from_every_endpoint() -> None:
    for spec in (
        generate([1, 2, 259]),
        parse_generate({"text": "hé"}, TOK, 4),
        parse_completion({"prompt": [1, 2, 259]}, TOK, 4),
        parse_completion({"prompt": [[1, 2]]}, TOK, 4),
        parse_completion({"prompt": "hi"}, TOK, 4),
        parse_chat({"messages": [{"role": "user", "content": "x"}]}, TOK, 4),
    ):
        assert isinstance(spec.input_ids, array) and spec.input_ids.typecode == "I"
    assert generate([1, 2, 259]).input_ids.tolist() == [1, 2, 259]
    assert parse_generate({"text": "hé"}, TOK, 4).input_ids.tolist() == [104, 195, 169]


def test_ids_pass_to_the_bus_without_a_copy() -> None:
    spec = generate([5, 6, 7])
    req = GenerateRequest("r", spec.input_ids, spec.sampling(3), "inbox")
    assert req.input_ids is spec.input_ids
    assert GenerateRequest.decode(req.encode()).input_ids.tolist() == [5, 6, 7]


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([1, True], "input_ids[1] is True: token ids must be integers >= 0"),
        ([False], "input_ids[0] is False: token ids must be integers >= 0"),
        ([1, 2, -1], "input_ids[2] is -1: token ids must be integers >= 0"),
        ([5, 0, 1, 9, True], "input_ids[4] is True: token ids must be integers >= 0"),
        ([0] * 100 + [7, False], "input_ids[101] is False: token ids must be integers >= 0"),
        ([1, 2.5], "input_ids[1] is 2.5: token ids must be integers >= 0"),
        ([1, "2"], "input_ids[1] is '2': token ids must be integers >= 0"),
        ([1, None], "input_ids[1] is None: token ids must be integers >= 0"),
        ([1, [2]], "input_ids[1] is [2]: token ids must be integers >= 0"),
        ([3, 2**32], "input_ids[1] is 4294967296: token ids must be integers in [0, 2**32)"),
        (
            [10**30],
            "input_ids[0] is 1000000000000000000000000000000: token ids must be integers in [0, 2**32)",
        ),
    ],
)
def test_a_bad_id_is_named_by_its_index(ids: list[Any], message: str) -> None:
    err = error_of(generate, ids)
    assert (err.status, err.code, err.param, err.message) == (
        400,
        "invalid_token_id",
        "input_ids",
        message,
    )


def test_a_bad_completions_prompt_id_names_prompt() -> None:
    err = error_of(parse_completion, {"prompt": [7, True]}, TOK, 4)
    assert (err.code, err.param) == ("invalid_token_id", "prompt")
    err = error_of(parse_completion, {"prompt": [10**15]}, TOK, 4)
    assert (err.code, err.param) == ("invalid_token_id", "prompt")


def test_bools_anywhere_else_in_the_body_do_not_trip_the_bool_check() -> None:
    spec = parse_generate(
        {"input_ids": [1, 0, 1], "stream": True, "sampling_params": {"ignore_eos": False}},
        TOK,
        4,
    )
    assert spec.input_ids.tolist() == [1, 0, 1] and spec.stream and not spec.ignore_eos


def test_vocabulary_bound_names_the_first_id_outside() -> None:
    spec = generate([1, 259, 260, 300])
    assert spec.max_input_id == 300
    err = error_of(check_limits, spec, VOCAB, 1024)
    assert (err.code, err.param) == ("invalid_token_id", "prompt")
    assert err.message == "prompt token 2 is 260: token ids must be integers in [0, 260)"
    assert check_limits(generate([0, 259]), VOCAB, 1024) == 128  # SGLang's default
    text = parse_generate({"text": "ab"}, TOK, 4)  # no max from parsing: computed here
    assert text.max_input_id is None and check_limits(text, 99, 1024) == 128
    err = error_of(check_limits, text, 98, 1024)
    assert err.message == "prompt token 1 is 98: token ids must be integers in [0, 98)"


def test_stop_token_ids_are_checked_against_the_vocabulary() -> None:
    spec = parse_generate(
        {"input_ids": [1], "sampling_params": {"stop_token_ids": [2, 999]}}, TOK, 4
    )
    assert spec.stop_token_ids == (2, 999)
    err = error_of(check_limits, spec, VOCAB, 1024)
    assert err.param == "sampling_params.stop_token_ids"
    assert err.message.startswith("sampling_params.stop_token_ids token 1 is 999")
    err = error_of(generate_with_stop, [True])
    assert err.param == "sampling_params.stop_token_ids"


def generate_with_stop(stop: list[Any]) -> Any:
    return parse_generate({"input_ids": [1], "sampling_params": {"stop_token_ids": stop}}, TOK, 4)


def test_a_long_prompt_round_trips_exactly() -> None:
    ids = [(i * 7919) % VOCAB for i in range(32768)]
    spec = parse_generate(orjson.loads(orjson.dumps({"input_ids": ids})), TOK, 4)
    assert spec.max_input_id == max(ids)
    assert check_limits(spec, VOCAB, 40000) == 128
    req = GenerateRequest("r", spec.input_ids, Sampling(max_new_tokens=1), "inbox")
    assert GenerateRequest.decode(req.encode()).input_ids.tolist() == ids


@pytest.mark.timeout(300)
def test_bench_router_runs_at_1024_tokens() -> None:
    """Defect 13: the bench's prompt ids exceeded the vocabulary and the router said 400."""
    cmd = [sys.executable, "benchmarks/bench_router.py", "--prompt-len", "1024"]
    cmd += ["--requests", "3", "--warmup", "1", "--engines", "1"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.strip().startswith("1024 ")]
    # prompt, engine p50, router p50, added p50, [lo, hi], own p50, own p99, parse, route,
    # lookup, aiohttp added, other load, cpu check
    assert len(rows) == 1 and len(rows[0]) == 14, out.stdout
    engine, router, own, parse, lookup = (float(rows[0][i]) for i in (1, 2, 6, 8, 10))
    assert engine > 0 and router > 0 and 0 < parse < own < router  # ms
    assert lookup == 0  # one engine: Redis is not asked
