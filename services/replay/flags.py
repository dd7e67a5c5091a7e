"""The flags of `hicache-mesh replay` (`services.replay.cli` runs them), apart from what runs
them, so the `hicache-mesh` parser (`services/parser.py`) builds without importing the run."""

from __future__ import annotations

import argparse
from pathlib import Path

from services.bench.mooncake import TRACE_BLOCK_SIZE
from services.replay.sources import DEFAULT_SOURCE, SOURCES
from services.replay.summary import parse_percent

# `--arms` names -> flags added to `--mesh-args` for that arm's mesh
ARM_FLAGS: dict[str, list[str]] = {"cache": [], "cold": ["--disable-radix-cache"]}


def _percent(text: str) -> float:
    try:
        return parse_percent(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_replay_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, help="the recorded traffic (`up --record FILE`)")
    parser.add_argument(
        "--format",
        default=DEFAULT_SOURCE,
        choices=sorted(SOURCES),
        help="the input's format (services/replay/sources.py): a --record file, or a "
        "Mooncake trace (sent and measured, nothing to compare)",
    )
    parser.add_argument(
        "--mooncake-block-size",
        type=int,
        default=TRACE_BLOCK_SIZE,
        metavar="N",
        help="--format mooncake: tokens per hash id (the trace's 512, or fewer for a small "
        "model: every request scales by N/512)",
    )
    t = parser.add_argument_group("target")
    t.add_argument("--url", default=None, help="replay against this running mesh")
    t.add_argument(
        "--mesh-args",
        default=None,
        metavar='"UP FLAGS"',
        help="without --url: start a mesh with these `hicache-mesh up` flags for the replay "
        "(default: the recording's own, less its port, --record and what else would bind or "
        "write where the recording mesh did)",
    )
    t.add_argument(
        "--arms",
        default=None,
        help=f"one mesh per named arm, in order; arms: {', '.join(ARM_FLAGS)}"
        " (cold adds --disable-radix-cache); outputs are compared between arms too",
    )
    t.add_argument("--api-key", default=None)
    t.add_argument(
        "--admin-api-key-file",
        default=None,
        metavar="FILE",
        help="the router's admin key, for /flush_cache where the mesh has one",
    )
    t.add_argument("--flush-cache", action="store_true", help="POST /flush_cache before replaying")
    t.add_argument(
        "--warmup",
        type=int,
        default=0,
        metavar="N",
        help="send the first N requests unmeasured before the measured run, then flush the "
        "cache (on a running mesh: only with --flush-cache), so a fresh mesh is not measured "
        "cold against a recording of a warm one",
    )
    p = parser.add_argument_group("pace")
    p.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="recorded gaps divided by this (2: twice as fast); 0: as fast as allowed",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight")
    p.add_argument(
        "--num-requests", type=int, default=None, help="replay only the first N recorded"
    )
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--disable-tqdm", action="store_true")
    c = parser.add_argument_group("checks")
    c.add_argument(
        "--strict-cache",
        action="store_true",
        help="cached tokens per tier that differ from the reference count as mismatches",
    )
    for metric in ("ttft", "itl", "e2e"):
        c.add_argument(
            f"--max-{metric}-regression",
            type=_percent,
            default=None,
            metavar="PCT",
            help=f"fail when the replayed {metric.upper()} p50 exceeds the recorded one by "
            "more than PCT (e.g. 10%%); default: not checked",
        )
    o = parser.add_argument_group("output")
    o.add_argument("--report", type=Path, default=None, help="markdown (default: FILE.replay.md)")
    o.add_argument("--plot", type=Path, default=None, help="PNG (default: FILE.replay.png)")
    o.add_argument("--no-plot", action="store_true", help="write no figure")
