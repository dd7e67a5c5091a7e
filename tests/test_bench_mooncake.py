"""`hicache-mesh bench --dataset-name mooncake`: the trace reader, the upper bound of cached
tokens against a brute force, and a few hundred trace requests through a real mesh."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from services.bench.conversation_trace import ConversationTraceConfig, generate, write
from services.bench.conversation_trace import main as trace_main
from services.bench.mooncake import (
    TraceFormatError,
    block_ids,
    read_mooncake,
    upper_bound,
    upper_bound_per_request,
)
from services.bench.records import CacheUsage, RequestResult
from services.bench.report import format_summary, summarize
from services.cli import main

BLOCK = 16  # tokens per hash id in these tests (the trace itself counts 512)


def write_trace(path: Path, lines: Sequence[dict[str, Any] | str]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def line(
    timestamp: Any, hash_ids: list[int], input_length: int, output_length: int = 64
) -> dict[str, Any]:
    """One trace line (any timestamp: the bad-line cases pass a string)."""
    return {
        "timestamp": timestamp,
        "input_length": input_length,
        "output_length": output_length,
        "hash_ids": hash_ids,
    }


def synthetic_trace(num_requests: int, seed: int = 0) -> list[dict[str, Any]]:
    """A Mooncake-like trace (512-token blocks): sessions that grow turn by turn from a few
    shared system prompts, one-off requests, exact repeats; partial last blocks."""
    rng = random.Random(seed)
    next_id = 0

    def new_ids(n: int) -> list[int]:
        nonlocal next_id
        next_id += n
        return list(range(next_id - n, next_id))

    systems = [new_ids(rng.randint(1, 3)) for _ in range(4)]
    sessions: list[list[int]] = []
    lines: list[dict[str, Any]] = []
    t_ms = 0
    for _ in range(num_requests):
        kind = rng.random()
        if lines and kind < 0.05:  # an earlier request again
            ids = list(rng.choice(lines)["hash_ids"])
        elif sessions and kind < 0.5:  # the next turn of a session
            i = rng.randrange(len(sessions))
            ids = sessions[i] = sessions[i] + new_ids(rng.randint(1, 2))
            if len(ids) >= 8:
                sessions.pop(i)
        elif kind < 0.85:  # a new session on a shared system prompt
            ids = rng.choice(systems) + new_ids(rng.randint(1, 2))
            sessions.append(ids)
        else:  # a one-off
            ids = new_ids(rng.randint(1, 3))
        tail = rng.choice([512, rng.randint(1, 511)])
        lines.append(line(t_ms, ids, 512 * (len(ids) - 1) + tail, rng.randint(1, 64)))
        t_ms += rng.randint(0, 8)
    return lines


def common_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------- the reader


@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    return write_trace(
        tmp_path / "small.jsonl",
        [
            line(1000, [1, 2, 3], 1500, output_length=100),  # 16 + 16 + ceil(476 / 32) = 47
            line(1000, [1, 2, 4], 1536),  # 48
            line(2500, [1, 5], 600, output_length=0),  # 16 + ceil(88 / 32) = 19
            "",
            line(1200.5, [1, 2, 3], 1025, output_length=1),  # 33: a prefix of the first
            line(3000, [7], 512),  # 16
            line(3500, [7], 512),  # the same again: all but its last token are cached
        ],
    )


def test_prompts_are_blocks_of_their_hash_ids(small_trace: Path) -> None:
    reqs = read_mooncake(small_trace, BLOCK, 256, seed=3)
    assert [r.line for r in reqs] == [1, 2, 5, 3, 6, 7]  # by timestamp, file order among equal
    assert [r.arrival_s for r in reqs] == [0.0, 0.0, pytest.approx(0.2005), 1.5, 2.0, 2.5]
    assert [r.input_len for r in reqs] == [47, 48, 33, 19, 16, 16]
    assert [r.output_len for r in reqs] == [4, 2, 1, 1, 2, 2]  # ceil(out * 16 / 512), >= 1
    first, second, prefix, other, alone, again = reqs
    assert again.input_ids == alone.input_ids

    def block(h: int) -> list[int]:
        return list(block_ids(h, BLOCK, 256, 3))

    assert list(first.input_ids) == block(1) + block(2) + block(3)[:15]
    assert list(second.input_ids) == block(1) + block(2) + block(4)
    assert list(prefix.input_ids) == list(first.input_ids[:33])
    assert list(other.input_ids) == block(1) + block(5)[:3]
    assert all(0 <= t < 256 for r in reqs for t in r.input_ids)
    # different ids are different blocks: shared prompts end inside the first differing block
    assert BLOCK * 2 <= common_len(first.input_ids, second.input_ids) < BLOCK * 3
    assert BLOCK <= common_len(first.input_ids, other.input_ids) < BLOCK * 2
    assert common_len(first.input_ids, alone.input_ids) < BLOCK
    ids = [1, 2, 3, 4, 5, 7, 10**12]
    assert len({tuple(block(h)) for h in ids}) == len(ids)


def test_blocks_are_deterministic_per_seed_and_size(small_trace: Path) -> None:
    a, b = read_mooncake(small_trace, BLOCK, 256, 3), read_mooncake(small_trace, BLOCK, 256, 3)
    assert [r.input_ids for r in a] == [r.input_ids for r in b]
    c = read_mooncake(small_trace, BLOCK, 256, 4)
    assert all(x.input_ids != y.input_ids for x, y in zip(a, c, strict=True))
    assert block_ids(9, 8, 50, 1) == block_ids(9, 8, 50, 1)
    assert max(block_ids(9, 1000, 50, 1)) < 50
    assert [r.line for r in read_mooncake(small_trace, BLOCK, 256, 3, num_prompts=3)] == [1, 2, 5]
    # at 512 the trace is taken as written
    full = read_mooncake(small_trace, 512, 256, 3)
    assert [r.input_len for r in full] == [1500, 1536, 1025, 600, 512, 512]
    assert [r.output_len for r in full] == [100, 64, 1, 1, 64, 64]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", ":2: not JSON"),
        ('{"timestamp": 1, "input_length": 10, "output_length": 1}', ":2: missing hash_ids"),
        (json.dumps(line(5, [1, 2], 512)), ":2: 2 hash_ids for input_length 512"),
        (json.dumps(line(5, [1], 513)), ":2: 1 hash_ids for input_length 513"),
        (json.dumps(line(5, [-1], 10)), ":2: hash_ids must be a list of integers >= 0"),
        (json.dumps(line(5, [1], 0)), ":2: input_length must be an integer >= 1"),
        (json.dumps(line("5", [1], 10)), ":2: timestamp must be a number"),
        ("[1, 2]", ":2: expected a JSON object"),
    ],
)
def test_a_bad_line_is_named(tmp_path: Path, text: str, message: str) -> None:
    path = write_trace(tmp_path / "bad.jsonl", [line(0, [1], 10), text])
    with pytest.raises(TraceFormatError, match=re.escape(f"{path}{message}")):
        read_mooncake(path, BLOCK)


def test_the_cli_refuses_a_bad_trace_before_any_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = write_trace(tmp_path / "empty.jsonl", ["", "  "])
    bad = write_trace(tmp_path / "bad.jsonl", [line(0, [1, 2], 10)])
    base = ["bench", "--base-url", "http://127.0.0.1:9", "--dataset-name", "mooncake"]
    assert main([*base, "--dataset-path", str(empty)]) == 2
    assert "no requests in the trace" in capsys.readouterr().err
    assert main([*base, "--dataset-path", str(bad)]) == 2
    assert f"{bad}:1: 2 hash_ids for input_length 10" in capsys.readouterr().err
    assert main(base) == 2
    assert "needs --dataset-path" in capsys.readouterr().err
    trace = ["--dataset-path", str(write_trace(tmp_path / "ok.jsonl", [line(0, [1], 10)]))]
    assert main([*base, *trace, "--use-trace-timestamps", "--request-rate", "5"]) == 2
    assert "exclude each other" in capsys.readouterr().err
    assert main(["bench", "--base-url", "http://127.0.0.1:9", *trace]) == 2  # gsp + a path
    assert "need --dataset-name mooncake" in capsys.readouterr().err
    mooncake = ["--dataset-name", "mooncake", *trace]
    assert main(["bench", "--arm", "a=--page-size 4", *mooncake, "--bound-page-size", "4"]) == 2
    assert "--bound-page-size is for --base-url" in capsys.readouterr().err


def test_the_summary_shows_the_bound_beside_the_cached_tokens() -> None:
    usage = {"prompt_tokens_details": {"cached_tokens_by_tier": {"device": 30, "host": 9}}}
    results = [
        RequestResult("a", i, 0, 1, 40, 2, 0.0, 0.01, 0.02, cache=CacheUsage.from_usage(usage))
        for i in range(2)
    ]
    text = format_summary(summarize("a", results, upper_bound=80))
    assert "cached on prefill (tokens)    78 (device 60, host 18)" in text
    assert "cached upper bound (tokens)   80" in text
    assert "cached / upper bound          0.975" in text
    assert "cached / upper bound          -" in format_summary(summarize("a", results, 0))
    assert "upper bound" not in format_summary(summarize("a", results))


# ---------------------------------------------------------------- the upper bound


def brute_force_bound(prompts: Sequence[Sequence[int]], page_size: int) -> int:
    """Per prompt: the most whole pages k, short of its last token, such that its first k
    pages are the first k pages of an earlier prompt (which holds k whole pages)."""
    total = 0
    for i, p in enumerate(prompts):
        for k in range((len(p) - 1) // page_size, 0, -1):
            n = k * page_size
            if any(len(q) >= n and list(q[:n]) == list(p[:n]) for q in prompts[:i]):
                total += n
                break
    return total


def test_the_bound_of_a_small_trace_is_exact(small_trace: Path) -> None:
    reqs = read_mooncake(small_trace, BLOCK, 256, 3)
    # in order first, second, prefix, other, alone, again: second shares blocks 1, 2 (32);
    # prefix is first[:33], all but its last token (32); other shares block 1 (16); again
    # is alone's 16 tokens, all but the last one, in whole pages
    assert upper_bound_per_request(reqs, 4) == [0, 32, 32, 16, 0, 12]
    assert upper_bound_per_request(reqs, 16) == [0, 32, 32, 16, 0, 0]
    assert upper_bound_per_request(reqs, 5) == [0, 30, 30, 15, 0, 15]
    assert upper_bound_per_request(reqs, 32) == [0, 32, 32, 0, 0, 0]
    assert upper_bound(reqs, 4) == 92


@pytest.mark.parametrize("page_size", [1, 4, 5, 16, 32])
def test_the_bound_equals_a_brute_force(tmp_path: Path, page_size: int) -> None:
    path = write_trace(tmp_path / "trace.jsonl", synthetic_trace(300))
    reqs = read_mooncake(path, BLOCK, 256, seed=1)
    expected = brute_force_bound([r.input_ids for r in reqs], page_size)
    assert 0 < expected < sum(r.input_len for r in reqs)
    assert upper_bound(reqs, page_size) == expected


# ---------------------------------------------------------------- through a real mesh


def _row(out: str, name: str) -> str:
    m = re.search(rf"^{re.escape(name)}\s+(.*)$", out, re.MULTILINE)
    assert m is not None, out
    return m.group(1)


def test_bench_reaches_the_upper_bound_with_room_for_the_working_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Acceptance: 300 trace requests through `bench` at their timestamps, on a mesh whose
    device pool holds about a tenth of the working set and whose host pool all of it."""
    path = write_trace(tmp_path / "trace.jsonl", synthetic_trace(300))
    records = tmp_path / "records.jsonl"
    reqs = read_mooncake(path, BLOCK, 256, seed=1)
    page_size = 4
    expected = brute_force_bound([r.input_ids for r in reqs], page_size)
    working_set = len({h for r in reqs for h in r.hash_ids}) * BLOCK  # + partial pages, outputs
    device_tokens, host_tokens = 1024, 32 * 1024
    assert device_tokens < working_set / 5 and host_tokens > 2 * working_set
    up = (
        f"--model tiny --page-size {page_size} --max-total-tokens {device_tokens} "
        f"--enable-hierarchical-cache --hicache-ratio {host_tokens // device_tokens} "
        "--heartbeat-interval 0.2"
    )
    code = main(
        [
            "bench",
            "--arm",
            f"hicache={up}",
            "--dataset-name",
            "mooncake",
            "--dataset-path",
            str(path),
            "--mooncake-block-size",
            str(BLOCK),
            "--use-trace-timestamps",
            "--max-concurrency",
            "1",
            "--num-rounds",
            "1",  # the bound is the question here, not the spread (tests/test_bench.py)
            "--disable-tqdm",
            "--output-file",
            str(records),
        ]
    )
    out = capsys.readouterr().out
    print(out)  # shown with -s
    assert code == 0, out
    assert _row(out, "requests") == "300 (0 failed)"
    assert _row(out, "cached upper bound (tokens)") == str(expected)
    m = re.fullmatch(r"(\d+) \(device (\d+), host (\d+)\)", _row(out, "cached on prefill (tokens)"))
    assert m is not None, out
    cached, device, host = map(int, m.groups())
    assert cached >= 0.98 * expected, out
    assert device > 0 and host > 0, out
    assert float(_row(out, "cached / upper bound")) == pytest.approx(cached / expected, abs=1e-3)
    by_id = sorted(
        (json.loads(x) for x in records.read_text().splitlines()), key=lambda r: r["conversation"]
    )
    assert [(r["prompt_len"], r["output_len"]) for r in by_id] == [
        (q.input_len, q.output_len) for q in reqs
    ]
    assert sum(r["cached_tokens"] for r in by_id) == cached
    # sent in trace order, none before its timestamp
    assert all(r["start"] >= q.arrival_s for r, q in zip(by_id, reqs, strict=True))
    assert [r["start"] for r in by_id] == sorted(r["start"] for r in by_id)


# ---------------------------------------------------------------- the conversation trace


def test_the_conversation_trace_is_seeded_chained_and_readable(tmp_path: Path) -> None:
    small = ConversationTraceConfig(num_conversations=12, turns=4, active=3, seed=5)
    lines = generate(small)
    assert lines == generate(small) and lines != generate(dataclasses.replace(small, seed=6))
    assert len(lines) == 12 * 4
    shared = list(range(small.shared_prefix_blocks))
    chains: dict[int, list[int]] = {}  # first own block -> the conversation's last prompt
    last: dict[int, int] = {}  # first own block -> index of its last request
    gaps = []
    for i, line in enumerate(lines):
        ids = list(line["hash_ids"])  # type: ignore[call-overload]
        assert ids[: len(shared)] == shared  # the hot prefix opens every prompt
        own = ids[len(shared)]
        prev = chains.get(own)
        if prev is not None:  # a later turn: the previous prompt's blocks, then new ones
            lo, hi = small.turn_blocks
            assert ids[: len(prev)] == prev and lo <= len(ids) - len(prev) <= hi
            gaps.append(i - last[own])
        chains[own] = ids
        last[own] = i
    assert len(chains) == 12
    assert max(gaps) > 1  # other conversations' turns come between two of one
    path = tmp_path / "trace.jsonl"
    assert trace_main(["--output", str(path), "--num-conversations", "12", "--turns", "4",
                       "--active", "3", "--seed", "5"]) == 0  # fmt: skip
    reqs = read_mooncake(path, BLOCK)  # a Mooncake trace: every line checks
    assert [list(r.hash_ids) for r in reqs] == [line["hash_ids"] for line in lines]
    assert trace_main(["--output", str(path), "--turn-blocks", "3", "1"]) == 2


def test_rounds_with_their_own_salt_read_nothing_an_earlier_round_stored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two rounds of a small conversation trace on a mesh with a store. The flush between
    rounds keeps the store, so round 2 would read what round 1 wrote; with
    `--cache-salt-per-round` each round caches and reads only its own pages."""
    path = tmp_path / "trace.jsonl"
    write(generate(ConversationTraceConfig(num_conversations=3, turns=2, active=3)), str(path))

    def first_requests(flags: list[str]) -> list[int]:
        records = tmp_path / "records.jsonl"
        store = tmp_path / f"store{len(flags)}"
        up = (
            "--model tiny --page-size 4 --enable-hierarchical-cache "
            f"--hicache-storage-backend file --hicache-storage-dir {store} "
            "--hicache-storage-prefetch-policy wait_complete --heartbeat-interval 0.2"
        )
        code = main(
            ["bench", "--arm", f"l3={up}", "--dataset-name", "mooncake", "--dataset-path",
             str(path), "--mooncake-block-size", str(BLOCK), "--max-concurrency", "1",
             "--num-rounds", "2", "--warmup-requests", "0", "--disable-tqdm",
             "--output-file", str(records), *flags]
        )  # fmt: skip
        assert code == 0, capsys.readouterr().out
        rows = [json.loads(x) for x in records.read_text().splitlines()]
        return [r["cached_tokens_by_tier"]["storage"] for r in rows if r["conversation"] == 0]

    assert first_requests([])[1] > 0  # round 2's first request read round 1's pages
    assert first_requests(["--cache-salt-per-round"]) == [0, 0]
