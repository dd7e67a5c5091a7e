"""Credentials of a mesh: one identity per role, with the least permissions it needs
(DESIGN.md 7b). `up` makes fresh ones at every start; `hicache-mesh credentials DIR` makes
them for other deployments (compose takes them as secrets).

A credentials folder (mode 0700; every file 0600):

    nats/router   nats/index   nats/engine.<id> ...   `user:password` of each NATS identity
    redis/router  redis/index                         `user:password` of each Redis identity
    nats-auth.conf     the nats-server `authorization` block (include it, or `up` embeds it)
    redis-users.acl    the Redis/Valkey ACL file (`--aclfile`); `default` is off
    with --redis-replicas: redis/sentinels (`default:password` the sentinels require),
    redis/replica and redis/sentinel (users in the ACL file), redis-replication.conf
    (a data node's masteruser/masterauth) and redis-sentinel.conf (compose's sentinels)
    tls/               with `--tls-hosts`: ca.pem, server.pem, server-key.pem for NATS and
                       Redis across hosts (services/launch/tls.py)

NATS permissions (`nats_permissions`; `>` and `*` are NATS wildcards, P = `hicache`):

| identity | publishes | subscribes |
| --- | --- | --- |
| router | its work: P.engine.*.{generate,decode_admit,prefill,abort,stream_check,flush,stats,model_card}, P.bucket.*.generate, P.flush | P.heartbeat.*, _INBOX.router.> |
| index | P.engine.*.snapshot | P.heartbeat.*, P.kv_events.*, _INBOX.index.> |
| engine E (colocated in bucket B) | P.heartbeat.E, P.kv_events.E, _INBOX.router.> (token streams and replies to the router), P.engine.E.stats and _INBOX.engine.E.> (its own health probe); prefill: P.engine.*.kv; decode: P.engine.*.kv_ack | P.engine.E.>, P.flush, _INBOX.engine.E.>; colocated: P.bucket.B.generate |

So an engine cannot speak for another engine (heartbeats, events, model cards: only E may
answer on P.engine.E.model_card), cannot give work, and reads nobody else's work. The router
and the index also refuse a heartbeat or event whose engine id differs from the subject's.

Redis: `index` reads and writes the index keys (`hc:*`); `router` may read them only
(`%R~hc:*`) with PING, SCRIPT LOAD, EVALSHA and the reads of the lookup script, so a script
it loads cannot write either.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bus_schemas import subjects
from bus_schemas.connection import (
    DEFAULT_INBOX,
    Credentials,
    read_credentials,
    write_credentials,
)

ROUTER, INDEX = "router", "index"
# with replicas (`up --redis-replicas`): the users replicas and sentinels log in as on the data
# nodes, and the password the sentinels require of everyone (their user `default`)
REPLICA, SENTINEL, SENTINELS = "replica", "sentinel", "sentinels"
MODES = ("colocated", "prefill", "decode")
NATS_AUTH_FILE = "nats-auth.conf"
REDIS_ACL_FILE = "redis-users.acl"
REDIS_REPLICATION_FILE = "redis-replication.conf"  # with replicas: masteruser / masterauth
SENTINEL_CONF_FILE = "redis-sentinel.conf"  # with replicas: compose's sentinels start from it
PASSWORD_BYTES = 32  # secrets.token_urlsafe: 43 characters


def engine_user(engine_id: str) -> str:
    return f"engine.{engine_id}"


@dataclass(frozen=True, slots=True)
class EngineGrant:
    """An engine the credentials admit: its id, bucket and disaggregation mode."""

    engine_id: str
    bucket: str = "default"
    mode: str = "colocated"

    def __post_init__(self) -> None:
        if not subjects.valid_token(self.engine_id) or not subjects.valid_token(self.bucket):
            raise ValueError(f"bad engine id or bucket: {self.engine_id!r}, {self.bucket!r}")
        if self.mode not in MODES:
            raise ValueError(f"engine {self.engine_id}: mode must be one of {MODES}")

    @classmethod
    def parse(cls, spec: str) -> EngineGrant:
        """`ID[:BUCKET[:MODE]]`, e.g. `decode-0:default:decode`."""
        parts = spec.strip().split(":")
        if not 1 <= len(parts) <= 3:
            raise ValueError(f"engine spec {spec!r}: expected ID[:BUCKET[:MODE]]")
        return cls(*parts)


@dataclass(frozen=True, slots=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def _inbox(user: str) -> str:
    return f"{DEFAULT_INBOX}.{user}.>"


def nats_permissions(identity: str, engine: EngineGrant | None = None) -> Permissions:
    """The subjects `identity` (ROUTER, INDEX, or an engine's user with its grant) may use."""
    if identity == ROUTER:
        work = (
            subjects.engine_generate,
            subjects.engine_decode_admit,
            subjects.engine_prefill,
            subjects.engine_abort,
            subjects.engine_stream_check,
            subjects.engine_flush,
            subjects.engine_stats,
            subjects.engine_model_card,
            subjects.bucket_generate,
        )
        return Permissions(
            (*(subject("*") for subject in work), subjects.FLUSH_ALL),
            (subjects.HEARTBEAT_ALL, _inbox(ROUTER)),
        )
    if identity == INDEX:
        return Permissions(
            (subjects.engine_snapshot("*"),),
            (subjects.HEARTBEAT_ALL, subjects.KV_EVENTS_ALL, _inbox(INDEX)),
        )
    assert engine is not None and identity == engine_user(engine.engine_id)
    eid = engine.engine_id
    publish = [subjects.heartbeat(eid), subjects.kv_events(eid), _inbox(ROUTER)]
    publish += [subjects.engine_stats(eid), _inbox(identity)]
    if engine.mode == "prefill":
        publish.append(subjects.engine_kv("*"))
    elif engine.mode == "decode":
        publish.append(subjects.engine_kv_ack("*"))
    own = f"{subjects.PREFIX}.engine.{eid}.>"
    subscribe = [own, subjects.FLUSH_ALL, _inbox(identity)]
    if engine.mode == "colocated":  # P/D engines take work on their own subjects only
        subscribe.append(subjects.bucket_generate(engine.bucket))
    return Permissions(tuple(publish), tuple(subscribe))


@dataclass(frozen=True, slots=True)
class MeshCredentials:
    """Every identity's credentials, and the engines admitted."""

    nats: dict[str, Credentials]  # user -> its credentials
    redis: dict[str, Credentials]
    engines: tuple[EngineGrant, ...]

    @classmethod
    def fresh(cls, engines: Sequence[EngineGrant], replicated: bool = False) -> MeshCredentials:
        """New credentials; `replicated`: also those of a replicated Redis with Sentinel."""

        def new(user: str) -> Credentials:
            return Credentials(user, secrets.token_urlsafe(PASSWORD_BYTES))

        users = [ROUTER, INDEX, *(engine_user(e.engine_id) for e in engines)]
        if len(set(users)) != len(users):
            raise ValueError("engine ids must be distinct")
        redis = {u: new(u) for u in (ROUTER, INDEX)}
        if replicated:
            redis |= {u: new(u) for u in (REPLICA, SENTINEL)}
            redis[SENTINELS] = Credentials("default", new(SENTINELS).password)
        return cls({u: new(u) for u in users}, redis, tuple(engines))

    def nats_file(self, root: Path, user: str) -> Path:
        return root / "nats" / user

    def redis_file(self, root: Path, user: str) -> Path:
        return root / "redis" / user

    def write(self, root: Path) -> None:
        """Write every file under `root` (created 0700; files 0600)."""
        for folder in (root, root / "nats", root / "redis"):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(folder, 0o700)
        for user, creds in self.nats.items():
            write_credentials(self.nats_file(root, user), creds)
        for user, creds in self.redis.items():
            write_credentials(self.redis_file(root, user), creds)
        write_private(root / NATS_AUTH_FILE, self.nats_authorization())
        write_private(root / REDIS_ACL_FILE, self.redis_acl())
        if REPLICA in self.redis:  # compose's replicated Redis (compose/redis-sentinel.yml)
            write_private(root / REDIS_REPLICATION_FILE, self.redis_replication_conf())
            write_private(root / SENTINEL_CONF_FILE, self.sentinel_conf())

    def redis_replication_conf(self) -> str:
        """A data node's config file: the user it replicates its primary as (every node gets
        it, since Sentinel may make any of them a replica)."""
        r = self.redis[REPLICA]
        return f"masteruser {r.user}\nmasterauth {r.password}\n"

    def sentinel_conf(self, primary: str = "redis", port: int = 6379) -> str:
        """A sentinel's initial config file for compose (it rewrites its own copy): watch
        `primary` as `hicache` (a majority of 3), log in to the nodes as `sentinel`, require
        the `sentinels` password of clients and of the other sentinels."""
        m, user, client = "hicache", self.redis[SENTINEL], self.redis[SENTINELS]
        return (
            "sentinel resolve-hostnames yes\nsentinel announce-hostnames yes\n"
            f"sentinel monitor {m} {primary} {port} 2\n"
            f"sentinel down-after-milliseconds {m} 5000\n"
            f"sentinel failover-timeout {m} 30000\nsentinel parallel-syncs {m} 1\n"
            f"sentinel auth-user {m} {user.user}\nsentinel auth-pass {m} {user.password}\n"
            f"requirepass {client.password}\nsentinel sentinel-pass {client.password}\n"
        )

    def nats_authorization(self) -> str:
        """The nats-server config `authorization` block."""
        grants = {engine_user(e.engine_id): e for e in self.engines}
        users = []
        for user, creds in self.nats.items():
            perms = nats_permissions(user, grants.get(user))
            users.append(
                f"    {{user: {_q(user)}, password: {_q(creds.password)}, permissions: {{\n"
                f"      publish: {{allow: {_list(perms.publish)}}}\n"
                f"      subscribe: {{allow: {_list(perms.subscribe)}}}\n"
                "    }}"
            )
        return "authorization {\n  users = [\n" + "\n".join(users) + "\n  ]\n}\n"

    def redis_acl(self) -> str:
        """The ACL file: no default user; `index` reads and writes `hc:*`; `router` reads."""

        def digest(user: str) -> str:
            return "#" + hashlib.sha256(self.redis[user].password.encode()).hexdigest()

        # +get +info: the router reads the index's resync marker and the server's run id
        router_reads = "+ping +select +evalsha +script|load +exists +hget +hgetall +get +info"
        acl = (
            "user default off resetkeys resetchannels -@all\n"
            f"user {INDEX} on {digest(INDEX)} resetchannels ~hc:* "
            "+@all -@admin -@dangerous +info\n"
            f"user {ROUTER} on {digest(ROUTER)} resetchannels %R~hc:* -@all {router_reads}\n"
        )
        if REPLICA in self.redis:  # a replica's link to its primary
            acl += (
                f"user {REPLICA} on {digest(REPLICA)} resetchannels -@all +psync +replconf +ping\n"
            )
        if SENTINEL in self.redis:  # what a sentinel needs of the nodes it watches
            acl += (
                f"user {SENTINEL} on {digest(SENTINEL)} resetchannels &__sentinel__:hello "
                "-@all +multi +slaveof +replicaof +ping +exec +subscribe +config|rewrite +role "
                "+publish +info +client|setname +client|kill +script|kill\n"
            )
        return acl


def load(root: Path, engines: Iterable[EngineGrant]) -> MeshCredentials:
    """The credentials under `root` (as `write` left them), for these engines; raises
    CredentialsError naming a missing or unsafe file."""
    grants = tuple(engines)
    nats_users = [ROUTER, INDEX, *(engine_user(e.engine_id) for e in grants)]
    redis_users = [ROUTER, INDEX]
    redis_users += [u for u in (REPLICA, SENTINEL, SENTINELS) if (root / "redis" / u).exists()]
    return MeshCredentials(
        {u: read_credentials(root / "nats" / u) for u in nats_users},
        {u: read_credentials(root / "redis" / u) for u in redis_users},
        grants,
    )


def write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _q(text: str) -> str:
    """A double-quoted nats-server config string (token_urlsafe passwords need no escape)."""
    if '"' in text or "\\" in text or "\n" in text:
        raise ValueError("a NATS user or password with a quote, backslash or newline")
    return f'"{text}"'


def _list(items: Iterable[str]) -> str:
    return "[" + ", ".join(_q(i) for i in items) + "]"


# ------------------------------------------------------------------ `hicache-mesh credentials`


def add_credentials_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="folder to write (created 0700)")
    parser.add_argument(
        "--engines",
        required=True,
        metavar="ID[:BUCKET[:MODE]],...",
        help="the engines to admit, with bucket (default 'default') and mode "
        "(colocated, prefill, decode; default colocated), e.g. "
        "prefill-0:default:prefill,decode-0:default:decode",
    )
    parser.add_argument(
        "--force", action="store_true", help="overwrite credentials already in DIR (rotate)"
    )
    parser.add_argument(
        "--redis-replicas",
        action="store_true",
        help="also the credentials of a replicated Redis with Sentinel: the users replicas "
        "and sentinels log in as (in the ACL file) and the sentinels' password "
        "(redis/sentinels)",
    )
    parser.add_argument(
        "--tls-hosts",
        default=None,
        metavar="HOST,...",
        help="also make DIR/tls: a private CA and a certificate for the NATS and Redis "
        "servers under these names or addresses (needs `openssl`), e.g. nats,redis,10.0.0.5",
    )


def run_credentials(args: argparse.Namespace) -> int:
    import sys

    try:
        grants = [EngineGrant.parse(s) for s in args.engines.split(",") if s.strip()]
        if not grants:
            raise ValueError("--engines names no engine")
        if (args.dir / NATS_AUTH_FILE).exists() and not args.force:
            raise ValueError(f"{args.dir} already holds credentials: --force replaces them")
        creds = MeshCredentials.fresh(grants, replicated=args.redis_replicas)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    creds.write(args.dir)
    print(f"credentials for router, index and {len(grants)} engines written to {args.dir}")
    if args.tls_hosts is not None:
        from services.launch.tls import make_tls

        try:
            made = make_tls(args.dir / "tls", args.tls_hosts.split(","))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(
            f"TLS CA and server certificate for {args.tls_hosts} written to {made.ca_file.parent}"
        )
    return 0
