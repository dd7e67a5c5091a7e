"""`hicache-mesh bench`: the dataset, the summary math, and one run against a real mesh."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.bench.cli import ARM_FLAGS, Arm, arms_from_args, mesh_up_args, round_order
from services.bench.client import StreamState, http_error
from services.bench.dataset import GspConfig, generate_shared_prefix
from services.bench.records import CacheUsage, Disaggregation, RequestResult
from services.bench.report import (
    Spread,
    compare,
    compare_rounds,
    format_comparison,
    format_summary,
    summarize,
    summarize_rounds,
)
from services.cli import build_parser, main
from services.launch.servers import free_port
from services.launch.up import Mesh

# ---------------------------------------------------------------- dataset


def test_dataset_is_deterministic_for_a_seed() -> None:
    cfg = GspConfig(
        num_groups=3,
        prompts_per_group=2,
        system_prompt_len=20,
        question_len=5,
        output_len=4,
        num_turns=3,
        range_ratio=0.5,
        seed=7,
    )
    assert generate_shared_prefix(cfg) == generate_shared_prefix(cfg)
    other = generate_shared_prefix(GspConfig(**{**_fields(cfg), "seed": 8}))
    assert other != generate_shared_prefix(cfg)


def _fields(cfg: GspConfig) -> dict[str, Any]:
    return {name: getattr(cfg, name) for name in cfg.__dataclass_fields__}


def test_lengths_respect_the_range_ratio_and_ids_the_vocabulary() -> None:
    cfg = GspConfig(
        num_groups=8,
        prompts_per_group=4,
        system_prompt_len=40,
        question_len=10,
        output_len=8,
        num_turns=4,
        range_ratio=0.5,
        seed=1,
    )
    convs = generate_shared_prefix(cfg)
    assert len(convs) == 32
    sys_lens = {len(c.system_ids) for c in convs}
    q_lens = {len(q) for c in convs for q in c.question_ids}
    out_lens = {n for c in convs for n in c.output_lens}
    assert min(sys_lens) >= 20 and max(sys_lens) <= 40 and len(sys_lens) > 1
    assert min(q_lens) >= 5 and max(q_lens) <= 10 and len(q_lens) > 1
    assert min(out_lens) >= 4 and max(out_lens) <= 8
    assert all(0 <= t < 256 for c in convs for t in c.system_ids)
    exact = generate_shared_prefix(GspConfig(**{**_fields(cfg), "range_ratio": 1.0}))
    assert {len(c.system_ids) for c in exact} == {40}
    assert {len(q) for c in exact for q in c.question_ids} == {10}
    assert {n for c in exact for n in c.output_lens} == {8}


def test_turn_k_extends_turn_k_minus_1_with_its_answer() -> None:
    cfg = GspConfig(
        num_groups=1,
        prompts_per_group=1,
        system_prompt_len=6,
        question_len=3,
        output_len=2,
        num_turns=3,
    )
    (conv,) = generate_shared_prefix(cfg)
    answers = [[300, 301], [302, 303]]
    p1, p2, p3 = (conv.prompt(k, answers) for k in range(3))
    assert p1 == [*conv.system_ids, *conv.question_ids[0]]
    assert p2 == [*p1, 300, 301, *conv.question_ids[1]]
    assert p3 == [*p2, 302, 303, *conv.question_ids[2]]
    with pytest.raises(ValueError):
        conv.prompt(2, answers[:1])


def test_groups_share_the_system_prompt_and_different_groups_do_not() -> None:
    cfg = GspConfig(
        num_groups=2,
        prompts_per_group=3,
        system_prompt_len=32,
        question_len=8,
        output_len=4,
        num_turns=2,
    )
    convs = generate_shared_prefix(cfg)
    assert [c.group_id for c in convs] == [0, 0, 0, 1, 1, 1]
    assert len({c.system_ids for c in convs[:3]}) == 1
    assert len({c.system_ids for c in convs[3:]}) == 1
    assert convs[0].system_ids != convs[3].system_ids
    assert convs[0].question_ids != convs[1].question_ids  # only the system prompt is shared
    capped = generate_shared_prefix(GspConfig(**{**_fields(cfg), "num_prompts": 4}))
    assert [c.conversation_id for c in capped] == [0, 1, 2, 3]


# ---------------------------------------------------------------- stream and records


def _event(token_ids: list[int], usage: dict[str, object] | None = None) -> bytes:
    body: dict[str, object] = {"choices": [{"index": 0, "text": "", "token_ids": token_ids}]}
    if usage is not None:
        body["usage"] = usage
    return json.dumps(body).encode()


def test_stream_ttft_and_itl_divide_gaps_by_the_tokens_of_an_event() -> None:
    s = StreamState(sent_at=10.0)
    s.consume(_event([]), 10.1)  # carries no token: not the first token
    s.consume(_event([7]), 10.25)
    s.consume(_event([8, 9]), 10.45)
    s.consume(_event([]), 10.5)
    s.consume(_event([10], usage={"completion_tokens": 4}), 10.6)
    s.consume(b"[DONE]", 10.61)
    assert s.ttft == pytest.approx(0.25)
    assert s.itl == pytest.approx([0.1, 0.1, 0.15])
    assert s.token_ids == [7, 8, 9, 10]
    assert s.usage == {"completion_tokens": 4} and s.done and s.error is None
    bad = StreamState(sent_at=0.0)
    bad.consume(json.dumps({"error": {"message": "engine lost"}}).encode(), 1.0)
    assert bad.error == "engine lost"


def _result(arm: str, turn: int, ttft_ms: float, **kw: object) -> RequestResult:
    fields: dict[str, object] = {
        "arm": arm,
        "conversation": 0,
        "group": 0,
        "turn": turn,
        "prompt_len": 10,
        "output_len": 4,
        "start": 0.0,
        "ttft": ttft_ms / 1e3,
        "latency": 1.0,
    }
    return RequestResult(**{**fields, **kw})  # type: ignore[arg-type]


def _pd_usage(transferred: int, decode_device: int) -> dict[str, object]:
    return {
        "prompt_tokens_details": {
            "cached_tokens": 12,
            "cached_tokens_by_tier": {"device": 8, "host": 4},
        },
        "disaggregation": {
            "prefill_engine": "p0",
            "decode_engine": "d0",
            "decode_prefix_len": decode_device,
            "transferred_tokens": transferred,
            "transferred_bytes": transferred * 10,
            "prefill_cached_device": 8,
            "prefill_cached_host": 4,
            "prefill_cached_storage": 0,
            "decode_cached_device": decode_device,
            "decode_cached_host": 0,
        },
    }


def test_usage_parsing_with_and_without_the_pd_block() -> None:
    plain = CacheUsage.from_usage(
        {
            "prompt_tokens_details": {
                "cached_tokens": 12,
                "cached_tokens_by_tier": {"device": 8, "host": 4, "storage": 16},
            }
        }
    )
    assert plain == CacheUsage(12, 8, 4, None, 16)
    assert CacheUsage.from_usage(None) == CacheUsage()
    assert CacheUsage.from_usage({"prompt_tokens": 3}) == CacheUsage()
    pd = CacheUsage.from_usage(_pd_usage(transferred=20, decode_device=16))
    assert pd.disaggregation == Disaggregation("p0", "d0", 16, 20, 200, 8, 4, 16, 0)
    partial = Disaggregation.from_usage({"disaggregation": {"transferred_tokens": 5}})
    assert partial == Disaggregation(None, None, 0, 5, 0, 0, 0, 0, 0)
    record = _result("a", 1, 5.0, cache=pd, itl=(0.002, 0.004)).to_record()
    assert record["disaggregation"]["transferred_bytes"] == 200
    assert record["cached_tokens_by_tier"] == {"device": 8, "host": 4, "storage": 0}
    assert record["itl_mean"] == pytest.approx(0.003)
    json.dumps(record)


def test_summary_percentiles_and_throughput_are_exact() -> None:
    results = [
        _result("a", 1 + i % 2, float(i + 1), start=i * 0.1, itl=(0.001 * (i % 3 + 1),))
        for i in range(100)
    ]
    results.append(_result("a", 1, 9999.0, error="HTTP 500", output_len=0))
    s = summarize("a", results)
    assert (s.num_requests, s.num_failed) == (100, 1)
    assert s.ttft_ms is not None and s.itl_ms is not None
    assert s.ttft_ms.mean == pytest.approx(50.5)
    assert s.ttft_ms.median == pytest.approx(50.5)
    assert s.ttft_ms.p99 == pytest.approx(99.01)  # linear between the 99th and 100th
    assert s.itl_ms.median == pytest.approx(2.0)
    assert s.duration_s == pytest.approx(10.9)  # the last start (9.9 s) + 1 s
    assert s.output_tokens == 400
    assert s.output_throughput == pytest.approx(400 / 10.9)
    assert s.cached_decode is None and s.transferred_tokens is None
    assert "TTFT mean/median/p99 (ms)     50.50 / 50.50 / 99.01" in format_summary(s)


def test_comparison_percent_changes_are_exact() -> None:
    base = [
        _result("baseline", 1, ttft, cache=CacheUsage.from_usage(_pd_usage(100, 0)))
        for ttft in (10.0, 20.0, 60.0)
    ]
    tree = [
        _result("tree", 1, ttft, latency=0.8, cache=CacheUsage.from_usage(_pd_usage(25, 75)))
        for ttft in (5.0, 8.0, 47.0)
    ]
    sb, st = summarize("baseline", base), summarize("tree", tree)
    assert st.transferred_tokens == 75 and st.transferred_bytes == 750
    assert st.cached_decode is not None and st.cached_decode.device == 225
    assert st.cached_prefill.device == 24 and st.cached_prefill.host == 12
    c = compare(sb, st)
    assert c.median_ttft_change == pytest.approx(-60.0)  # 20 -> 8
    assert c.mean_ttft_change == pytest.approx(-33.333333)  # 30 -> 20
    assert c.transfer_reduction == pytest.approx(75.0)  # 300 -> 75
    assert c.throughput_change == pytest.approx(25.0)  # 12 tokens in 1 s -> in 0.8 s
    text = format_comparison(c)
    assert "-60.0%" in text and "75.0%" in text and "+25.0%" in text


# ---------------------------------------------------------------- rounds and failures


def test_rounds_rotate_which_arm_goes_first() -> None:
    assert [round_order(["a", "b"], k) for k in range(4)] == [["a", "b"], ["b", "a"]] * 2
    assert [round_order("abc", k) for k in range(3)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
    ]


def _rounds(arm: str, ttft_ms_by_round: list[list[float]], **kw: object) -> list[RequestResult]:
    return [
        _result(arm, 1, t, round=k, start=0.1 * i, **kw)
        for k, ttfts in enumerate(ttft_ms_by_round)
        for i, t in enumerate(ttfts)
    ]


def test_each_figure_is_over_all_rounds_with_its_spread_over_rounds() -> None:
    # three rounds whose load drifts up: every request of round k is slower
    a = summarize_rounds("a", _rounds("a", [[10.0, 20.0], [20.0, 40.0], [40.0, 80.0]]))
    assert len(a.rounds) == 3 and a.pooled.num_requests == 6
    assert a.pooled.ttft_ms is not None and a.pooled.ttft_ms.median == pytest.approx(30.0)
    median = a.spread(lambda r: None if r.ttft_ms is None else r.ttft_ms.median)
    assert median == Spread(15.0, 60.0, 3)
    # each round lasts 0.1 s + 1 s; throughput is all tokens over the summed durations
    assert a.pooled.duration_s == pytest.approx(3 * 1.1)
    assert a.pooled.output_throughput == pytest.approx(24 / 3.3)
    text = format_summary(a)
    assert "3 interleaved rounds; [min..max] of the per-round values" in text
    assert "TTFT mean/median/p99 (ms)     35.00 [15.00..60.00] / 30.00 [15.00..60.00]" in text
    assert "output tokens                 24 [8..8]" in text
    # arm b is 20% faster than a in every round: paired, the change has no spread to speak of
    b = summarize_rounds("b", _rounds("b", [[8.0, 16.0], [16.0, 32.0], [32.0, 64.0]]))
    c = compare_rounds(a, b)
    assert [x.median_ttft_change for x in c.rounds] == pytest.approx([-20.0] * 3)
    assert "median TTFT change            -20.0% [-20.0%..-20.0%]" in format_comparison(c)
    assert "over 3 rounds; [min..max] of the changes round by round" in format_comparison(c)
    single = summarize_rounds("a", _rounds("a", [[10.0, 20.0]]))
    assert "[" not in format_summary(single) and "rounds" not in format_summary(single)


def test_a_trace_bound_counts_once_per_round() -> None:
    results = _rounds(
        "a", [[1.0], [1.0]], cache=CacheUsage.from_usage(
            {"prompt_tokens_details": {"cached_tokens_by_tier": {"device": 30, "host": 0}}}
        ),
    )  # fmt: skip
    a = summarize_rounds("a", results, upper_bound=40)
    assert a.pooled.upper_bound == 80 and a.pooled.bound_ratio == pytest.approx(0.75)
    assert [r.bound_ratio for r in a.rounds] == pytest.approx([0.75, 0.75])
    assert "cached / upper bound          0.750 [0.750..0.750]" in format_summary(a)


def test_failures_are_counted_by_their_code_and_message() -> None:
    body = '{"error": {"message": "KV transfer timed out", "type": "x", "code": "kv_timeout"}}'
    assert http_error(504, body) == ("HTTP 504 kv_timeout", "KV transfer timed out")
    assert http_error(502, "<html>bad gateway</html>") == ("HTTP 502", "<html>bad gateway</html>")
    s = StreamState(sent_at=0.0)
    s.consume(json.dumps({"error": {"message": "lost", "code": "engine_crashed"}}).encode(), 1.0)
    assert (s.error_code, s.error) == ("stream error engine_crashed", "lost")
    timeout = {"error": "KV transfer timed out", "error_code": "HTTP 504 kv_timeout"}
    crashed = {"error": "lost", "error_code": "stream error engine_crashed"}
    results = [
        _result("a", 1, 5.0),
        *(_result("a", 1, 0.0, output_len=0, round=k, **timeout) for k in (0, 0, 1)),  # type: ignore[arg-type]
        _result("a", 1, 0.0, output_len=0, **crashed),  # type: ignore[arg-type]
    ]
    a = summarize_rounds("a", results)
    assert a.pooled.failures == (
        ("HTTP 504 kv_timeout: KV transfer timed out", 3),
        ("stream error engine_crashed: lost", 1),
    )
    text = format_summary(a)
    assert "requests                      1 (4 failed)" in text
    assert "      3 x HTTP 504 kv_timeout: KV transfer timed out\n" in text
    assert text.endswith("      1 x stream error engine_crashed: lost")
    assert _result("a", 1, 1.0).to_record()["round"] == 0


def bench_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *argv])


def test_arm_flags_extend_the_mesh_args() -> None:
    assert ARM_FLAGS["baseline"] == [] and ARM_FLAGS["colocated"] == []
    args = mesh_up_args(Arm("baseline", ("--engines", "2", "--page-size", "4", "--port", "9123")))
    assert (args.engines, args.page_size, args.port) == (2, 4, 9123)
    with pytest.raises(ValueError, match="unknown arm"):
        arms_from_args(bench_args("--arms", "nope"))


def test_arms_shorthand_expands_to_distinct_meshes() -> None:
    arms = arms_from_args(bench_args("--mesh-args", "--pd --page-size 4"))  # default arms
    assert arms == [
        Arm("baseline", ("--pd", "--page-size", "4")),
        Arm("tree", ("--pd", "--page-size", "4", "--disaggregation-decode-enable-radix-cache")),
    ]
    base, tree = (mesh_up_args(a) for a in arms)
    assert base.pd and tree.pd and base.page_size == tree.page_size == 4
    assert (
        base.disaggregation_decode_enable_radix_cache,
        tree.disaggregation_decode_enable_radix_cache,
    ) == (False, True)


def test_explicit_arms_carry_their_full_flags() -> None:
    args = bench_args("--arm", "small=--page-size 4", "--arm", "big= --page-size 16 --engines 2")
    arms = arms_from_args(args)
    assert arms == [
        Arm("small", ("--page-size", "4")),
        Arm("big", ("--page-size", "16", "--engines", "2")),
    ]
    assert [(a.page_size, a.engines) for a in map(mesh_up_args, arms)] == [(4, 1), (16, 2)]


@pytest.mark.parametrize(
    "argv",
    [
        # the README's P/D flags copied into --mesh-args: both arms get the tree flag (defect 12)
        [
            "--arms",
            "baseline,tree",
            "--mesh-args",
            "--pd --disaggregation-decode-enable-radix-cache",
        ],
        ["--arms", "baseline,colocated"],  # neither adds a flag
        # explicit arms that differ only in flag order, or in the port
        ["--arm", "a=--pd --page-size 4", "--arm", "b=--page-size 4 --pd"],
        ["--arm", "a=--port 9001", "--arm", "b=--port 9002"],
    ],
)
def test_two_arms_with_the_same_mesh_are_refused(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", *argv, "--disable-tqdm"]) == 2  # before any mesh starts
    err = capsys.readouterr().err
    assert "resolve to the same mesh" in err and "one setup against itself" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--arm", "a=--pd", "--arms", "baseline,tree"], "do not combine"),
        (["--arm", "a=--pd", "--mesh-args=--pd"], "do not combine"),
        (["--arm=--pd --page-size 4"], "expected NAME="),
        (["--arm", "a=--pd", "--arm", "a=--page-size 4"], "distinct names"),
        (["--arm", "a=--no-such-flag"], "was rejected"),
    ],
)
def test_malformed_arms_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------- against a real mesh


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    args = build_parser().parse_args(
        [
            "up",
            "--port",
            str(free_port()),
            "--model",
            "tiny",
            "--page-size",
            "4",
            "--max-total-tokens",
            "4096",
            "--heartbeat-interval",
            "0.2",
        ]
    )
    m = Mesh(args)
    m.start()
    yield m
    m.stop()


def test_bench_against_a_running_mesh(
    mesh: Mesh, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records_path, plot_path = tmp_path / "runs.jsonl", tmp_path / "ttft.png"
    code = main(
        [
            "bench",
            "--base-url",
            f"http://{mesh.args.host}:{mesh.args.port}",
            "--arm-name",
            "colocated",
            "--gsp-num-groups",
            "2",
            "--gsp-prompts-per-group",
            "2",
            "--gsp-system-prompt-len",
            "32",
            "--gsp-question-len",
            "8",
            "--gsp-output-len",
            "4",
            "--gsp-num-turns",
            "3",
            "--max-concurrency",
            "2",
            "--request-rate",
            "50",
            "--disable-tqdm",
            "--output-file",
            str(records_path),
            "--plot",
            str(plot_path),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    records = [json.loads(line) for line in records_path.read_text().splitlines()]
    assert len(records) == 3 * 12  # the default 3 rounds of the 12 requests
    assert [r["round"] for r in records] == [0] * 12 + [1] * 12 + [2] * 12
    assert all(r["error"] is None and r["arm"] == "colocated" for r in records)
    assert all(r["output_len"] == 4 and r["ttft"] > 0 and len(r["itl"]) == 3 for r in records)
    assert all(r["cached_tokens"] > 0 for r in records if r["turn"] > 1)
    by_key = {(r["round"], r["conversation"], r["turn"]): r for r in records}
    for (k, conv, turn), r in by_key.items():
        if turn > 1:  # question 8 + answer 4 more than the turn before
            assert r["prompt_len"] == by_key[(k, conv, turn - 1)]["prompt_len"] + 12
    # each round starts from a flushed cache: its first request hits nothing
    assert [by_key[(k, 0, 1)]["cached_tokens"] for k in range(3)] == [0, 0, 0]
    assert "arm: colocated" in out and "requests                      36 (0 failed)" in out
    assert "3 interleaved rounds; [min..max] of the per-round values" in out
    assert re.search(r"^output tokens\s+144 \[48\.\.48\]$", out, re.MULTILINE), out
    assert plot_path.stat().st_size > 0


@pytest.mark.parametrize("one_at_a_time", [False, True])
def test_two_mesh_arms_run_in_interleaved_rounds_and_a_failing_one_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], one_at_a_time: bool
) -> None:
    """Rounds A B then B A, the arms' meshes up at once (or each only for its turn); arm
    `short` serves a context of 40 tokens, so every first turn (system 32 + question 8, plus
    4 to generate) is refused."""
    records_path, plot_path = tmp_path / "runs.jsonl", tmp_path / "rounds.png"
    common = "--model tiny --page-size 4 --max-total-tokens 2048 --heartbeat-interval 0.2"
    code = main(
        [
            "bench",
            "--arm",
            f"full={common}",
            "--arm",
            f"short={common} --context-length 40",
            *("--gsp-num-groups", "2", "--gsp-prompts-per-group", "1"),
            *("--gsp-system-prompt-len", "32", "--gsp-question-len", "8"),
            *("--gsp-output-len", "4", "--gsp-num-turns", "2", "--num-rounds", "2"),
            *("--disable-tqdm", "--output-file", str(records_path), "--plot", str(plot_path)),
            *(["--one-mesh-at-a-time"] if one_at_a_time else []),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 1, out  # an arm had failed requests
    if one_at_a_time:  # started per turn: 4 starts, the memory of one mesh (shown once each)
        assert err.count("mesh up at") == 4 and err.count("meshes up: 1, RSS") == 2
    else:  # both up at once, started once, and what they hold together
        assert err.count("mesh up at") == 2 and "meshes up: 2, RSS" in err
    ran = [(r["arm"], r["round"]) for r in map(json.loads, records_path.read_text().splitlines())]
    order = [key for i, key in enumerate(ran) if i == 0 or ran[i - 1] != key]
    assert order == [("full", 0), ("short", 0), ("short", 1), ("full", 1)]
    assert ran.count(("full", 0)) == ran.count(("full", 1)) == 4  # 2 conversations x 2 turns
    assert ran.count(("short", 0)) == ran.count(("short", 1)) == 2  # turn 1 fails: no turn 2
    full, short = out.split(" arm: short ")
    assert "requests                      8 (0 failed)" in full
    assert "requests                      0 (4 failed)" in short
    assert re.search(r"^\s+4 x HTTP 400 context_length_exceeded: ", short, re.MULTILINE), short
    assert plot_path.stat().st_size > 0
