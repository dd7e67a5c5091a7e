"""`hicache-mesh up`'s command line: its own flags, the engine flags it passes on, and the
router's timeouts it passes on (`ROUTER_TIMEOUTS`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from bus_schemas.connection import add_nats_url_arg
from services.engine.flags import add_engine_args, add_pd_transfer_args
from services.launch.router_flags import add_router_flags
from services.launch.servers import NATS_MAX_PAYLOAD
from services.launch.supervisor import RestartPolicy


def add_up_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    add_nats_url_arg(
        parser,
        None,
        "use this NATS (or these servers of a NATS cluster: comma-separated or repeated) instead of starting one",
    )
    parser.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    parser.add_argument(
        "--redis-replicas",
        type=int,
        default=0,
        metavar="N",
        help="start a replicated Redis instead: a primary, N replicas and 3 sentinels; the "
        "index and the router find the primary through Sentinel and follow its failovers",
    )
    parser.add_argument(
        "--credentials-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="NATS and Redis credentials made by `hicache-mesh credentials DIR` (for external "
        "servers given those configs); default: fresh ones in up's work directory at every "
        "start, so restarting `up` rotates them",
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
        "--nats-cluster",
        type=int,
        default=1,
        metavar="N",
        help="start N nats-servers clustered with routes (N >= 2; 1: one server): the same "
        "users, permissions and TLS on each, routes authenticated (and over TLS with --tls); "
        "every child gets all N URLs and fails over between them",
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
        metavar="NAME[:tp=N,pp=N,cp=N,max_len=N,engines=N]",
        help="an engine bucket with its own parallel layout, serving prompt + max_tokens up "
        "to max_len (repeat for several; services/launch/buckets.py); default: one bucket "
        "'default' of --engines engines",
    )
    parser.add_argument(
        "--buckets-file",
        type=Path,
        default=None,
        metavar="FILE.toml",
        help="the buckets as [[bucket]] tables (name, tp, pp, cp, max_len, engines)",
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
