"""`hicache-mesh replay` without a mesh: reading records, the plan and its pace, the client
against a small aiohttp server, the comparison, the figures, and the command end to end
against a server whose answers follow a fixed rule (and can be made to differ)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from services.cli import main
from services.launch.servers import free_port
from services.replay.client import ClientConfig, ReplayClient, Replayed, StreamReader
from services.replay.compare import Mismatch, check, first_difference, replays_exactly
from services.replay.observation import CachedTokens, ChoiceOutput, Observation
from services.replay.plan import Pace, plan, request_to_send
from services.replay.recording import (
    RecordedRequest,
    RecordFormatError,
    read_recording,
)
from services.replay.report import histogram, render
from services.replay.summary import (
    ArmTarget,
    LatencyRow,
    Percentiles,
    Thresholds,
    parse_percent,
    regressions,
    staleness,
    summarize,
)
from services.replay.target import recorded_flags

T0 = 1_764_650_000.0
HEADER = {
    "type": "header",
    "format": "hicache-mesh-record",
    "version": 1,
    "project_version": "0.1.0",
    "git_revision": None,
    "created": T0,
    "model": "tiny",
    "redacted": False,
    "mesh_flags": ["up", "--engines", "1"],
}


def rule_tokens(prompt: list[int], n: int, seed: int | None = None) -> list[int]:
    """The fake server's answer to a prompt: a fixed function of it (and of the seed)."""
    base = sum(prompt) + (seed or 0)
    return [(base + 7 * k) % 256 for k in range(n)]


def request_line(
    time_s: float,
    prompt: list[int],
    max_tokens: int = 4,
    *,
    status: int = 200,
    stream: bool = False,
    seed: int | None = None,
    temperature: float = 0.0,
    cached: int = 0,
    predicted: int | None = 0,
    tokens: list[int] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One record as the router writes it (docs/recording.md)."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, **(extra or {})}
    if temperature:
        body["temperature"] = temperature
    if stream:
        body["stream"] = True
    ok = status == 200
    out = (tokens if tokens is not None else rule_tokens(prompt, max_tokens, seed)) if ok else []
    return {
        "type": "request",
        "time": T0 + time_s,
        "endpoint": "/v1/completions",
        "status": status,
        "request": body,
        "input_ids": prompt if ok else [],
        "seed": seed,
        "sampling": [{"max_new_tokens": max_tokens, "temperature": temperature}] if ok else [],
        "choices": [{"output_ids": out, "text": None, "finish_reason": "length"}] if ok else [],
        "usage": {
            "prompt_tokens": len(prompt) if ok else 0,
            "completion_tokens": len(out),
            "cached_tokens": {"device": cached, "host": 0, "storage": 0},
        },
        "ttft_s": 0.010 if ok else None,
        "itl_s": [0.002] * (len(out) - 1) if ok and stream else [],
        "e2e_s": 0.02,
        "engine_id": "engine-0" if ok else None,
        "route_reason": "prefix" if ok else None,
        "predicted_cached_tokens": predicted if ok else None,
        "error": None if ok else "'temperature' must be >= 0, got -1.0",
    }


def write_records(path: Path, lines: list[Any]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    return path


def sample_lines() -> list[dict[str, Any]]:
    return [
        HEADER,
        request_line(0.3, [1, 2, 3], stream=True, cached=0),
        request_line(0.0, [4, 5, 6, 7], cached=0, predicted=0),
        request_line(0.5, [1, 2, 3, 9], temperature=0.9, seed=77, cached=0, predicted=4),
        request_line(0.8, [9], status=400, temperature=-1),
        {"type": "drops", "time": T0 + 0.9, "count": 3},
        request_line(1.0, [1, 2, 3, 9, 10], cached=0, predicted=0),
    ]


# ---------------------------------------------------------------- reading


def test_redacted_fields_decide_what_a_redacted_request_is_compared_on(tmp_path: Path) -> None:
    """Issue 20, finding 3: a record whose `stop` strings were redacted is sent and its
    status compared, not its outputs; a refused one that lost fields, or whose oversized body
    was left out, is sent and not compared (without them it may be served)."""
    from services.replay.compare import replays_exactly

    redacted = HEADER | {"redacted": True, "token_ids": "keep"}
    lines = [
        redacted,
        request_line(0.0, [1, 2], extra={"redacted_fields": ["prompt"]}),
        request_line(0.1, [1, 2], extra={"redacted_fields": ["prompt", "stop"]}),
        request_line(0.2, [3], status=400, extra={"redacted_fields": ["..."]}),
        request_line(0.3, [3], status=400, extra={"omitted_bytes": 3 << 20}),
    ]
    for line in lines[1:]:  # the record's own fields, not the body's
        for key in ("redacted_fields", "omitted_bytes"):
            if key in line["request"]:
                line[key] = line["request"].pop(key)
    rec = read_recording(write_records(tmp_path / "r.jsonl", lines))
    assert rec.headers[0].token_ids == "keep"
    plain, stopped, refused, omitted = rec.requests
    assert stopped.redacted_fields == ("prompt", "stop")
    assert [replays_exactly(r) for r in (plain, stopped)] == [True, False]
    assert plain.reference is not None and stopped.reference is not None
    assert refused.reference is None and omitted.reference is None


def test_a_recording_reads_into_segments_requests_and_drops(tmp_path: Path) -> None:
    redacted = HEADER | {"redacted": True}
    lines = [*sample_lines(), redacted, request_line(2.0, [3, 3])]
    rec = read_recording(write_records(tmp_path / "r.jsonl", lines))
    assert [h.line for h in rec.headers] == [1, 8]
    assert [r.line for r in rec.requests] == [2, 3, 4, 5, 7, 9]
    assert [r.segment for r in rec.requests] == [0, 0, 0, 0, 0, 1]
    assert [r.redacted for r in rec.requests] == [False] * 5 + [True]
    assert rec.num_dropped == 3 and rec.drops[0].line == 6
    first = rec.requests[0]
    assert first.endpoint == "/v1/completions" and first.input_ids == (1, 2, 3)
    assert first.reference is not None
    assert first.reference.choices == (
        ChoiceOutput(tuple(rule_tokens([1, 2, 3], 4)), None, "length"),
    )
    assert first.reference.cached == CachedTokens(0, 0, 0)
    assert first.reference.itl_s == (0.002, 0.002, 0.002)
    assert rec.requests[2].seed == 77 and rec.requests[3].reference is not None
    assert rec.requests[3].reference.status == 400 and rec.requests[3].input_ids == ()
    assert rec.headers[0].mesh_flags == ("up", "--engines", "1")


@pytest.mark.parametrize(
    ("lines", "line", "message"),
    [
        ([HEADER | {"version": 2}], 1, "format version 2 is not supported"),
        ([HEADER | {"format": "other"}], 1, "format 'other' is not 'hicache-mesh-record'"),
        ([request_line(0, [1])], 1, "a 'request' line before the first header"),
        ([HEADER, b"{not json"], 2, "not a JSON line"),
        ([HEADER, [1, 2]], 2, "expected a JSON object, got list"),
        ([HEADER, {"type": "request", "time": 1.0}], 2, "missing field 'request'"),
        ([HEADER, request_line(0, [1]) | {"time": "soon"}], 2, "field 'time' must be a number"),
        ([HEADER, request_line(0, [1]) | {"status": None}], 2, "missing field 'status'"),
        ([HEADER, request_line(0, [1]) | {"input_ids": [1, "a"]}], 2, "'input_ids[1]' must be"),
        ([HEADER, {"type": "reply"}], 2, "unknown line type 'reply'"),
        (
            [HEADER, request_line(0, [1]) | {"choices": [{"output_ids": 3}]}],
            2,
            "choices[0].output_ids",
        ),
        ([], 1, "no header line"),
    ],
)
def test_bad_input_is_refused_naming_the_line(
    tmp_path: Path, lines: list[Any], line: int, message: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(
        b"".join((x if isinstance(x, bytes) else orjson.dumps(x)) + b"\n" for x in lines)
    )
    with pytest.raises(RecordFormatError) as e:
        read_recording(path)
    assert e.value.line == line
    assert str(e.value).startswith(f"{path}:{line}: ") and message in str(e.value)


def test_the_command_exits_2_on_a_bad_file_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_records(tmp_path / "v2.jsonl", [HEADER | {"version": 2}])
    assert main(["replay", str(path), "--url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:1: format version 2 is not supported" in err
    assert main(["replay", str(tmp_path / "missing.jsonl"), "--url", "http://x"]) == 2
    assert "cannot read" in capsys.readouterr().err
    alone = write_records(tmp_path / "alone.jsonl", [HEADER | {"mesh_flags": None}])
    assert main(["replay", str(alone)]) == 2  # no --url, no --mesh-args, no recorded flags
    err = capsys.readouterr().err
    assert "names no mesh flags" in err and "give --url URL" in err
    good = write_records(tmp_path / "v1.jsonl", sample_lines())
    assert main(["replay", str(good), "--url", "http://x", "--arms", "cold"]) == 2
    assert "drop --arms and --mesh-args" in capsys.readouterr().err
    assert main(["replay", str(good), "--mesh-args", "", "--arms", "cache,nope"]) == 2
    assert "distinct names among cache, cold" in capsys.readouterr().err
    assert main(["replay", str(good), "--mesh-args", "--engines 1", "--arms", "cache,cache"]) == 2
    assert (
        main(["replay", str(good), "--mesh-args=--disable-radix-cache", "--arms", "cache,cold"])
        == 2
    )
    assert "resolve to the same mesh" in capsys.readouterr().err
    assert main(["replay", str(good), "--url", "http://x", "--speed", "-1"]) == 2
    assert "--speed must be a finite number >= 0" in capsys.readouterr().err


# ---------------------------------------------------------------- the mesh to replay on


RECORDED_FLAGS = [
    "--port", "8000", "--engines", "2", "--record", "traffic.jsonl", "--record-redact",
    "--status-file=up.json", "--api-key=***", "--nats-url", "nats://127.0.0.1:4222",
    "--hicache-storage-backend", "file", "--hicache-storage-dir", "/srv/l3", "--page-size=4",
]  # fmt: skip


def test_the_recorded_flags_lose_what_binds_or_writes_where_the_original_did(
    tmp_path: Path,
) -> None:
    header = HEADER | {"mesh_flags": ["up", *RECORDED_FLAGS], "model": "tiny-tp"}
    rec = read_recording(write_records(tmp_path / "r.jsonl", [header]))
    flags = recorded_flags(rec)
    assert flags.kept == (
        "--engines", "2", "--hicache-storage-backend", "file", "--page-size=4",
        "--model", "tiny-tp",  # the header's model: up's default may have changed since
    )  # fmt: skip
    assert flags.dropped == (
        "--port", "8000", "--record", "traffic.jsonl", "--record-redact",
        "--status-file=up.json", "--api-key=***", "--nats-url", "nats://127.0.0.1:4222",
        "--hicache-storage-dir", "/srv/l3",
    )  # fmt: skip
    assert flags.storage  # so every arm gets a storage directory of its own
    named = HEADER | {"mesh_flags": ["--model-path", "m", "--rec", "x"]}  # an abbreviation
    with pytest.raises(ValueError, match="not valid"):  # --rec is ambiguous, as in `up`
        recorded_flags(read_recording(write_records(tmp_path / "n.jsonl", [named])))
    named = HEADER | {"mesh_flags": ["--model-path", "m", "--record=x"]}
    flags = recorded_flags(read_recording(write_records(tmp_path / "n.jsonl", [named])))
    assert flags.kept == ("--model-path", "m") and flags.dropped == ("--record=x",)
    assert not flags.storage


def test_a_replay_never_writes_to_its_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_records(tmp_path / "r.jsonl", sample_lines())
    before = path.read_bytes()
    same = ["--mesh-args", f"--engines 1 --record {tmp_path}/./r.jsonl"]
    assert main(["replay", str(path), *same]) == 2  # before any mesh starts
    err = capsys.readouterr().err
    assert f"arm replay's --record {tmp_path}/./r.jsonl is the replay's input" in err
    status = ["--mesh-args", f"--status-file {path}", "--arms", "cache,cold"]
    assert main(["replay", str(path), *status]) == 2
    assert "arm cache's --status-file" in capsys.readouterr().err
    assert main(["replay", str(path), "--url", "http://x", "--report", str(path)]) == 2
    assert "--report" in capsys.readouterr().err
    assert main(["replay", str(path), "--url", "http://x", "--plot", str(path)]) == 2
    assert path.read_bytes() == before


def test_warmup_requests_go_first_and_are_not_measured(
    server: RuleServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_records(tmp_path / "r.jsonl", sample_lines())
    assert _replay(path, server.url, tmp_path, "--warmup", "7", plot=False) == 0
    out, err = capsys.readouterr()
    assert "arm replay: 7 warmup requests sent, unmeasured (1 failed)" in err  # the 400 one
    assert "arm replay: 5 requests, 4 outputs compared, 0 mismatches" in out
    prompts = [b["prompt"] for _, b in server.arrivals]
    order = [[4, 5, 6, 7], [1, 2, 3], [1, 2, 3, 9], [9], [1, 2, 3, 9, 10]]  # arrival order
    assert prompts == [*order, *order[:2], *order]  # the plan's first 7, cycled, then the run
    assert main(["replay", str(path), "--url", server.url, "--warmup", "-1"]) == 2


def _slower(rec: RecordedRequest, ttft_s: float) -> Observation:
    """The recorded answer, with another TTFT and E2E."""
    assert rec.reference is not None
    return dataclasses.replace(rec.reference, ttft_s=ttft_s, e2e_s=2 * ttft_s)


@pytest.mark.parametrize(("fresh", "warmup", "cold"), [(True, 0, True), (True, 3, False),
                                                      (False, 0, False)])  # fmt: skip
def test_a_gate_on_a_cold_mesh_says_so(
    tmp_path: Path, fresh: bool, warmup: int, cold: bool
) -> None:
    lines = [HEADER, request_line(0.0, [1, 2], stream=True), request_line(0.1, [3], stream=True)]
    rec = read_recording(write_records(tmp_path / "r.jsonl", lines))
    requests = plan(rec.requests, Pace())
    by_line = {r.line: r for r in rec.requests}
    replayed = [Replayed(r.line, r.send_at_s, _slower(by_line[r.line], 0.050)) for r in requests]
    target = ArmTarget("hicache-mesh up --engines 1", fresh, warmup)
    gate = Thresholds(ttft_pct=10.0)
    result = summarize(rec, rec.requests, requests, {"a": (target, replayed)}, Pace(), False, gate)
    (failure,) = result.failures()  # 50 ms replayed against 10 ms recorded
    assert failure.startswith("arm a: regression: TTFT p50 50.00 ms replayed")
    assert ("freshly started mesh measured without a warmup" in failure) == cold
    assert bool(result.notes()) == cold
    assert ("Notes:\n- arm a: the p50 regression limits compare" in render(result)) == cold
    ungated = summarize(rec, rec.requests, requests, {"a": (target, replayed)}, Pace(), False,
                        Thresholds())  # fmt: skip
    assert ungated.notes() == [] and ungated.failures() == []


# ---------------------------------------------------------------- the plan


def _rec(body: Any, endpoint: str = "/v1/completions", **kw: Any) -> RecordedRequest:
    fields: dict[str, Any] = {
        "line": 2,
        "segment": 0,
        "time_s": T0,
        "endpoint": endpoint,
        "body": body,
        "input_ids": (5, 6, 7),
        "seed": None,
        "sampling": (),
        "redacted": False,
        "reference": None,
        "predicted_cached_tokens": None,
        "engine_id": None,
        "route_reason": None,
    }
    return RecordedRequest(**(fields | kw))


def test_the_recorded_seed_goes_into_a_body_that_named_none() -> None:
    body = {"prompt": "x", "temperature": 0.8}
    assert request_to_send(_rec(body, seed=42)) == ("/v1/completions", body | {"seed": 42})
    assert request_to_send(_rec(body | {"seed": 5}, seed=5))[1]["seed"] == 5
    assert request_to_send(_rec(body))[1] == body  # greedy: no seed
    gen = {"text": "x", "sampling_params": {"temperature": 1.0}}
    sent = request_to_send(_rec(gen, "/generate", seed=9))[1]
    assert sent["sampling_params"] == {"temperature": 1.0, "seed": 9}
    assert request_to_send(_rec({"text": "x"}, "/generate", seed=9))[1]["sampling_params"] == {
        "seed": 9
    }
    assert request_to_send(_rec(None)) == ("/v1/completions", None)  # not JSON: as it was


def test_streams_ask_for_usage_and_redacted_records_send_their_ids() -> None:
    sent = request_to_send(_rec({"prompt": "x", "stream": True}))[1]
    assert sent["stream_options"] == {"include_usage": True}
    chat = {"max_completion_tokens": 3, "logprobs": True, "top_logprobs": 2, "stream": False}
    endpoint, body = request_to_send(_rec(chat, "/v1/chat/completions", redacted=True, seed=4))
    assert endpoint == "/v1/completions"
    assert body == {"max_tokens": 3, "logprobs": 2, "stream": False, "prompt": [5, 6, 7], "seed": 4}
    assert request_to_send(_rec({"sampling_params": {}}, "/generate", redacted=True)) == (
        "/generate",
        {"sampling_params": {}, "input_ids": [5, 6, 7]},
    )
    rejected = _rec({"temperature": -1}, "/v1/chat/completions", redacted=True, input_ids=())
    assert request_to_send(rejected) == ("/v1/chat/completions", {"temperature": -1})


def test_send_times_keep_the_recorded_gaps_scaled_by_speed() -> None:
    recs = [
        _rec({"prompt": "a"}, line=2, time_s=T0 + 3.0),
        _rec({"prompt": "b"}, line=3, time_s=T0 + 1.0),
        _rec({"prompt": "c"}, line=4, time_s=T0 + 1.0),
        _rec({"prompt": "d"}, line=5, time_s=T0 + 2.0),
    ]
    at1 = plan(recs, Pace(1.0))
    assert [r.line for r in at1] == [3, 4, 5, 2]  # arrival order, ties in file order
    assert [r.send_at_s for r in at1] == [0.0, 0.0, 1.0, 2.0]
    assert [r.send_at_s for r in plan(recs, Pace(2.0))] == [0.0, 0.0, 0.5, 1.0]
    assert [r.send_at_s for r in plan(recs, Pace(0.0))] == [0.0] * 4
    assert [r.arrival_s for r in plan(recs, Pace(0.0))] == [0.0, 0.0, 1.0, 2.0]
    for speed, cap in ((-1.0, None), (float("inf"), None), (1.0, 0)):
        with pytest.raises(ValueError):
            Pace(speed, cap)


# ---------------------------------------------------------------- a server following the rule


class RuleServer:
    """`/v1/completions` answering `rule_tokens` (token-id prompts), whole or streamed; 400
    for a negative temperature; `perturb` turns every answer's 3rd token into token + 1.
    Runs on its own loop in a thread, so the code under test can `asyncio.run`."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.perturb = False
        self.arrivals: list[tuple[float, Any]] = []
        self.inflight = 0
        self.max_inflight = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RuleServer:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.arrivals.append((time.perf_counter(), body))
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            await asyncio.sleep(self.delay_s)
            return await self._answer(request, body)
        finally:
            self.inflight -= 1

    async def _answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if body.get("temperature", 0) < 0:
            err = {"message": "'temperature' must be >= 0", "type": "invalid_request_error"}
            return web.json_response({"error": err}, status=400)
        tokens = rule_tokens(body["prompt"], body["max_tokens"], body.get("seed"))
        if self.perturb and len(tokens) > 2:
            tokens[2] = (tokens[2] + 1) % 256
        usage = {
            "prompt_tokens": len(body["prompt"]),
            "completion_tokens": len(tokens),
            "prompt_tokens_details": {
                "cached_tokens": 0,
                "cached_tokens_by_tier": {"device": 0, "host": 0, "storage": 0},
            },
        }
        if not body.get("stream"):
            choice = {"index": 0, "text": "", "token_ids": tokens, "finish_reason": "length"}
            return web.json_response({"choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, t in enumerate(tokens):
            reason = "length" if i == len(tokens) - 1 else None
            choice = {"index": 0, "text": "", "token_ids": [t], "finish_reason": reason}
            await resp.write(b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n")
            await asyncio.sleep(0.005)
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture
def server() -> Iterator[RuleServer]:
    with RuleServer() as s:
        yield s


def test_the_client_keeps_the_pace_and_the_concurrency_cap(tmp_path: Path) -> None:
    lines = [HEADER] + [request_line(0.1 * i, [i + 1, 2], max_tokens=3) for i in range(6)]
    rec = read_recording(write_records(tmp_path / "r.jsonl", lines))
    with RuleServer() as s:
        requests = plan(rec.requests, Pace(2.0))
        got = asyncio.run(
            ReplayClient(ClientConfig(s.url, Pace(2.0), show_progress=False)).run("a", requests)
        )
        gaps = [b - a for (a, _), (b, _) in zip(s.arrivals, s.arrivals[1:], strict=False)]
    assert [r.line for r in got] == [2, 3, 4, 5, 6, 7]
    assert all(r.observation.ok for r in got)
    assert all(0.035 <= g <= 0.09 for g in gaps), gaps  # 0.1 s recorded at speed 2
    assert [r.sent_s for r in got] == pytest.approx([0.05 * i for i in range(6)], abs=0.03)
    with RuleServer(delay_s=0.05) as s:
        capped = Pace(0.0, max_concurrency=2)
        asyncio.run(
            ReplayClient(ClientConfig(s.url, capped, show_progress=False)).run(
                "b", plan(rec.requests, capped)
            )
        )
        assert s.max_inflight == 2 and len(s.arrivals) == 6


def test_a_stream_is_read_per_choice_with_ttft_and_gaps_per_token() -> None:
    r = StreamReader("/v1/chat/completions", sent_at=10.0)

    def event(index: int, ids: list[int], text: str, reason: str | None = None) -> bytes:
        choice = {
            "index": index,
            "delta": {"content": text},
            "token_ids": ids,
            "finish_reason": reason,
        }
        return orjson.dumps({"choices": [choice]})

    r.consume(event(0, [], ""), 10.05)  # the role chunk carries no token
    r.consume(event(0, [7], "a"), 10.2)
    r.consume(event(1, [9], "c"), 10.25)  # choice 1: no effect on choice 0's times
    r.consume(event(0, [8, 9], "bb", "length"), 10.4)
    r.consume(event(1, [], "", "stop"), 10.45)
    usage = {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens_by_tier": {"device": 4}}}
    r.consume(orjson.dumps({"choices": [], "usage": usage}), 10.5)
    r.consume(b"[DONE]", 10.5)
    obs = r.observation(0.5)
    assert obs.ttft_s == pytest.approx(0.2)
    assert obs.itl_s == pytest.approx((0.1, 0.1))
    assert obs.choices == (
        ChoiceOutput((7, 8, 9), "abb", "length"),
        ChoiceOutput((9,), "c", "stop"),
    )
    assert obs.cached == CachedTokens(4, 0, 0) and obs.prompt_tokens == 5 and obs.ok
    cut = StreamReader("/v1/completions", 0.0)
    cut.consume(orjson.dumps({"error": {"message": "engine lost"}}), 1.0)
    assert cut.observation(1.0).error == "engine lost"
    assert StreamReader("/v1/completions", 0.0).observation(1.0).error == (
        "the stream ended without [DONE]"
    )


# ---------------------------------------------------------------- comparison


def _obs(ids: list[int], status: int = 200, cached: int = 0, **kw: Any) -> Observation:
    choices = (ChoiceOutput(tuple(ids), kw.pop("text", None), kw.pop("reason", "length")),)
    return Observation(status, choices if status == 200 else (), 3, CachedTokens(cached), **kw)


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], []) is None


def test_a_changed_token_is_a_mismatch_naming_position_and_tokens() -> None:
    rec = _rec({"prompt": [1]}, line=17, reference=_obs([10, 11, 12, 13]))
    assert check(rec, 0.0, _obs([10, 11, 12, 13])).mismatch is None
    v = check(rec, 1.5, _obs([10, 11, 99, 13]))
    assert v.outputs_compared
    assert v.mismatch == Mismatch(17, "/v1/completions", 1.5, "tokens", "12", "99", 0, 2)
    assert v.mismatch.describe() == (
        "line 17 /v1/completions choice 0: output token 2 (0-based) differs: "
        "recorded 12, replayed 99"
    )
    short = check(rec, 0.0, _obs([10, 11])).mismatch
    assert short is not None and (short.position, short.expected, short.got) == (2, "12", "<end>")
    reason = check(rec, 0.0, _obs([10, 11, 12, 13], reason="stop")).mismatch
    assert reason is not None and reason.what == "finish_reason"
    texted = _rec({"prompt": [1]}, reference=_obs([1], text="a"))
    assert check(texted, 0, _obs([1], text="b")).mismatch is not None
    assert check(texted, 0, _obs([1], text=None)).mismatch is None  # redacted: ids only


def test_status_always_counts_and_cache_only_when_strict() -> None:
    rejected = _rec({"temperature": -1}, reference=_obs([], status=400))
    assert check(rejected, 0, _obs([], status=400)).mismatch is None
    v = check(rejected, 0, _obs([1, 2]))
    assert v.mismatch is not None and v.mismatch.describe().endswith("recorded 400, replayed 200")
    gone = check(rejected, 0, Observation(0, error="ClientConnectorError: refused"))
    assert gone.mismatch is not None and "no answer (ClientConnectorError" in gone.mismatch.got
    rec = _rec({"prompt": [1]}, reference=_obs([5], cached=8))
    v = check(rec, 0, _obs([5], cached=0))
    assert v.mismatch is None and v.cache is not None
    assert v.failed(strict_cache=False) is None and v.failed(strict_cache=True) is v.cache
    assert "(device 8, host 0, storage 0)" in v.cache.describe()


def test_only_greedy_and_seeded_outputs_are_compared() -> None:
    sampled = {"prompt": [1], "temperature": 0.7}
    assert not replays_exactly(_rec(sampled, sampling=({"temperature": 0.7},)))
    assert replays_exactly(_rec(sampled, seed=3, sampling=({"temperature": 0.7},)))
    assert replays_exactly(_rec({"prompt": [1]}))  # temperature absent: greedy
    assert replays_exactly(_rec({"prompt": [1], "temperature": 1e-6}))
    gen = {"input_ids": [1], "sampling_params": {"temperature": 0.5}}
    assert not replays_exactly(_rec(gen, "/generate"))
    unseeded = _rec(sampled, reference=_obs([1, 2]))
    v = check(unseeded, 0, _obs([3, 4]))
    assert not v.outputs_compared and v.mismatch is None
    assert check(_rec(sampled), 0, _obs([3])).mismatch is None  # no reference at all


# ---------------------------------------------------------------- figures


def test_percentiles_thresholds_and_staleness(tmp_path: Path) -> None:
    p = Percentiles.of([float(i) for i in range(1, 101)])
    assert p == Percentiles(100, 50.5, pytest.approx(90.1), pytest.approx(99.01))
    assert Percentiles.of([]) is None
    assert (parse_percent("10%"), parse_percent(" 2.5 ")) == (10.0, 2.5)
    for bad in ("ten", "-1%"):
        with pytest.raises(ValueError):
            parse_percent(bad)
    row = LatencyRow("TTFT", (0.010, 0.010, 0.010), (0.012, 0.012, 0.012))
    assert row.p50_change == pytest.approx(20.0)
    assert regressions([row], Thresholds(ttft_pct=25.0)) == ()
    (found,) = regressions([row], Thresholds(ttft_pct=10.0, e2e_pct=1.0))
    assert found == "TTFT p50 12.00 ms replayed vs 10.00 ms recorded: +20.0% (limit +10%)"
    rec = read_recording(write_records(tmp_path / "r.jsonl", sample_lines()))
    s = staleness(rec)  # predictions 0, 0, 4 (delivered 0), 0: one over-prediction of 4
    assert s.errors == (0, 0, -4, 0)
    assert (s.count, s.num_mispredicted, s.num_over, s.num_under) == (4, 1, 1, 0)
    assert s.mean_error == pytest.approx(-1.0) and s.mean_abs_error == pytest.approx(1.0)
    assert histogram([0, 0, -4]) == [["-4", 1], ["0", 2]]
    assert len(histogram(list(range(100)), max_bins=4)) == 4


# ---------------------------------------------------------------- the command


def _replay(path: Path, url: str, tmp_path: Path, *extra: str, plot: bool = True) -> int:
    return main(
        [
            "replay",
            str(path),
            "--url",
            url,
            "--speed",
            "4",
            "--disable-tqdm",
            "--report",
            str(tmp_path / "report.md"),
            *(["--plot", str(tmp_path / "report.png")] if plot else ["--no-plot"]),
            *extra,
        ]
    )


def test_the_command_passes_when_every_answer_matches(
    server: RuleServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_records(tmp_path / "r.jsonl", sample_lines())
    assert _replay(path, server.url, tmp_path) == 0
    out = capsys.readouterr().out
    assert "arm replay: 5 requests, 4 outputs compared, 0 mismatches" in out
    report = (tmp_path / "report.md").read_text()
    assert report.startswith(f"# Replay of `{path}`\n\n**PASS**")
    for section in ("## Latency (ms)", "## Cached tokens per tier", "## Index staleness"):
        assert section in report
    assert "mispredicted: 1 (1 over-predicted" in report
    assert (tmp_path / "report.png").stat().st_size > 10_000
    seeded = next(b for _, b in server.arrivals if b.get("temperature"))
    assert seeded["seed"] == 77
    streamed = next(b for _, b in server.arrivals if b.get("stream"))
    assert streamed["stream_options"] == {"include_usage": True}


def test_the_command_fails_naming_the_first_mismatch(
    server: RuleServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_records(tmp_path / "r.jsonl", sample_lines())
    server.perturb = True
    assert _replay(path, server.url, tmp_path) == 1
    err = capsys.readouterr().err
    first = rule_tokens([4, 5, 6, 7], 4)[2]  # line 3 arrived first
    assert (
        "arm replay: 4 of 5 requests differ from the recording; first: line 3 /v1/completions "
        f"choice 0: output token 2 (0-based) differs: recorded {first}, replayed {first + 1}"
    ) in err
    assert "**FAIL**" in (tmp_path / "report.md").read_text()


def test_the_command_fails_on_a_regression_or_a_strict_cache_difference(
    server: RuleServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = sample_lines()
    path = write_records(tmp_path / "r.jsonl", lines)
    # recorded gaps of 2 ms; the server streams a token every 5 ms
    assert _replay(path, server.url, tmp_path, "--max-itl-regression", "50%", plot=False) == 1
    assert "regression: ITL p50" in capsys.readouterr().err
    assert _replay(path, server.url, tmp_path, "--max-itl-regression", "1e5%", plot=False) == 0
    lines[1] = request_line(0.3, [1, 2, 3], stream=True, cached=2)
    path = write_records(tmp_path / "r.jsonl", lines)
    assert _replay(path, server.url, tmp_path, plot=False) == 0  # a cache difference passes
    assert _replay(path, server.url, tmp_path, "--strict-cache", plot=False) == 1
    assert "cached tokens differ: recorded (device 2" in capsys.readouterr().err


def test_a_mooncake_trace_is_sent_at_its_times_and_compares_nothing(
    server: RuleServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 512, "hash_ids": [1, 2]},
        {"timestamp": 200, "input_length": 1500, "output_length": 1024, "hash_ids": [1, 2, 3]},
        {"timestamp": 400, "input_length": 512, "output_length": 512, "hash_ids": [4]},
    ]
    trace.write_text("".join(orjson.dumps(r).decode() + "\n" for r in rows))
    code = _replay(
        trace, server.url, tmp_path, "--format", "mooncake", "--mooncake-block-size", "4"
    )
    assert code == 0, capsys.readouterr().err[-2000:]
    bodies = [b for _, b in server.arrivals]
    # 4 tokens per 512-token block, the partial third block scaled up; outputs likewise
    assert [len(b["prompt"]) for b in bodies] == [8, 12, 4]
    assert [b["max_tokens"] for b in bodies] == [4, 8, 4]
    assert bodies[1]["prompt"][:8] == bodies[0]["prompt"]  # the shared blocks
    assert bodies[2]["prompt"][:4] != bodies[0]["prompt"][:4]
    gaps = [b - a for (a, _), (b, _) in zip(server.arrivals, server.arrivals[1:], strict=False)]
    assert all(g > 0.02 for g in gaps)  # 200 ms apart in the trace, at --speed 4
    assert "0 outputs compared, 0 mismatches" in capsys.readouterr().out
