"""How fast the machine is while a benchmark runs: CPU that other processes use
(`ForeignLoad`, Linux /proc) and the speed of a fixed Python loop (`cpu_check`). A shared
host's speed drifts by 2x over minutes; a row measured under foreign load is not clean.
Imported by the benchmark scripts beside it (run as `python benchmarks/NAME.py`)."""

from __future__ import annotations

import os
import time


def cpu_check() -> float:
    """Milliseconds for a fixed pure-Python loop: how fast the machine runs Python right now
    (a shared host's speed drifts by 2x over minutes, which no process list shows)."""
    start = time.perf_counter()
    x = 0
    for i in range(200_000):
        x += i * i
    return (time.perf_counter() - start) * 1e3


class ForeignLoad:
    """CPU that processes outside this benchmark's process tree used while it ran (Linux
    /proc; None elsewhere), in cores (1.0: one CPU busy all the time)."""

    def __init__(self) -> None:
        self.available = os.path.exists("/proc/stat")
        self._start = self._sample()

    def cores(self) -> float | None:
        """Average foreign cores since it was made."""
        end = self._sample()
        if self._start is None or end is None or end[0] <= self._start[0]:
            return None
        (t0, busy0, own0), (t1, busy1, own1) = self._start, end
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0)

    def _sample(self) -> tuple[float, float, float] | None:
        if not self.available:
            return None
        tick = os.sysconf("SC_CLK_TCK")
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        busy = sum(fields[:8]) - fields[3] - fields[4]  # all but idle and iowait
        return time.monotonic(), busy / tick, _tree_cpu(os.getpid()) / tick


def _tree_cpu(root: int) -> int:
    """utime + stime (ticks) of `root` and every process below it."""
    stats: dict[int, tuple[int, int]] = {}  # pid -> (parent, ticks)
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it exited
        stats[int(name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0))[1]
        todo.extend(children.get(pid, ()))
    return total
