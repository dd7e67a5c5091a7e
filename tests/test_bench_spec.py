"""benchmarks/bench_spec.py and benchmarks/bench_spec_reuse.py run (CI smoke tests on the
`tiny` preset, one short round each, so the scripts keep working as the engine changes).

bench_spec: one row per arm (off, then each draft scheme) at batch 1, the speculative rows
with an acceptance length in [1, K + 1] and a verify round's time split into draft and
verify forwards. bench_spec_reuse: the script itself asserts that every arm's outputs equal
speculation-off's; here the speculative arms' hit/bound must equal off's (the same prompts,
the same forced restores) and every restore source's acceptance must be the cold run's
(tiny float64: the draft's restored rows are the cold run's exactly)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SOURCES = ("device", "host", "L3")


def run(script: str, args: list[str]) -> list[list[str]]:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    return [line.split() for line in done.stdout.splitlines()]


def test_bench_spec_smoke() -> None:
    args = ["--models", "tiny", "--batches", "1", "--rounds", "1", "--prompt-len", "16"]
    lines = run("bench_spec.py", [*args, "--new-tokens", "9", "--draft-quantization", "int8,none"])
    rows = [r for r in lines if r[:1] == ["tiny"]]
    assert [r[2] for r in rows] == ["off", "self", "self"]
    assert [r[3] for r in rows[1:]] == ["int8", "none"]
    for r in rows[1:]:
        bar = r.index("|")
        assert 1.0 <= float(r[bar - 2]) <= 5.0  # accept len, K = 4
        draft, verify, _ = map(float, r[bar + 1 :])
        assert draft > 0 and verify > 0


def test_bench_spec_reuse_smoke() -> None:
    args = ["--model", "tiny", "--conversations", "2", "--turns", "3", "--new-tokens", "9"]
    lines = run("bench_spec_reuse.py", args)
    assert any(r[-5:] == ["outputs", "equal", "in", "every", "arm"] for r in lines)
    names = ("off", "spec", "spec+L3")
    arms = {r[0]: r for r in lines if len(r) >= 7 and r[0] in names and r[1].isdigit()}
    assert arms["off"][5] == arms["spec"][5] == arms["spec+L3"][5]
    assert float(arms["off"][5]) > 0.5
    restores = [r for r in lines if len(r) == 7 and r[1] in SOURCES]
    assert {(r[0], r[1]) for r in restores} == {
        ("spec", "device"),
        ("spec", "host"),
        ("spec+L3", "device"),
        ("spec+L3", "host"),
        ("spec+L3", "L3"),
    }
    for r in restores:
        assert int(r[3]) > 0  # tokens restored from that source
        assert float(r[6]) == 1.0  # acceptance / cold
