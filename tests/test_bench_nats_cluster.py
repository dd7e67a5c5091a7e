"""benchmarks/bench_nats_cluster.py runs (a CI smoke test: the bus part only, one short round):
a row per arm with positive latencies, and a bus failover timed within the bound."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_nats_cluster.py"


def test_bench_nats_cluster_smoke() -> None:
    argv = [sys.executable, str(SCRIPT), "--no-e2e", "--rounds", "1", "--per-round", "20"]
    done = subprocess.run([*argv, "--trials", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    arms = {
        line[:26].strip(): line[26:].split() for line in lines if line.startswith(("1 ", "cluster"))
    }
    assert set(arms) == {"1 server", "cluster, same server", "cluster, via a route"}
    assert all(float(v[0]) > 0 for v in arms.values())
    (reply,) = [line for line in lines if "kill -> first reply" in line]
    assert 0 < float(reply.split(":")[1].split()[0].rstrip(",")) < 10_000
