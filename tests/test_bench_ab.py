"""benchmarks/ab.py: two trees' runs of one benchmark, interleaved, read by regex.

Runs the real script end to end on a trivial benchmark planted in two temporary trees (one
prints larger figures), so the side-by-side table, the medians and the ratio are checked
without timing anything.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

AB = Path(__file__).resolve().parent.parent / "benchmarks" / "ab.py"


def plant(tree: Path, value: float) -> None:
    (tree / "benchmarks").mkdir(parents=True)
    script = "import sys\nprint('noise 1 2 3')\nprint(f'case one  {%r * int(sys.argv[1])}')\n"
    (tree / "benchmarks" / "fig.py").write_text(script % value)


def test_ab_reports_medians_and_the_ratio(tmp_path: Path) -> None:
    ours, base = tmp_path / "ours", tmp_path / "base"
    plant(base, 4.0)
    plant(ours, 1.0)  # ab.py runs "ours" from its own tree: plant a copy of it there too
    (ours / "benchmarks" / "ab.py").write_text(AB.read_text())
    cmd = [sys.executable, str(ours / "benchmarks" / "ab.py"), "--base", str(base)]
    cmd += ["--rounds", "3", "--metric", r"^(?P<case>case \w+)\s+(?P<value>[\d.]+)", "fig.py"]
    done = subprocess.run([*cmd, "--", "2"], capture_output=True, text=True, check=True)
    row = next(line for line in done.stdout.splitlines() if line.startswith("case one"))
    assert row.split()[2:5] == ["2.00", "8.00", "0.250"], done.stdout


@pytest.mark.parametrize(
    "metric, error",
    [(r"(?P<case>\w+)", "needs named groups"), ("(", "missing )")],
)
def test_ab_refuses_a_metric_it_cannot_read(tmp_path: Path, metric: str, error: str) -> None:
    plant(tmp_path, 1.0)
    cmd = [sys.executable, str(AB), "--base", str(tmp_path), "--metric", metric, "fig.py"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 2 and error in done.stderr, done.stderr
