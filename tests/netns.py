"""Network namespaces as "hosts", for tests that need more than one machine.

`Hosts(names)` (root and `ip` only) makes a bridge in the root namespace with an address
(`bridge_ip`: servers started here listen on it), and per host a namespace with loopback up
and a veth pair whose root end is in the bridge and whose other end holds the host's address
(`ip_of`). Each name carries the test process's pid, so parallel runs never collide.
`run_in(host, argv)` starts a process inside a host (`ip netns exec` execs it: the pid is the
process's own); `cut(host)` takes the host's link down (packets vanish: TCP connections hang
rather than reset, like a pulled cable), `restore(host)` brings it back; `close()` kills
what `run_in` started and removes every namespace, link and the bridge, also after a failed
test (use it as a context manager).
Tests skip only where not root or without `ip` (CI runs as root).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import pytest

from services.launch.servers import ServerProcess, find_nats_server, find_redis_server


def require_netns() -> None:
    """Skip unless this process can make namespaces (root, with `ip`)."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root)")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2)")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Hosts:
    """Namespaces joined by a bridge (see the module doc)."""

    def __init__(self, names: Sequence[str]) -> None:
        tag = os.getpid()
        self.subnet = f"10.{200 + tag % 50}.{(tag // 50) % 250}"
        self.bridge = f"hmb{tag}"
        self.bridge_ip = f"{self.subnet}.1"
        self._hosts = {name: i for i, name in enumerate(names)}
        self._procs: list[subprocess.Popen[bytes]] = []
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for name in names:
                self._add(name)
        except BaseException:
            self.close()
            raise

    def ns(self, name: str) -> str:
        return f"hm{os.getpid()}-{name}"

    def ip_of(self, name: str) -> str:
        return f"{self.subnet}.{10 + self._hosts[name]}"

    def veth(self, name: str) -> str:
        """The root end of the host's link (in the bridge)."""
        return f"hm{os.getpid()}v{self._hosts[name]}"

    def _add(self, name: str) -> None:
        ns, root_end, inner = self.ns(name), self.veth(name), f"hm{os.getpid()}i{self._hosts[name]}"
        _ip("netns", "add", ns)
        _ip("link", "add", root_end, "type", "veth", "peer", "name", inner)
        _ip("link", "set", root_end, "master", self.bridge, "up")
        _ip("link", "set", inner, "netns", ns)
        _ip("-n", ns, "link", "set", inner, "name", "eth0")
        _ip("-n", ns, "addr", "add", f"{self.ip_of(name)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")

    def run_in(self, name: str, argv: Sequence[str], **popen: Any) -> subprocess.Popen[bytes]:
        """Start `argv` inside host `name`; killed by `close()` if still running."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(name), *argv], **popen)
        self._procs.append(proc)
        return proc

    def cut(self, name: str) -> None:
        """Take host `name`'s link down (both ends): nothing crosses it any more."""
        _ip("link", "set", self.veth(name), "down")
        _ip("-n", self.ns(name), "link", "set", "eth0", "down")

    def restore(self, name: str) -> None:
        """Bring host `name`'s link back up."""
        _ip("link", "set", self.veth(name), "up")
        _ip("-n", self.ns(name), "link", "set", "eth0", "up")

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for name in self._hosts:
            subprocess.run(["ip", "netns", "del", self.ns(name)], capture_output=True)
            subprocess.run(["ip", "link", "del", self.veth(name)], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def free_port_on(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_listening(host: str, port: int, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode} before listening")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            if s.connect_ex((host, port)) == 0:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing listened on {host}:{port} within {timeout_s}s")
        time.sleep(0.02)


def start_on(kind: str, host: str, workdir: Path, log: IO[bytes] | None = None) -> ServerProcess:
    """A plain (no users, no TLS) nats-server or redis-server listening on `host` (the
    bridge's address: every namespace reaches it)."""
    port = free_port_on(host)
    if kind == "nats":
        conf = workdir / "nats.conf"
        conf.write_text("max_payload: 8388608\n")
        argv = [find_nats_server(), "-a", host, "-p", str(port), "-c", str(conf)]
        url = f"nats://{host}:{port}"
    else:
        argv = [find_redis_server(), "--port", str(port), "--bind", host, "--save", ""]
        argv += ["--appendonly", "no", "--dir", str(workdir)]
        url = f"redis://{host}:{port}/0"
    out = log if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    server = ServerProcess(kind, port, proc, url)
    try:
        wait_listening(host, port, proc, 15.0)
    except BaseException:
        with contextlib.suppress(Exception):
            server.stop()
        raise
    return server
