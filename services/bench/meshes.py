"""The arms' meshes during a benchmark, and the memory they hold.

`hicache-mesh bench` interleaves its arms in rounds (A B, B A, A B, ...), so that load that
drifts over the run (another process, a warming page cache, thermal limits) lands on every
arm alike. Between its turns an arm's mesh either stays up or goes down:

- all at once (the default): every arm's mesh starts before the first round and stays up to
  the last. Only one arm's requests run at a time, so the meshes do not share the CPUs while
  measured: an idle mesh only heartbeats (measured: 1.6-2.7% of one core for a colocated
  `tiny`, a TP2 `tiny-tp` or a SmolLM2 mesh). Each mesh starts and warms up once, and every
  round measures processes that have been serving. The cost is memory, every mesh at once
  (`rss_bytes`, printed once they are up). Measured RSS per mesh (nats, redis, index,
  router and the engines): colocated `tiny` 0.5 GiB, TP2 `tiny-tp` 1.0 GiB, SmolLM2 with the
  default 32K-token pool 3.0 GiB, with `--enable-hierarchical-cache` (host 2x) 5.4 GiB; a P/D
  arm has two such engines, so two P/D arms of the real model approach 20 GiB. A mesh is
  therefore started only while the memory still available exceeds `MEMORY_MARGIN` times the
  largest mesh already up; otherwise the run falls back to one mesh at a time, and says so.
- one at a time (`--one-mesh-at-a-time`, or that fallback): each arm's mesh starts for its
  turn in a round and stops after it: the memory of one mesh, at the cost of a start and a
  warmup per arm per round (SmolLM2: ~10 s each), and of measuring processes that just
  started.

Every round flushes the arm's cache first (`/flush_cache`: device and host tiers); an L3
store is not flushed, so rounds after the first can read what earlier ones wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from services.launch.up import Mesh

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
MEMORY_MARGIN = 1.5  # another mesh starts while available memory > this x the largest one up


class ArmMesh:
    """One arm's mesh (`hicache-mesh up` args), started and stopped on demand."""

    def __init__(self, arm: str, up_args: argparse.Namespace) -> None:
        self.arm = arm
        self.up_args = up_args
        self._mesh: Mesh | None = None
        self.url: str | None = None

    @property
    def num_engines(self) -> int:
        a = self.up_args
        return int(a.num_prefill + a.num_decode if a.pd else a.engines)

    def start(self) -> str:
        """Start the mesh and wait until every engine is live; its URL."""
        self._mesh = Mesh(self.up_args)
        url = self._mesh.start()
        wait_for_engines(url, self.num_engines, self.up_args.startup_timeout)
        self.url = url
        return url

    def stop(self) -> None:
        if self._mesh is not None:
            self._mesh.stop()
        self._mesh, self.url = None, None

    def pids(self) -> list[int]:
        """Every process of the mesh: `up`'s children and their descendants (ranks)."""
        if self._mesh is None:
            return []
        roots = [p for c in self._mesh.supervisor.children.values() if (p := c.pid) is not None]
        return descendants(roots)

    def rss_bytes(self) -> int:
        return sum(rss_bytes(pid) for pid in self.pids())


def wait_for_engines(base_url: str, num_engines: int, timeout_s: float) -> None:
    """Wait until the router's `/health` lists `num_engines` live engines: a mesh is healthy
    with one, and a benchmark that starts then would load that one alone."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=5) as resp:
                if len(json.load(resp).get("live_engines", [])) >= num_engines:
                    return
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{base_url} did not list {num_engines} live engines in {timeout_s}s")


def descendants(roots: list[int]) -> list[int]:
    """`roots` and every process below them (from /proc; [] where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after "(comm)": state, ppid
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def rss_bytes(pid: int) -> int:
    """Resident memory of one process (0 when it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return 0


def available_bytes() -> int | None:
    """The kernel's MemAvailable; None where /proc/meminfo does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def room_for_another(up: list[ArmMesh]) -> bool:
    """Whether another mesh as large as the largest of `up` fits in the available memory
    with `MEMORY_MARGIN` (True when none is up or the kernel does not say)."""
    largest = max((m.rss_bytes() for m in up), default=0)
    free = available_bytes()
    return free is None or free > MEMORY_MARGIN * largest


def report_memory(meshes: list[ArmMesh]) -> None:
    """One line per mesh up, and their sum, to stderr."""
    gib = 1 << 30
    total = 0
    for m in meshes:
        rss = m.rss_bytes()
        total += rss
        print(
            f"arm {m.arm}: {len(m.pids())} processes, RSS {rss / gib:.2f} GiB",
            file=sys.stderr,
            flush=True,
        )
    free = available_bytes()
    left = "" if free is None else f"; {free / gib:.1f} GiB still available"
    print(f"meshes up: {len(meshes)}, RSS {total / gib:.2f} GiB{left}", file=sys.stderr)
