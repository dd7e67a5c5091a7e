"""`hicache-mesh up`: the whole mesh on loopback, as supervised processes.

Checks that the router's port is free, starts nats-server and redis-server on free ports
(or uses `--nats-url` / `--redis-url`), then the index service, the engine services and the
router; prints the URL. A child that dies is restarted with backoff (`Supervisor`); servers
come back on the same port. Ctrl-C or SIGTERM stops them all and leaves no process behind.
`--status-file PATH` keeps a JSON file with every child's pid, port and restart count.

Credentials (DESIGN.md 7b, `services/launch/credentials.py`): every start makes fresh random
ones in the work directory (`credentials/`, mode 0700, files 0600; its path is in the status
file as `credentials_dir`); the servers `up` starts require them, and each child gets only its
own files, by path. `--credentials-dir DIR` uses those `hicache-mesh credentials DIR` made
instead (so do external servers: `--nats-url`/`--redis-url` with a DIR whose server configs
they were given). Restarted servers keep their config, so children reconnect as before.

TLS (deployments across hosts; `services/launch/tls.py`): `--tls` makes a private CA and a
server certificate in the work directory, `--tls-dir DIR` takes them from DIR; the servers
`up` starts then serve TLS only, and every child gets the CA (`--nats-tls-ca-file`,
`--redis-tls-ca-file`) and verifies the servers against it. External servers signed by
another CA: `--nats-tls-ca-file` / `--redis-tls-ca-file` with `--nats-url` / `--redis-url`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from bus_schemas.sentinel import DEFAULT_MASTER
from services.engine.flags import engine_argv, pd_transfer_argv
from services.launch import credentials as creds
from services.launch import tls as tls_files
from services.launch.buckets import LaunchBucket, check, load_buckets, parse_bucket
from services.launch.nats_cluster import NatsCluster, wait_for_routes
from services.launch.readiness import StartupStopped, wait_ready
from services.launch.redis_sentinel import ReplicationAuth, redis_node_kind, sentinel_kind
from services.launch.router_flags import router_flags_argv
from services.launch.servers import ServerKind, free_port, nats_kind, redis_kind
from services.launch.supervisor import ChildSpec, RestartPolicy, Supervisor
from services.launch.up_flags import PROGRESS_ROUNDS, ROUTER_TIMEOUTS, add_up_args

__all__ = ["Mesh", "MeshHooks", "add_up_args", "check_port_free", "run_up"]

ROUTER_TIER, SERVICE_TIER, SERVER_TIER = 2, 1, 0  # stop order: router, services, servers
SENTINELS = 3  # with --redis-replicas: a majority of 3 agrees a primary is down


class PortInUseError(RuntimeError):
    pass


def check_port_free(host: str, port: int) -> None:
    """Raise PortInUseError when something listens on host:port (before anything starts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the router binds
        try:
            s.bind((host, port))
        except OSError as e:
            raise PortInUseError(
                f"port {port} on {host} is not available ({e.strerror}); "
                f"stop what uses it or pick another port: --port N (make run PORT=N)"
            ) from None


@dataclass(frozen=True, slots=True)
class MeshHooks:
    """Test hooks of a `Mesh`: where the servers' free ports come from (`free_port(avoid)`),
    and what starts each child (None: the mesh's `Supervisor`)."""

    free_port: Callable[[Collection[int]], int] = free_port
    start_child: Callable[[ChildSpec], object] | None = None


class Mesh:
    """The specs of one mesh's processes, started in order under one Supervisor."""

    def __init__(self, args: argparse.Namespace, hooks: MeshHooks = MeshHooks()) -> None:
        self.args = args
        self.hooks = hooks
        declared = [parse_bucket(b) for b in args.bucket or []]
        if args.buckets_file is not None:
            declared += load_buckets(args.buckets_file)
        check(declared)
        if declared and args.pd:
            raise ValueError("--pd with buckets is not supported yet: give one or the other")
        timeout = args.request_timeout
        if timeout is not None and timeout < PROGRESS_ROUNDS * args.heartbeat_interval:
            raise ValueError(
                f"--request-timeout {timeout:g} is under {PROGRESS_ROUNDS} x "
                f"--heartbeat-interval: engines show their progress on a request once per "
                "heartbeat interval"
            )
        if getattr(args, "nats_cluster", 1) < 1:
            raise ValueError(f"--nats-cluster must be at least 1, got {args.nats_cluster}")
        if getattr(args, "nats_cluster", 1) > 1 and args.nats_url:
            raise ValueError("--nats-cluster starts servers: give it or --nats-url, not both")
        if args.api_key and args.api_key_file:
            raise ValueError("give the API key once: --api-key or --api-key-file, not both")
        self.declared = bool(declared)  # else one bucket "default" of the shared flags
        self.buckets = declared or [LaunchBucket("default")]
        self.workdir = tempfile.TemporaryDirectory(prefix="hicache-mesh-")
        self.creds_dir = args.credentials_dir or Path(self.workdir.name) / "credentials"
        grants = self._grants()
        self.replicas = self._check_redis_replicas()
        if args.credentials_dir is None:
            self.creds = creds.MeshCredentials.fresh(grants, replicated=self.replicas > 0)
            self.creds.write(self.creds_dir)
        else:
            self.creds = creds.load(args.credentials_dir, grants)  # CredentialsError: a ValueError
        self.tls = self._server_tls()
        # the servers to start (without --nats-url / --redis-url), requiring the credentials
        self.nats = nats_kind(args.nats_max_payload, self.creds.nats_authorization(), self.tls)
        acl = Path(self.workdir.name) / creds.REDIS_ACL_FILE  # from the files `load` checked
        if args.credentials_dir is None:
            acl = self.creds_dir / creds.REDIS_ACL_FILE
        else:
            creds.write_private(acl, self.creds.redis_acl())
        index_redis = self.creds.redis[creds.INDEX]
        self.redis = redis_kind(str(acl), (index_redis.user, index_redis.password), self.tls)
        self._acl = acl
        if self.replicas and creds.SENTINELS not in self.creds.redis:
            raise ValueError(
                f"--redis-replicas: {self.creds_dir} has no replica and sentinel credentials "
                "(make them with `hicache-mesh credentials DIR --redis-replicas`)"
            )
        self._sentinel_flags: list[str] = []  # the index's and router's, with --redis-replicas
        self._ports = {args.port}  # chosen for this mesh: the servers' ports avoid them
        self.supervisor = Supervisor(
            RestartPolicy(initial_s=args.restart_backoff), args.status_file
        )
        self._start_child = hooks.start_child or self.supervisor.start

    def start(self, stopping: Callable[[], bool] = lambda: False) -> str:
        """Start everything; the router URL once healthy. Raises StartupStopped when
        `stopping()` turns true first."""
        a = self.args
        check_port_free(a.host, a.port)
        url = f"http://{a.host}:{a.port}"
        self.supervisor.extra_status["url"] = url
        self.supervisor.extra_status["credentials_dir"] = str(self.creds_dir)
        nats_url = a.nats_url or self.start_nats()
        if self.replicas:
            redis_url = self.start_sentinel_set()
        else:
            redis_url = a.redis_url or self.start_server(self.redis)
        py = sys.executable
        index = [py, "-m", "services.index", "--nats-url", nats_url, "--redis-url", redis_url]
        index += self._credential_flags(creds.INDEX, redis=True) + self._max_engines_argv()
        index += self._sentinel_flags
        index += self._tls_flags(redis=True)
        self._start_child(ChildSpec("index", index, SERVICE_TIER))
        for name, extra in self.engines():
            argv = [py, "-m", "services.engine", "--engine-id", name]
            argv += ["--nats-url", nats_url, "--heartbeat-interval", str(a.heartbeat_interval)]
            argv += self._credential_flags(creds.engine_user(name)) + self._tls_flags()
            self._start_child(ChildSpec(name, argv + engine_argv(a) + extra, SERVICE_TIER))
        self._start_child(
            ChildSpec("router", self.router_argv(nats_url, redis_url), ROUTER_TIER, a.port)
        )
        self._wait_healthy(url, a.startup_timeout, stopping)
        return url

    def start_server(self, kind: ServerKind, port: int | None = None) -> str:
        """Start nats/redis on `port` or a free port, which stays its port across restarts."""
        if port is None:
            port = self.hooks.free_port(self._ports)  # not the router's, nor another server's
            self._ports.add(port)
        workdir = Path(self.workdir.name) / kind.name
        workdir.mkdir()
        url = kind.url.format(port)
        self.supervisor.extra_status[f"{kind.name}_url"] = url
        argv, ready = kind.argv(port, str(workdir)), kind.ready(port, str(workdir))
        self._start_child(ChildSpec(kind.name, argv, SERVER_TIER, port, ready, quiet=True))
        return url

    def start_nats(self) -> str:
        """One nats-server, or with `--nats-cluster N` N of them clustered (`NatsCluster`):
        children `nats-0`..`nats-{N-1}`, each restarted on its own ports; the URL list."""
        n = getattr(self.args, "nats_cluster", 1)
        if n == 1:
            return self.start_server(self.nats)
        cluster = NatsCluster.plan(n, self.nats, tls=self.tls, free_port=self.hooks.free_port,
                                   avoid=self._ports)  # fmt: skip
        self._ports.update(cluster.ports + cluster.route_ports + cluster.monitor_ports)
        for i, port in enumerate(cluster.ports):
            self.start_server(cluster.member(i), port)
        wait_for_routes(cluster)
        self.supervisor.extra_status["nats_url"] = cluster.url()
        monitors = [cluster.monitor_url(i) for i in range(n)]
        self.supervisor.extra_status["nats_monitor_urls"] = monitors
        return cluster.url()

    # ------------------------------------------------------------ --redis-replicas

    def _as_sentinels_see_it(self, kind: ServerKind) -> ServerKind:
        """`kind` started by `services.launch.redis_node`: a node that restarts comes back as
        a replica of the primary the sentinels name (after their failover, if it was the
        primary), never as an empty primary its replicas would copy."""
        flags = [sys.executable, "-m", "services.launch.redis_node", *self._sentinel_flags]

        def argv(port: int, workdir: str) -> list[str]:
            marker = ["--restart-marker", str(Path(workdir) / "started")]
            return [*flags, "--node", f"127.0.0.1:{port}", *marker, "--", *kind.argv(port, workdir)]

        return dataclasses.replace(kind, argv=argv)

    def _check_redis_replicas(self) -> int:
        a = self.args
        n = int(getattr(a, "redis_replicas", 0) or 0)
        if n < 0:
            raise ValueError(f"--redis-replicas must be >= 0, got {n}")
        if n and a.redis_url:
            raise ValueError("--redis-replicas starts a replicated Redis: not with --redis-url")
        if n and (a.tls or a.tls_dir is not None):
            raise ValueError("--redis-replicas with --tls is not supported yet")
        return n

    def start_sentinel_set(self) -> str:
        """Start a primary, `--redis-replicas` replicas and 3 sentinels (all supervised: a
        restarted node comes back on its port and Sentinel makes it a replica of the current
        primary); set the index's and router's Sentinel flags. Their `--redis-url`."""
        r = self.creds.redis
        auth = ReplicationAuth(
            (r[creds.REPLICA].user, r[creds.REPLICA].password),
            (r[creds.SENTINEL].user, r[creds.SENTINEL].password),
            r[creds.SENTINELS].password,
        )
        probe = (r[creds.INDEX].user, r[creds.INDEX].password)
        ports = []
        for _ in range(1 + self.replicas + SENTINELS):
            ports.append(self.hooks.free_port(self._ports))
            self._ports.add(ports[-1])
        primary = ("127.0.0.1", ports[0])
        sentinel_ports = ports[1 + self.replicas :]
        addresses = ",".join(f"127.0.0.1:{p}" for p in sentinel_ports)
        sentinel_file = self.creds.redis_file(self.creds_dir, creds.SENTINELS).resolve()
        self._sentinel_flags = ["--redis-sentinel", addresses]
        self._sentinel_flags += ["--redis-sentinel-master", DEFAULT_MASTER]
        self._sentinel_flags += ["--redis-sentinel-credentials", str(sentinel_file)]
        acl = str(self._acl)
        for i, port in enumerate(ports[: 1 + self.replicas]):
            name, replicaof = ("redis", None) if i == 0 else (f"redis-replica-{i}", primary)
            kind = redis_node_kind(
                name, aclfile=acl, auth=auth, probe_auth=probe, replicaof=replicaof
            )
            self.start_server(self._as_sentinels_see_it(kind), port)
        for i, port in enumerate(sentinel_ports):
            kind = sentinel_kind(
                f"redis-sentinel-{i + 1}", primary=primary, master=DEFAULT_MASTER, auth=auth
            )
            self.start_server(kind, port)
        return "redis:///0"

    def router_argv(self, nats_url: str, redis_url: str) -> list[str]:
        a = self.args
        argv = [sys.executable, "-m", "router", "--host", a.host, "--port", str(a.port)]
        argv += ["--nats-url", nats_url, "--redis-url", redis_url, *self._sentinel_flags]
        argv += self._credential_flags(creds.ROUTER, redis=True) + self._tls_flags(redis=True)
        for bucket in self.buckets:
            argv += ["--bucket", bucket.router_spec()]
        for flag, _ in ROUTER_TIMEOUTS:
            value = getattr(a, flag[2:].replace("-", "_"), None)
            argv += [] if value is None else [flag, str(value)]
        if a.api_key:  # in a file of our own, not on the router's command line (`ps`)
            key_file = Path(self.workdir.name) / "api_key"
            key_file.touch(mode=0o600)
            key_file.write_text(a.api_key + "\n")
            argv += ["--api-key-file", str(key_file)]
        elif a.api_key_file:
            argv += ["--api-key-file", str(Path(a.api_key_file).resolve())]
        if a.default_max_tokens is not None:
            argv += ["--default-max-tokens", str(a.default_max_tokens)]
        argv += self._max_engines_argv()
        if a.record:
            argv += ["--record", a.record, "--record-meta", json.dumps(self._record_meta())]
            argv += ["--record-redact"] if a.record_redact else []
        return argv + router_flags_argv(a)

    def _max_engines_argv(self) -> list[str]:
        n = self.args.max_engines
        return [] if n is None else ["--max-engines", str(n)]

    def _credential_flags(self, user: str, redis: bool = False) -> list[str]:
        """The flags naming `user`'s own credential files (paths: no secret in `ps`). With
        external servers and no --credentials-dir, none: those servers' own business."""
        a, c, root = self.args, self.creds, self.creds_dir
        own = a.credentials_dir is not None
        flags = []
        if own or not a.nats_url:
            flags += ["--nats-credentials", str(c.nats_file(root, user).resolve())]
        if redis and (own or not a.redis_url):
            flags += ["--redis-credentials", str(c.redis_file(root, user).resolve())]
        return flags

    def _server_tls(self) -> tls_files.ServerTLS | None:
        """The TLS material of the servers `up` starts (None: plain); checks the TLS flags."""
        a = self.args
        for server in ("nats", "redis"):
            if getattr(a, f"{server}_tls_ca_file") and not getattr(a, f"{server}_url"):
                raise ValueError(
                    f"--{server}-tls-ca-file is for an external server (--{server}-url): the "
                    f"{server} server `up` starts uses --tls or --tls-dir"
                )
        if a.tls and a.tls_dir is not None:
            raise ValueError("give --tls (make a CA here) or --tls-dir DIR, not both")
        if a.tls_dir is not None:
            return tls_files.ServerTLS.from_dir(a.tls_dir)
        if a.tls:
            return tls_files.make_tls(Path(self.workdir.name) / "tls")
        return None

    def _tls_flags(self, redis: bool = False) -> list[str]:
        """The CA file(s) a child verifies NATS (and Redis) with: the external server's own
        (--nats-tls-ca-file ...), else that of --tls / --tls-dir."""
        a, flags = self.args, []
        servers = ("nats", "redis") if redis else ("nats",)
        for server in servers:
            ca = getattr(a, f"{server}_tls_ca_file")
            ca = Path(ca).resolve() if ca else (self.tls.ca_file if self.tls else None)
            flags += [] if ca is None else [f"--{server}-tls-ca-file", str(ca)]
        return flags

    def _grants(self) -> list[creds.EngineGrant]:
        """What each engine to start may do on the bus: its id, bucket and P/D mode."""

        def flag(flags: list[str], name: str, default: str) -> str:
            return flags[flags.index(name) + 1] if name in flags else default

        return [
            creds.EngineGrant(
                name,
                flag(extra, "--bucket", "default"),
                flag(extra, "--disaggregation-mode", "colocated"),
            )
            for name, extra in self.engines()
        ]

    def _record_meta(self) -> dict[str, object]:
        """What the record header says about this mesh (docs/recording.md)."""
        a = self.args
        return {
            "model": a.model,
            "served_model_name": a.served_model_name or a.model,
            "dtype": a.dtype,
            "page_size": a.page_size,
            "mesh_flags": _up_flags(getattr(a, "command_line", None) or sys.argv[1:]),
            "engine_flags": {name: engine_argv(a) + extra for name, extra in self.engines()},
        }

    def engines(self) -> list[tuple[str, list[str]]]:
        """(engine id, flags beyond the shared engine flags) of every engine to start."""
        a = self.args
        if self.declared:
            out = []
            for b in self.buckets:
                flags = ["--bucket", b.name]
                flags += [] if b.tp is None else ["--tp-size", str(b.tp)]
                flags += [] if b.pp is None else ["--pp-size", str(b.pp)]
                flags += [] if b.cp is None else ["--cp-size", str(b.cp)]
                out += [(f"{b.name}-{i}", flags) for i in range(b.engines or a.engines)]
            return out
        if not a.pd:
            return [(f"engine-{i}", []) for i in range(a.engines)]
        decode = ["--disaggregation-mode", "decode"]
        if a.decode_max_total_tokens:
            decode += ["--max-total-tokens", str(a.decode_max_total_tokens)]
        prefill = ["--disaggregation-mode", "prefill", *pd_transfer_argv(a)]
        return [(f"prefill-{i}", prefill) for i in range(a.num_prefill)] + [
            (f"decode-{i}", decode) for i in range(a.num_decode)
        ]

    def _wait_healthy(self, url: str, timeout_s: float, stopping: Callable[[], bool]) -> None:
        """Return once our router is ready with every engine we started (`wait_ready`);
        a child that died during startup raises with its name and exit code."""
        engines = {name for name, _ in self.engines()}
        router = self.supervisor.children["router"].pid
        wait_ready(url, engines, router, timeout_s, stopping, self.supervisor.exited)

    def stop(self) -> None:
        self.supervisor.stop()
        self.workdir.cleanup()


def _up_flags(command_line: list[str]) -> list[str]:
    """`hicache-mesh up`'s flags from its command line (without the subcommand)."""
    return command_line[1:] if command_line[:1] == ["up"] else command_line


def run_up(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    command_line = getattr(args, "command_line", None) or sys.argv[1:]
    if any(f == "--api-key" or f.startswith("--api-key=") for f in command_line):
        logging.getLogger("up").warning(
            "--api-key on the command line shows in `ps` to every local user: it is "
            "deprecated; give $HICACHE_ROUTER_API_KEY or --api-key-file FILE instead"
        )
    try:
        check_port_free(args.host, args.port)  # before anything starts: nothing to undo
    except PortInUseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        mesh = Mesh(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        url = mesh.start(lambda: stopping)
        mesh.supervisor.write_status()
        buckets = ", ".join(b.name for b in mesh.buckets)
        print(
            f"hicache-mesh is up and ready: {url}  (every bucket can serve: {buckets}; "
            f"OpenAI API at {url}/v1; Ctrl-C stops it)",
            flush=True,
        )
        while not stopping:
            mesh.supervisor.poll()
            time.sleep(0.1)
    except StartupStopped:
        pass
    except (RuntimeError, TimeoutError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        code = 1
    finally:
        mesh.stop()
    return code
