"""The flags of `hicache-mesh bench` (`services.bench.cli` runs them), apart from what runs
them, so the `hicache-mesh` parser (`services/parser.py`) builds without importing the run."""

from __future__ import annotations

import argparse

from services.bench.mooncake import TRACE_BLOCK_SIZE

# `--arms` shorthand: arm name -> flags added to `--mesh-args` for that arm's mesh.
ARM_FLAGS: dict[str, list[str]] = {
    "baseline": [],
    "tree": ["--disaggregation-decode-enable-radix-cache"],
    "colocated": [],
}
DEFAULT_ARMS = "baseline,tree"
DEFAULT_ROUNDS = 3


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    d = parser.add_argument_group("dataset")
    d.add_argument(
        "--dataset-name",
        default="generated-shared-prefix",
        choices=["generated-shared-prefix", "mooncake"],
    )
    d.add_argument("--dataset-path", default=None, help="mooncake: the trace file (JSON lines)")
    d.add_argument("--gsp-num-groups", type=int, default=64)
    d.add_argument("--gsp-prompts-per-group", type=int, default=16)
    d.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    d.add_argument("--gsp-question-len", type=int, default=128)
    d.add_argument("--gsp-output-len", type=int, default=256)
    d.add_argument("--gsp-num-turns", type=int, default=1)
    d.add_argument(
        "--gsp-range-ratio",
        type=float,
        default=1.0,
        help="lengths drawn uniformly from [ratio * len, len]; 1 = exact",
    )
    d.add_argument(
        "--mooncake-block-size",
        type=int,
        default=TRACE_BLOCK_SIZE,
        help=f"tokens per hash id; other than {TRACE_BLOCK_SIZE}, every request's lengths "
        f"scale by N / {TRACE_BLOCK_SIZE} (a small model)",
    )
    d.add_argument(
        "--use-trace-timestamps",
        action="store_true",
        help="mooncake: start each request at its timestamp (instead of --request-rate)",
    )
    d.add_argument(
        "--mooncake-slowdown-factor",
        type=float,
        default=1.0,
        help="with --use-trace-timestamps: 2 replays the trace twice as slowly",
    )
    d.add_argument(
        "--bound-page-size",
        type=int,
        default=None,
        help="mooncake with --base-url: the server's page size, for the upper bound of cached "
        "tokens (default: the engine's default; a mesh arm uses its own --page-size)",
    )
    d.add_argument("--seed", type=int, default=1)
    d.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="conversations, or a trace's first requests (default: all of them)",
    )
    c = parser.add_argument_group("load")
    c.add_argument("--max-concurrency", type=int, default=None, help="conversations at once")
    c.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="conversation starts per second, Poisson arrivals (inf: all at once)",
    )
    c.add_argument(
        "--warmup-requests",
        type=int,
        default=1,
        help="unmeasured first-turn requests sent to each mesh when it is up, before its "
        "first round",
    )
    c.add_argument(
        "--num-rounds",
        type=int,
        default=DEFAULT_ROUNDS,
        help="interleaved rounds: each runs the whole workload on every arm, one arm after "
        "the other (A B, B A, ...); figures show their spread over the rounds",
    )
    c.add_argument(
        "--cache-salt-per-round",
        action="store_true",
        help="each round's requests carry a cache_salt of their own, so no round reuses KV "
        "that another left in a tier the flush keeps (external storage)",
    )
    c.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    c.add_argument("--api-key", default=None)
    c.add_argument(
        "--admin-api-key-file",
        default=None,
        metavar="FILE",
        help="the router's admin key, for /flush_cache where the mesh has one (a mesh the "
        "bench starts uses its own --admin-api-key-file)",
    )
    c.add_argument("--disable-tqdm", action="store_true")
    t = parser.add_argument_group("target")
    t.add_argument("--base-url", default=None, help="benchmark this running server")
    t.add_argument("--arm-name", default="server", help="the arm's name with --base-url")
    t.add_argument(
        "--arm",
        action="append",
        default=None,
        metavar='NAME="UP ARGS"',
        help="without --base-url: one arm and its full `hicache-mesh up` flags; repeat per "
        "arm, measured in order (excludes --arms/--mesh-args)",
    )
    t.add_argument(
        "--arms",
        default=None,
        help="without --base-url or --arm: shorthand, a mesh per named arm, in order, each "
        f"with --mesh-args plus the arm's own flags; arms: {', '.join(ARM_FLAGS)} "
        f"(default {DEFAULT_ARMS})",
    )
    t.add_argument(
        "--mesh-args", default="", help="with --arms: `hicache-mesh up` flags common to every arm"
    )
    t.add_argument(
        "--one-mesh-at-a-time",
        action="store_true",
        help="start each arm's mesh for its turn in every round and stop it after (the "
        "memory of one mesh; a start per arm per round) instead of keeping every arm's "
        "mesh up for the whole run",
    )
    o = parser.add_argument_group("output")
    o.add_argument("--output-file", default=None, help="per-request records, JSON lines")
    o.add_argument("--plot", default=None, help="PNG: TTFT CDF and median TTFT by turn")
