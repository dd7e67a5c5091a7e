"""The one owner of the mesh's child processes: start them, restart the dead, stop them all.

A child that exits while the mesh runs is restarted after a backoff (`RestartPolicy`):
0.5 s doubling to 10 s, back to 0.5 s once a child has stayed up for `reset_after_s`. Each
restart logs one line (name, exit code, restart count, delay). Servers (nats, redis) come
back on the SAME port, so clients reconnect to the URL they know. `stop()` stops children
in tiers (router; then engines and index; then servers), SIGTERM first and SIGKILL after
the grace period, so nothing is left behind.

Every child runs in a process group of its own, so a terminal's Ctrl-C (SIGINT to the
foreground process group) reaches only the supervisor, which then stops the children in
that order: in the supervisor's group, every child got the SIGINT at once, and nats-server
went away under services still draining their connections (warnings on every stop).

Every (re)start rewrites the status file (when given): JSON with each child's pid, port,
restart count and last exit code, for operators and fault tests.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("hicache.supervisor")


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    initial_s: float = 0.5
    max_s: float = 10.0
    reset_after_s: float = 30.0  # up this long: the next restart waits initial_s again

    def delay(self, restarts_in_a_row: int) -> float:
        return float(min(self.max_s, self.initial_s * 2 ** min(restarts_in_a_row, 30)))


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """How to start one child. `ready` blocks until it serves (servers: the port accepts)."""

    name: str
    argv: list[str]
    tier: int  # stop order: higher tiers stop first
    port: int | None = None
    ready: Callable[[subprocess.Popen[bytes]], None] | None = None
    quiet: bool = False  # drop its output (servers: their banners would flood the log)


@dataclass(slots=True)
class Child:
    spec: ChildSpec
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    in_a_row: int = 0  # restarts since the child last stayed up reset_after_s
    last_exit: int | None = None
    restart_at: float | None = None  # monotonic time of a scheduled restart

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


@dataclass
class Supervisor:
    policy: RestartPolicy = RestartPolicy()
    status_path: Path | None = None
    extra_status: dict[str, object] = field(default_factory=dict)
    children: dict[str, Child] = field(default_factory=dict)

    # ------------------------------------------------------------------ start

    def start(self, spec: ChildSpec) -> None:
        """Start a new child now (raises if its `ready` check fails)."""
        child = Child(spec)
        self.children[spec.name] = child
        self._launch(child)

    def _launch(self, child: Child) -> None:
        out = subprocess.DEVNULL if child.spec.quiet else None
        child.proc = subprocess.Popen(child.spec.argv, stdout=out, stderr=out, process_group=0)
        child.started_at, child.restart_at = time.monotonic(), None
        log.info("started %s (pid %d)", child.spec.name, child.proc.pid)
        if child.spec.ready is not None:
            child.spec.ready(child.proc)
        self.write_status()

    # ------------------------------------------------------------------ supervise

    def exited(self) -> list[Child]:
        """Children that exited and have no restart scheduled yet (startup checks this)."""
        return [
            c
            for c in self.children.values()
            if c.proc is not None and c.proc.poll() is not None and c.restart_at is None
        ]

    def poll(self) -> None:
        """Schedule a restart for every newly dead child; restart those whose delay is over."""
        now = time.monotonic()
        for child in self.exited():
            self._schedule(child, now)
        for child in self.children.values():
            if child.restart_at is not None and now >= child.restart_at:
                try:
                    self._launch(child)
                except (OSError, RuntimeError, TimeoutError) as e:
                    log.error("restart of %s failed: %s", child.spec.name, e)
                    if child.proc is not None and child.proc.poll() is None:
                        child.proc.kill()  # never ready: do not leave it running
                        child.proc.wait()
                    self._schedule(child, time.monotonic())

    def _schedule(self, child: Child, now: float) -> None:
        assert child.proc is not None
        if now - child.started_at >= self.policy.reset_after_s:
            child.in_a_row = 0
        delay = self.policy.delay(child.in_a_row)
        child.in_a_row += 1
        child.restarts += 1
        child.last_exit = child.proc.returncode
        child.restart_at = now + delay
        log.warning(
            "%s exited with code %s; restart %d in %.1fs",
            child.spec.name,
            child.last_exit,
            child.restarts,
            delay,
        )
        self.write_status()

    # ------------------------------------------------------------------ stop

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM tier by tier (highest first), SIGKILL what outlives `grace_s`."""
        for tier in sorted({c.spec.tier for c in self.children.values()}, reverse=True):
            procs = [
                c.proc
                for c in self.children.values()
                if c.spec.tier == tier and c.proc is not None and c.proc.poll() is None
            ]
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for proc in procs:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for child in self.children.values():
            child.restart_at = None
        if self.status_path is not None:
            self.status_path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, object]:
        children = {
            name: {
                "pid": c.pid,
                "port": c.spec.port,
                "restarts": c.restarts,
                "last_exit": c.last_exit,
                "alive": c.proc is not None and c.proc.poll() is None,
            }
            for name, c in self.children.items()
        }
        return {"pid": os.getpid(), **self.extra_status, "children": children}

    def write_status(self) -> None:
        """Atomically replace the status file (readers never see half a file)."""
        if self.status_path is None:
            return
        tmp = self.status_path.with_name(self.status_path.name + ".tmp")
        tmp.write_text(json.dumps(self.status(), indent=1))
        os.replace(tmp, self.status_path)
