"""The rank consensus checker's pieces that need no world: the decorator when off, the
selectors, finding and classifying the first divergence, and the offline report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_worker.consensus import checker
from gpu_worker.consensus.records import Record, first_divergence, load_logs, report_dir


def test_off_the_decorator_returns_the_function_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(checker.ENV, raising=False)

    def decide(n: int) -> int:
        return n

    assert checker.rank_consensus(same_params=["n"])(decide) is decide
    # and the engine's decisions, imported without the variable, are the plain functions
    from gpu_worker.cache.hicache import PrefixCache
    from gpu_worker.scheduler.scheduler import Scheduler

    assert not hasattr(PrefixCache.match, "__wrapped__")
    assert not hasattr(Scheduler.consume_acks, "__wrapped__")


def test_on_it_records_selected_params_and_results(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(checker.ENV, "1")

    class Recorder:
        def __init__(self) -> None:
            self.calls: list[tuple[str, str, str]] = []

        def record(self, call: str, params: str, results: str) -> None:
            self.calls.append((call, params, results))

    @checker.rank_consensus(same_params=["len(ids)", "salt"], same_results=["result[0]"])
    def match(ids: list[int], salt: str = "") -> tuple[int, object]:
        return len(ids) // 2, object()  # an object repr would differ between ranks

    rec = Recorder()
    checker.attach(rec)  # type: ignore[arg-type]
    try:
        match([1, 2, 3, 4])
        match([1], salt="u")
    finally:
        checker.attach(None)
    name = match.__qualname__
    assert rec.calls == [(name, "4; ''", "2"), (name, "1; 'u'", "0")]


def test_first_divergence_names_the_entry_and_its_kind() -> None:
    same = [Record("consume_acks", "1", ""), Record("match", "8", "4")]
    assert first_divergence({"a": same, "b": same}) is None
    cases = {
        "call order": Record("alloc", "8", "4"),
        "parameters": Record("match", "9", "4"),
        "results": Record("match", "8", "5"),
    }
    for kind, other in cases.items():
        found = first_divergence({"a": same, "b": [same[0], other, Record("x", "", "")]})
        assert found is not None and found.index == 1 and found.kind == kind
        assert found.entries["b"] == other
        assert found.report().startswith(f"Found rank divergence at entry 1: the {kind} differ")
    # only entries every rank holds are compared: a rank that is behind is not a divergence
    assert first_divergence({"a": same, "b": same[:1]}) is None


def write_log(path: Path, label: str, records: list[Record], cut: bool = False) -> None:
    lines = [json.dumps({"rank": 0, "label": label})]
    for i, r in enumerate(records):
        lines.append(json.dumps({"i": i, "call": r.call, "params": r.params, "results": r.results}))
    text = "\n".join(lines) + "\n"
    path.write_text(text[:-20] if cut else text)  # cut: a rank that died mid-write


def test_offline_report_from_rank_logs(tmp_path: Path) -> None:
    ok = [Record("consume_acks", "0", ""), Record("alloc", "2", "[0, 1]")]
    write_log(tmp_path / "rank0.jsonl", "rank0 PP0/TP0", ok)
    write_log(tmp_path / "rank1.jsonl", "rank1 PP1/TP0", ok, cut=True)
    assert [len(r) for r in load_logs(tmp_path).values()] == [2, 1]
    text, diverged = report_dir(tmp_path)
    assert not diverged and text.startswith("No rank divergence in the 1 entries")
    write_log(tmp_path / "rank1.jsonl", "rank1 PP1/TP0", [ok[0], Record("alloc", "2", "[0, 2]")])
    cli = [sys.executable, "-m", "services.cli", "consensus", str(tmp_path)]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stdout.splitlines()[:3] == [
        "Found rank divergence at entry 1: the results differ",
        "  rank0 PP0/TP0: alloc params=2 results=[0, 1]",
        "  rank1 PP1/TP0: alloc params=2 results=[0, 2]",
    ]
    empty = subprocess.run([*cli[:-1], str(tmp_path / "none")], capture_output=True, text=True)
    assert empty.returncode == 2 and "no rank*.jsonl" in empty.stderr
