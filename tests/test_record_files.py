"""The record file itself (issue 20, finding 3): created 0600 (an existing file tightened),
rotated past --record-max-bytes, a refused huge request bounded, token ids hashed or
dropped on request, and replay refusing a recording without ids with a clear message.
The traffic of a real mesh is in tests/test_keys_mesh.py."""

from __future__ import annotations

import stat
from array import array
from pathlib import Path
from typing import Any

import orjson
import pytest

from router.record import Recorder, header
from services.cli import main


def _request(
    status: int, body: Any, ids: list[int], out: list[int] | None = None
) -> dict[str, Any]:
    choices = [] if out is None else [{"output_ids": out, "text": "x", "finish_reason": "length"}]
    return {
        "type": "request",
        "time": 1.0,
        "endpoint": "/v1/completions",
        "status": status,
        "request": body,
        "input_ids": ids,
        "choices": choices,
        "error": None if status == 200 else "refused",
    }


REJECTED_LINE_BYTES = 1 << 20  # the bound of a refused request's line (router/record.py)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_the_file_is_created_0600_and_an_existing_one_tightened(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh.jsonl"
    Recorder(fresh, {"type": "header"}).close()
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o600
    old = tmp_path / "old.jsonl"
    old.write_bytes(b'{"type": "header"}\n')
    old.chmod(0o644)
    Recorder(old, {"type": "header"}).close()
    assert stat.S_IMODE(old.stat().st_mode) == 0o600
    assert len(_lines(old)) == 2  # appended to, not replaced


def test_the_file_rotates_past_its_cap_and_keeps_its_backups(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    first = {"type": "header", "n": 0}
    recorder = Recorder(path, first, max_bytes=64 * 1024, backups=2)
    for i in range(400):  # ~1 KB each: about 6 files' worth
        recorder.write(_request(200, {"max_tokens": i}, list(range(200)), [i]))
    recorder.close()
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == ["r.jsonl", "r.jsonl.1", "r.jsonl.2"]  # .3 dropped
    seen = []
    for f in (path.with_name("r.jsonl.2"), path.with_name("r.jsonl.1"), path):
        assert f.stat().st_size <= 64 * 1024
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
        lines = _lines(f)
        assert lines[0] == first  # every file starts with the header
        seen += [line["request"]["max_tokens"] for line in lines[1:]]
    assert seen == list(range(seen[0], 400))  # the newest records, in order, none lost
    assert seen[0] > 0


def test_a_refused_huge_request_writes_a_bounded_line(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    recorder = Recorder(path, {"type": "header"})
    huge = "y" * (30 << 20)
    recorder.write(_request(400, {"prompt": huge}, array("I", bytes(4 << 20)).tolist()))
    recorder.write(_request(200, {"prompt": "small"}, [1, 2], [3]))
    recorder.close()
    _, refused, served = _lines(path)
    assert path.stat().st_size < REJECTED_LINE_BYTES
    assert refused["request"] is None and refused["input_ids"] == []
    assert refused["omitted_bytes"] > REJECTED_LINE_BYTES and refused["status"] == 400
    assert served["request"] == {"prompt": "small"}  # bounded: refused requests only


def test_token_ids_hashed_or_dropped_and_replay_refuses_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = [list(range(10, 42)), list(range(10, 26)) + [7] * 16]  # first 4 pages equal
    out = {}
    for mode in ("hash", "drop"):
        path = tmp_path / f"{mode}.jsonl"
        recorder = Recorder(path, header({}, [], False, mode), token_ids=mode, page_size=4)
        for ids in prompts:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
            recorder.write(_request(200, body, ids, [5, 6]))
        recorder.close()
        head, *records = _lines(path)
        assert head["token_ids"] == mode
        for rec in records:
            assert rec["input_ids"] is None and rec["input_len"] == 32
            assert "input_ids" not in rec["request"]
            assert rec["choices"][0]["output_ids"] is None and rec["choices"][0]["output_len"] == 2
        out[mode] = records
    a, b = (r["input_page_hashes"] for r in out["hash"])
    assert len(a) == 8 and a[:4] == b[:4] and a[4] != b[4]  # a shared prefix still shows
    assert (
        out["hash"][0]["choices"][0]["output_hash"] == out["hash"][1]["choices"][0]["output_hash"]
    )
    assert "input_page_hashes" not in out["drop"][0]
    for mode in ("hash", "drop"):
        path = tmp_path / f"{mode}.jsonl"
        code = main(["replay", str(path), "--url", "http://127.0.0.1:9", "--no-plot"])
        err = capsys.readouterr().err
        assert code == 2
        assert f"{path}:1: recorded with --record-token-ids {mode}: it holds no token ids" in err
