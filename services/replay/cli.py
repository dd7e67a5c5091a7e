"""`hicache-mesh replay FILE`: replay recorded traffic against a mesh and compare.

Against a running mesh (`--url`), or on meshes it starts: `--mesh-args "UP FLAGS"` gives one
mesh (arm `replay`); `--arms cache,cold` gives one per named arm, each `--mesh-args` plus
the arm's flags from `ARM_FLAGS` (`cold` adds `--disable-radix-cache`), started, replayed
and stopped in turn, as `hicache-mesh bench` does. Every arm is compared with the recording,
every later arm with the first.

Exit status: 0 when every status and every compared output matches (and, with
`--strict-cache`, every cached-token count) and no p50 rose beyond its `--max-*-regression`
limit; 1 otherwise, naming the first mismatch; 2 for bad arguments or an unreadable input.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from services.bench.cli import Arm, check_arms_differ, flush_cache, mesh_up_args
from services.bench.mooncake import TRACE_BLOCK_SIZE
from services.replay.client import ClientConfig, ReplayClient, Replayed
from services.replay.plan import Pace, ReplayRequest, plan
from services.replay.plot import plot
from services.replay.recording import Recording
from services.replay.report import mesh_command, render
from services.replay.sources import DEFAULT_SOURCE, SOURCES, read_mooncake_trace, read_source
from services.replay.summary import ReplayResult, Thresholds, parse_percent, summarize

# `--arms` names -> flags added to `--mesh-args` for that arm's mesh
ARM_FLAGS: dict[str, list[str]] = {"cache": [], "cold": ["--disable-radix-cache"]}
SINGLE_ARM = "replay"  # the arm's name without --arms


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
        help="without --url: start a mesh with these `hicache-mesh up` flags for the replay",
    )
    t.add_argument(
        "--arms",
        default=None,
        help=f"with --mesh-args: one mesh per named arm, in order; arms: {', '.join(ARM_FLAGS)}"
        " (cold adds --disable-radix-cache); outputs are compared between arms too",
    )
    t.add_argument("--api-key", default=None)
    t.add_argument("--flush-cache", action="store_true", help="POST /flush_cache before replaying")
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


def arms_from_args(args: argparse.Namespace, recording: Recording) -> list[Arm]:
    """The meshes to start (none with --url); ValueError when the flags do not say which."""
    if args.url is not None:
        if args.arms is not None or args.mesh_args is not None:
            raise ValueError("--url replays against a running mesh: drop --arms and --mesh-args")
        return []
    if args.mesh_args is None:
        flags = recording.headers[0].mesh_flags
        hint = "" if flags is None else f"; it was recorded with `{mesh_command(flags)}`"
        raise ValueError(
            f'give --url URL (a running mesh) or --mesh-args "UP FLAGS" (a mesh to start){hint}'
        )
    common = shlex.split(args.mesh_args)
    if args.arms is None:
        return [Arm(SINGLE_ARM, tuple(common))]
    names = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [n for n in names if n not in ARM_FLAGS]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(f"--arms {args.arms!r}: distinct names among {', '.join(ARM_FLAGS)}")
    return [Arm(n, (*common, *ARM_FLAGS[n])) for n in names]


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """How to replay and what fails it, from the command line (validated before any mesh
    starts)."""

    pace: Pace
    thresholds: Thresholds
    strict_cache: bool = False
    num_requests: int | None = None  # the first N request lines; None: all
    request_timeout_s: float = 600.0
    api_key: str | None = None
    flush_cache: bool = False
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("--num-requests must be positive")
        if not self.request_timeout_s > 0:
            raise ValueError("--request-timeout must be positive")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ReplayConfig:
        return cls(
            pace=Pace(args.speed, args.max_concurrency),
            thresholds=Thresholds(
                args.max_ttft_regression, args.max_itl_regression, args.max_e2e_regression
            ),
            strict_cache=args.strict_cache,
            num_requests=args.num_requests,
            request_timeout_s=args.request_timeout,
            api_key=args.api_key,
            flush_cache=args.flush_cache,
            show_progress=not args.disable_tqdm,
        )


def replay_at(
    config: ReplayConfig, arm: str, url: str, requests: list[ReplayRequest], api_key: str | None
) -> list[Replayed]:
    """The plan sent to the mesh at `url`, one result per request in plan order."""
    url = url.rstrip("/")
    if config.flush_cache:
        flush_cache(url, api_key)
    client = ClientConfig(
        base_url=url,
        pace=config.pace,
        request_timeout_s=config.request_timeout_s,
        api_key=api_key,
        show_progress=config.show_progress,
    )
    return asyncio.run(ReplayClient(client).run(arm, requests))


def replay_on_mesh(
    config: ReplayConfig, arm: str, up_args: argparse.Namespace, requests: list[ReplayRequest]
) -> list[Replayed]:
    """The plan sent to a mesh started for it (every engine ready), stopped afterwards."""
    from services.launch.up import Mesh

    mesh = Mesh(up_args)
    try:
        url = mesh.start()
        print(f"arm {arm}: mesh up at {url}", file=sys.stderr, flush=True)
        return replay_at(config, arm, url, requests, config.api_key or up_args.api_key)
    finally:
        mesh.stop()


def _outputs(args: argparse.Namespace) -> tuple[Path, Path | None]:
    report = args.report or args.file.with_suffix(".replay.md")
    if args.no_plot:
        return report, None
    return report, args.plot or args.file.with_suffix(".replay.png")


def run_replay(args: argparse.Namespace) -> int:
    config = ReplayConfig.from_args(args)  # ValueError (exit 2) before anything runs
    try:
        if args.format == "mooncake":
            recording = read_mooncake_trace(args.file, args.mooncake_block_size)
        else:
            recording = read_source(args.file, args.format)
    except OSError as e:
        raise ValueError(f"cannot read {args.file}: {e.strerror or e}") from None
    resolved = [(arm, mesh_up_args(arm)) for arm in arms_from_args(args, recording)]
    check_arms_differ(resolved)
    records = recording.requests[: config.num_requests]
    if not records:
        raise ValueError(f"{args.file}: no request lines to replay")
    requests = plan(records, config.pace)
    by_arm: dict[str, tuple[str, list[Replayed]]] = {}
    try:
        if args.url is not None:
            replayed = replay_at(config, SINGLE_ARM, args.url, requests, config.api_key)
            by_arm[SINGLE_ARM] = (args.url, replayed)
        for arm, up_args in resolved:
            target = f"hicache-mesh up {shlex.join(arm.up_flags)}"
            by_arm[arm.name] = (target, replay_on_mesh(config, arm.name, up_args, requests))
    except (RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    result = summarize(
        recording, records, requests, by_arm, config.pace, config.strict_cache, config.thresholds
    )
    return _finish(args, result)


def _finish(args: argparse.Namespace, result: ReplayResult) -> int:
    report_path, plot_path = _outputs(args)
    if plot_path is not None:
        plot(result, plot_path)
    report_path.write_text(render(result, plot_path))
    for a in result.arms:
        print(
            f"arm {a.arm}: {len(a.verdicts)} requests, {a.num_compared} outputs compared, "
            f"{len(a.mismatches(result.strict_cache))} mismatches, "
            f"{len(a.cache_differences)} with other cached tokens"
        )
    for d in result.diffs:
        print(
            f"arm {d.arm} vs {d.base}: {d.num_compared} outputs compared, "
            f"{len(d.mismatches(result.strict_cache))} differ; cached tokens {d.base} had and "
            f"{d.arm} did not: {d.missing.total} (device {d.missing.device}, host "
            f"{d.missing.host}, storage {d.missing.storage})"
        )
    print(f"report: {report_path}" + (f", plot: {plot_path}" if plot_path else ""))
    failures = result.failures()
    for line in failures:
        print(f"FAIL {line}", file=sys.stderr)
    return 1 if failures else 0
