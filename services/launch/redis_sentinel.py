"""A replicated Redis/Valkey on real processes: a primary, its replicas and the sentinels
that watch them (`up --redis-replicas N`, tests, and `start_redis_sentinel_set` for
deployments over a bridge address). Clients find the primary through the sentinels
(`bus_schemas/sentinel.py`); `services/launch/redis_node.py` restarts a node as the sentinels
see the set.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from services.launch.servers import (
    ServerKind,
    ServerProcess,
    find_redis_server,
    identify_redis,
    start_server,
)

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
