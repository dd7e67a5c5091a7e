"""Rank consensus records, and finding the first one on which ranks differ (torch-free).

Shared by the checker's side thread (live) and `hicache-mesh consensus DIR` (offline, from
the per-rank logs `DIR/rank{N}.jsonl` the checker writes).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

KINDS = ("call order", "parameters", "results")


@dataclass(frozen=True, slots=True)
class Record:
    call: str
    params: str
    results: str

    def digests(self) -> tuple[int, int, int]:
        return digest(self.call), digest(self.params), digest(self.results)


@dataclass(frozen=True, slots=True)
class Divergence:
    index: int  # the first unequal record, counted from 0 in logical order
    kind: str  # one of KINDS
    entries: dict[str, Record]  # rank label -> that rank's record at `index`

    def report(self) -> str:
        lines = [f"Found rank divergence at entry {self.index}: the {self.kind} differ"]
        for label, rec in self.entries.items():
            lines.append(f"  {label}: {rec.call} params={rec.params} results={rec.results}")
        return "\n".join(lines)


def digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def first_divergence(records: Mapping[str, Sequence[Record]]) -> Divergence | None:
    """The first index at which the ranks' records differ (over the indices all hold)."""
    common = min(len(r) for r in records.values())
    for i in range(common):
        entries = {label: recs[i] for label, recs in records.items()}
        kind = kind_of(list(entries.values()))
        if kind is not None:
            return Divergence(i, kind, entries)
    return None


def kind_of(entries: list[Record]) -> str | None:
    for kind, attr in zip(KINDS, ("call", "params", "results"), strict=True):
        if len({getattr(e, attr) for e in entries}) > 1:
            return kind
    return None


def load_logs(log_dir: Path) -> dict[str, list[Record]]:
    """Every rank's records from `log_dir` (rank label -> records in logical order)."""
    files = sorted(log_dir.glob("rank*.jsonl"), key=lambda p: int(p.stem[4:] or 0))
    if not files:
        raise ValueError(f"no rank*.jsonl consensus logs in {log_dir}")
    logs: dict[str, list[Record]] = {}
    for path in files:
        lines = path.read_text().splitlines()
        if not lines:
            raise ValueError(f"{path} is empty")
        label = json.loads(lines[0]).get("label", path.stem)
        records = []
        for n, line in enumerate(lines[1:], start=2):
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                if n == len(lines):  # a rank that died mid-write: its last line is cut
                    break
                raise ValueError(f"{path}:{n} is not a JSON line") from None
            records.append(Record(entry["call"], entry["params"], entry["results"]))
        logs[label] = records
    return logs


def report_dir(log_dir: Path) -> tuple[str, bool]:
    """The report `hicache-mesh consensus DIR` prints, and whether ranks diverged."""
    logs = load_logs(log_dir)
    counts = ", ".join(f"{label}: {len(r)}" for label, r in logs.items())
    found = first_divergence(logs)
    if found is None:
        common = min(len(r) for r in logs.values())
        return f"No rank divergence in the {common} entries every rank holds ({counts})", False
    return f"{found.report()}\nentries per rank: {counts}", True
