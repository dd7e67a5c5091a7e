"""One benchmark script, run from two source trees in interleaved rounds, side by side.

A restructure must not cost speed, and this machine is noisy (repeat runs of one tree move
by about +-20%), so the two trees are timed in one run, in rounds ordered A B, B A, A B, ...
so that a drift of the load hits both alike. Each run is a fresh process of
`<tree>/benchmarks/<script>` with the tree as its working directory and first on
`PYTHONPATH`, so each side imports its own `gpu_worker`, `services`, ... and runs its own
copy of the script. Figures are read from each run's output with `--metric` regular
expressions (named groups `case` and `value`); the table gives each side's median, the
spread (min-max) and the ratio ours / base.

    git worktree add --detach /tmp/base b0a9cde
    .venv/bin/python benchmarks/ab.py --base /tmp/base --rounds 2 \\
        --metric '^(?P<case>cold|device hit|host hit|L3 hit)\\s+\\d+\\s+\\d+\\s+\\d+\\s+(?P<value>[\\d.]+)' \\
        -- bench_ttft.py --prompt-len 4096 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

OURS = Path(__file__).resolve().parent.parent


def run_once(tree: Path, script: str, args: list[str]) -> str:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(tree / "benchmarks" / script), *args]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{script} failed in {tree} (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return done.stdout


def figures(text: str, metrics: list[tuple[str, re.Pattern[str]]]) -> dict[str, float]:
    """`{label case: value}` for every output line each metric matches (a case's first
    match wins)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        for label, pattern in metrics:
            m = pattern.search(line)
            if m is not None:
                case = " ".join(f"{label} {m['case']}".split())
                out.setdefault(case, float(m["value"]))
    return out


def parse_metric(text: str) -> tuple[str, re.Pattern[str]]:
    """`[LABEL::]REGEX`: LABEL prefixes the cases it finds (two figures of one row)."""
    label, _, regex = text.rpartition("::") if "::" in text else ("", "", text)
    pattern = re.compile(regex)
    if not {"case", "value"} <= set(pattern.groupindex):
        raise ValueError(f"--metric {text!r} needs named groups `case` and `value`")
    return label, pattern


def spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the tree compared with ours")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each tree")
    parser.add_argument(
        "--metric",
        action="append",
        required=True,
        help="[LABEL::]REGEX with groups `case` and `value`, matched against each output line",
    )
    parser.add_argument("--label", default="", help="what `value` measures, for the header")
    parser.add_argument("script", help="a script in benchmarks/ of both trees")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments (after --)")
    a = parser.parse_args()
    if a.rounds < 1:
        parser.error("--rounds must be >= 1")
    base = a.base.resolve()
    if not (base / "benchmarks" / a.script).is_file():
        parser.error(f"{base}/benchmarks/{a.script} does not exist")
    try:
        metrics = [parse_metric(m) for m in a.metric]
    except (ValueError, re.error) as e:
        parser.error(str(e))
    script_args = a.args[1:] if a.args[:1] == ["--"] else a.args
    seen: dict[str, dict[str, list[float]]] = {"ours": defaultdict(list), "base": defaultdict(list)}
    order = []
    for r in range(a.rounds):
        pair = [("ours", OURS), ("base", base)]
        order += pair if r % 2 == 0 else pair[::-1]
    for side, tree in tqdm(order, desc=a.script, unit="run"):
        for case, value in figures(run_once(tree, a.script, script_args), metrics).items():
            seen[side][case].append(value)
    cases = [c for c in seen["ours"] if c in seen["base"]]
    if not cases:
        sys.exit("no --metric matched a case in both trees' output")
    print(f"{a.script} {' '.join(script_args)}")
    print(f"ours {OURS.name} vs base {base}, {a.rounds} runs each (A B, B A, ...); {a.label}")
    print(f"{'case':36} {'ours med':>10} {'base med':>10} {'ours/base':>9}  ours range  base range")
    for case in cases:
        o, b = seen["ours"][case], seen["base"][case]
        mo, mb = statistics.median(o), statistics.median(b)
        ratio = f"{mo / mb:.3f}" if mb else "-"
        print(f"{case:36} {mo:10.2f} {mb:10.2f} {ratio:>9}  {spread(o):>10}  {spread(b):>10}")


if __name__ == "__main__":
    main()
