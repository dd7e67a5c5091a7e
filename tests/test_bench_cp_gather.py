"""benchmarks/bench_cp_gather.py runs (a CI smoke test: one CP2 world, one small prefix, one
round): both tables print, the gather with one buffer, two and the shm transport on a row
each, and the memory
figures, which do not depend on the machine, show a rank's rows at 1/N of a replicated
pool's plus one trash page and the total at the goal (1/N plus the two scratch buffers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_cp_gather.py"


def test_bench_cp_gather_smoke() -> None:
    args = ["--cp-sizes", "2", "--prefixes", "256", "--rounds", "1", "--layers", "2"]
    args += ["--timeout-s", "120"]
    run = subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=180
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    arms = [line.split("|")[0].split()[2:] for line in lines if line.startswith(" 2     256 ")]
    assert arms[:3] == [["1", "buffer"], ["2", "buffers"], ["shm"]]  # the gather table's rows
    memory = [line for line in lines if line.startswith(" 2     256 |")]
    assert len(memory) == 1
    # 256 + 128 tokens of page 16 and 2 pages spare: 26 pages; a rank holds 13 + 1 trash
    replicated, sharded, scratch, total, goal = map(float, memory[0].split("|")[1].split())
    assert abs(sharded / replicated - 14 / 26) < 0.01
    assert abs(total - (sharded + scratch)) < 0.011 and abs(total / goal - 1) < 0.05
