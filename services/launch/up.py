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
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from services.engine.flags import (
    add_engine_args,
    add_pd_transfer_args,
    engine_argv,
    pd_transfer_argv,
)
from services.launch import credentials as creds
from services.launch import tls as tls_files
from services.launch.buckets import LaunchBucket, check, load_buckets, parse_bucket
from services.launch.router_flags import add_router_flags, router_flags_argv
from services.launch.servers import (
    NATS_MAX_PAYLOAD,
    ServerKind,
    free_port,
    nats_kind,
    redis_kind,
)
from services.launch.supervisor import ChildSpec, RestartPolicy, Supervisor

ROUTER_TIER, SERVICE_TIER, SERVER_TIER = 2, 1, 0  # stop order: router, services, servers


def add_up_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--nats-url", default=None, help="use this NATS instead of starting one")
    parser.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    parser.add_argument(
        "--credentials-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="NATS and Redis credentials made by `hicache-mesh credentials DIR` (for external "
        "servers given those configs); default: fresh ones in up's work directory",
    )
    tls = parser.add_argument_group("TLS for NATS and Redis (deployments across hosts)")
    tls.add_argument(
        "--tls",
        action="store_true",
        help="make a private CA and a server certificate (needs `openssl`) in the work "
        "directory: the servers `up` starts serve TLS only, every child verifies them",
    )
    tls.add_argument(
        "--tls-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="the same with DIR's ca.pem, server.pem and server-key.pem (0600), e.g. made by "
        "`hicache-mesh credentials DIR --tls-hosts ...` (in DIR/tls)",
    )
    for server in ("nats", "redis"):
        tls.add_argument(
            f"--{server}-tls-ca-file",
            default=None,
            metavar="PEM",
            help=f"with --{server}-url: the CA that signed that server's certificate; the "
            "children connect over TLS only, verifying it",
        )
    parser.add_argument("--engines", type=int, default=1, help="colocated engines to start")
    pd = parser.add_argument_group("prefill/decode disaggregation")
    pd.add_argument(
        "--pd",
        action="store_true",
        help="start prefill and decode engines instead of colocated ones",
    )
    pd.add_argument("--num-prefill", type=int, default=1)
    pd.add_argument("--num-decode", type=int, default=1)
    pd.add_argument(
        "--decode-max-total-tokens",
        type=int,
        default=None,
        help="device KV pool of decode engines (default: --max-total-tokens)",
    )
    parser.add_argument(
        "--nats-max-payload",
        type=int,
        default=NATS_MAX_PAYLOAD,
        metavar="BYTES",
        help="max_payload of the nats-server `up` starts (P/D KV frames are sized from what "
        "the server announces)",
    )
    add_pd_transfer_args(parser)
    parser.add_argument(
        "--bucket",
        action="append",
        metavar="NAME[:tp=N,pp=N,max_len=N,engines=N]",
        help="an engine bucket with its own parallel layout, serving prompt + max_tokens up "
        "to max_len (repeat for several; services/launch/buckets.py); default: one bucket "
        "'default' of --engines engines",
    )
    parser.add_argument(
        "--buckets-file",
        type=Path,
        default=None,
        metavar="FILE.toml",
        help="the buckets as [[bucket]] tables (name, tp, pp, max_len, engines)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("HICACHE_ROUTER_API_KEY"),
        help="the router requires it (default: $HICACHE_ROUTER_API_KEY); it reaches the router "
        "in a 0600 file, never on its command line. Deprecated as a flag (`ps` shows up's own "
        "command line): give the variable or --api-key-file",
    )
    parser.add_argument(
        "--api-key-file", default=None, metavar="FILE", help="the router reads its key here"
    )
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="the router's cap on completions and chat that send no max_tokens (default: "
        "up to the context length minus the prompt)",
    )
    parser.add_argument(
        "--record",
        default=None,
        metavar="FILE",
        help="record the traffic as JSON lines for `hicache-mesh replay` (docs/recording.md)",
    )
    parser.add_argument(
        "--record-redact",
        action="store_true",
        help="records keep only known-safe request fields (sampling numbers), no text",
    )
    parser.add_argument("--heartbeat-interval", type=float, default=1.0)
    add_router_flags(parser)
    parser.add_argument(
        "--max-engines",
        type=int,
        default=None,
        metavar="N",
        help="engines the router tracks and the index indexes at once (default 512 each)",
    )
    add_router_timeout_args(parser)
    parser.add_argument("--startup-timeout", type=float, default=120.0)
    parser.add_argument(
        "--status-file",
        type=Path,
        default=None,
        help="keep a JSON file with each child's pid, port and restart count",
    )
    parser.add_argument(
        "--restart-backoff",
        type=float,
        default=RestartPolicy().initial_s,
        help="seconds before the first restart of a dead child (doubles up to 10 s)",
    )
    add_engine_args(parser)


PROGRESS_ROUNDS = 3  # --request-timeout spans at least this many heartbeat intervals
# the router's timeouts `up` passes on: (its flag, help); unset ones keep the router's default
ROUTER_TIMEOUTS = (
    (
        "--request-timeout",
        "longest an engine may send nothing on a request and show no progress on it "
        "(router default 30; a busy engine's long prefill shows progress)",
    ),
    (
        "--pd-admit-timeout",
        "P/D: wait for a decode engine to admit a request (default 10; alias "
        "--disaggregation-admit-timeout)",
    ),
    (
        "--pd-transfer-timeout",
        "P/D: how long decode engines wait for KV while the prefill engine shows no progress "
        "(default 0.8 x --request-timeout; alias --disaggregation-transfer-timeout)",
    ),
    ("--read-timeout", "a request's headers, then its body, must arrive within this (default 30)"),
)


# the same settings under SGLang-style P/D names (one flag each, two spellings)
ROUTER_TIMEOUT_ALIASES = {
    "--pd-admit-timeout": ("--disaggregation-admit-timeout",),
    "--pd-transfer-timeout": ("--disaggregation-transfer-timeout",),
}


def add_router_timeout_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("router timeouts (seconds)")
    for flag, help_text in ROUTER_TIMEOUTS:
        names = [flag, *ROUTER_TIMEOUT_ALIASES.get(flag, ())]
        g.add_argument(*names, type=_positive_seconds, default=None, metavar="S", help=help_text)


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


class PortInUseError(RuntimeError):
    pass


class StartupStopped(Exception):
    """Ctrl-C or SIGTERM arrived before the mesh was healthy."""


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


class Mesh:
    """The specs of one mesh's processes, started in order under one Supervisor."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
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
        if args.api_key and args.api_key_file:
            raise ValueError("give the API key once: --api-key or --api-key-file, not both")
        self.declared = bool(declared)  # else one bucket "default" of the shared flags
        self.buckets = declared or [LaunchBucket("default")]
        self.workdir = tempfile.TemporaryDirectory(prefix="hicache-mesh-")
        self.creds_dir = args.credentials_dir or Path(self.workdir.name) / "credentials"
        grants = self._grants()
        if args.credentials_dir is None:
            self.creds = creds.MeshCredentials.fresh(grants)
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
        self._ports = {args.port}  # chosen for this mesh: the servers' ports avoid them
        self.supervisor = Supervisor(
            RestartPolicy(initial_s=args.restart_backoff), args.status_file
        )

    def start(self, stopping: Callable[[], bool] = lambda: False) -> str:
        """Start everything; the router URL once healthy. Raises StartupStopped when
        `stopping()` turns true first."""
        a = self.args
        check_port_free(a.host, a.port)
        url = f"http://{a.host}:{a.port}"
        self.supervisor.extra_status["url"] = url
        self.supervisor.extra_status["credentials_dir"] = str(self.creds_dir)
        nats_url = a.nats_url or self._server(self.nats)
        redis_url = a.redis_url or self._server(self.redis)
        py = sys.executable
        index = [py, "-m", "services.index", "--nats-url", nats_url, "--redis-url", redis_url]
        index += self._credential_flags(creds.INDEX, redis=True) + self._max_engines_argv()
        index += self._tls_flags(redis=True)
        self.supervisor.start(ChildSpec("index", index, SERVICE_TIER))
        for name, extra in self._engines():
            argv = [py, "-m", "services.engine", "--engine-id", name]
            argv += ["--nats-url", nats_url, "--heartbeat-interval", str(a.heartbeat_interval)]
            argv += self._credential_flags(creds.engine_user(name)) + self._tls_flags()
            self.supervisor.start(ChildSpec(name, argv + engine_argv(a) + extra, SERVICE_TIER))
        self.supervisor.start(
            ChildSpec("router", self._router_argv(nats_url, redis_url), ROUTER_TIER, a.port)
        )
        self._wait_healthy(url, a.startup_timeout, stopping)
        return url

    def _server(self, kind: ServerKind) -> str:
        """Start nats/redis on a free port that stays its port across restarts."""
        port = free_port(avoid=self._ports)  # not the router's, nor the other server's
        self._ports.add(port)
        workdir = Path(self.workdir.name) / kind.name
        workdir.mkdir()
        url = kind.url.format(port)
        self.supervisor.extra_status[f"{kind.name}_url"] = url
        argv, ready = kind.argv(port, str(workdir)), kind.ready(port, str(workdir))
        self.supervisor.start(ChildSpec(kind.name, argv, SERVER_TIER, port, ready, quiet=True))
        return url

    def _router_argv(self, nats_url: str, redis_url: str) -> list[str]:
        a = self.args
        argv = [sys.executable, "-m", "router", "--host", a.host, "--port", str(a.port)]
        argv += ["--nats-url", nats_url, "--redis-url", redis_url]
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
            for name, extra in self._engines()
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
            "engine_flags": {name: engine_argv(a) + extra for name, extra in self._engines()},
        }

    def _engines(self) -> list[tuple[str, list[str]]]:
        """(engine id, flags beyond the shared engine flags) of every engine to start."""
        a = self.args
        if self.declared:
            out = []
            for b in self.buckets:
                flags = ["--bucket", b.name]
                flags += [] if b.tp is None else ["--tp-size", str(b.tp)]
                flags += [] if b.pp is None else ["--pp-size", str(b.pp)]
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
        """Return once our router's /ready is 200 (every bucket has a ready engine of each
        role it needs) and lists every engine we started as ready. A child dying during
        startup is a configuration error, not a fault to heal: raise with its name and exit
        code. On timeout the error says what /ready still missed."""
        engines = {name for name, _ in self._engines()}
        router = self.supervisor.children["router"].pid
        deadline = time.monotonic() + timeout_s
        missing = "the router did not answer"
        while time.monotonic() < deadline and not stopping():
            for child in self.supervisor.exited():
                raise RuntimeError(
                    f"{child.spec.name} exited with code {child.proc.returncode if child.proc else None} during startup"
                )
            answer = _get_ready(url)
            # another mesh's router on a port drawn at the same moment is not ours (ours
            # then fails to bind, and exits: raised above)
            if answer is not None and answer[1].get("pid") == router:
                status, body = answer
                ready = {
                    engine_id
                    for bucket in body.get("buckets", {}).values()
                    for ids in bucket.get("engines", {}).values()
                    for engine_id in ids
                }
                if status == 200 and engines <= ready:
                    return
                missing = "; ".join(body.get("missing") or []) or (
                    f"engines not ready yet: {', '.join(sorted(engines - ready))}"
                )
            time.sleep(0.2)
        if stopping():
            raise StartupStopped("stopped during startup")
        raise TimeoutError(f"the mesh at {url} was not ready within {timeout_s}s: {missing}")

    def stop(self) -> None:
        self.supervisor.stop()
        self.workdir.cleanup()


def _get_ready(url: str) -> tuple[int, dict[str, Any]] | None:
    """(status, body) of the router's /ready, or None when it does not answer in JSON."""
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=1) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:  # 503: not ready, the body says why
        with e:
            try:
                return e.code, json.loads(e.read())
            except ValueError:
                return None
    except (urllib.error.URLError, ConnectionError, OSError, ValueError):
        return None


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
