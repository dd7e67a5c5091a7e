"""`hicache-mesh replay FILE`: replay recorded traffic against a mesh and compare.

Against a running mesh (`--url`), or on meshes it starts: `--mesh-args "UP FLAGS"` gives one
mesh (arm `replay`); without `--mesh-args` the recording's own mesh flags, less those that
would bind or write where the recording mesh did (`services.replay.target`). `--arms
cache,cold` gives one mesh per named arm, each those flags plus the arm's flags from
`ARM_FLAGS` (`cold` adds `--disable-radix-cache`), started, replayed and stopped in turn, as
`hicache-mesh bench` does. Every arm is compared with the recording, every later arm with
the first. `--warmup N` sends N requests unmeasured first (then flushes the cache), so a
freshly started mesh is not measured cold against a recording of a mesh that was serving.

Exit status: 0 when every status and every compared output matches (and, with
`--strict-cache`, every cached-token count) and no p50 rose beyond its `--max-*-regression`
limit; 1 otherwise, naming the first mismatch; 2 for bad arguments or an unreadable input.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from services.bench.cli import Arm, admin_key, check_arms_differ, flush_cache, mesh_up_args
from services.replay.client import ClientConfig, ReplayClient, Replayed
from services.replay.flags import ARM_FLAGS
from services.replay.plan import Pace, ReplayRequest, plan
from services.replay.plot import plot
from services.replay.recording import Recording
from services.replay.report import render
from services.replay.sources import read_mooncake_trace, read_source
from services.replay.summary import (
    ArmTarget,
    ReplayResult,
    Thresholds,
    summarize,
)
from services.replay.target import (
    RecordedFlags,
    check_writes,
    other_segments_differ,
    recorded_flags,
)

SINGLE_ARM = "replay"  # the arm's name without --arms


def arms_from_args(
    args: argparse.Namespace, recording: Recording
) -> tuple[list[Arm], RecordedFlags | None]:
    """The meshes to start (none with --url), and the recorded flags they came from (None:
    from --mesh-args); ValueError when the flags do not say which."""
    if args.url is not None:
        if args.arms is not None or args.mesh_args is not None:
            raise ValueError("--url replays against a running mesh: drop --arms and --mesh-args")
        return [], None
    recorded = None
    if args.mesh_args is None:
        recorded = recorded_flags(recording)
        common = list(recorded.kept)
    else:
        common = shlex.split(args.mesh_args)
    if args.arms is None:
        return [Arm(SINGLE_ARM, tuple(common))], recorded
    names = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [n for n in names if n not in ARM_FLAGS]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(f"--arms {args.arms!r}: distinct names among {', '.join(ARM_FLAGS)}")
    return [Arm(n, (*common, *ARM_FLAGS[n])) for n in names], recorded


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
    admin_api_key_file: str | None = None  # the key /flush_cache takes where the router has one
    flush_cache: bool = False
    show_progress: bool = True
    num_warmup: int = 0  # requests sent unmeasured before the measured run

    def __post_init__(self) -> None:
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("--num-requests must be positive")
        if self.num_warmup < 0:
            raise ValueError("--warmup must be >= 0")
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
            admin_api_key_file=args.admin_api_key_file,
            flush_cache=args.flush_cache,
            show_progress=not args.disable_tqdm,
            num_warmup=args.warmup,
        )


def warmup_plan(requests: list[ReplayRequest], n: int) -> list[ReplayRequest]:
    """The first `n` requests of the plan (cycled when it holds fewer), all sent at once (as
    the concurrency cap allows)."""
    return [replace(requests[i % len(requests)], send_at_s=0.0) for i in range(n)]


def replay_at(
    config: ReplayConfig,
    arm: str,
    url: str,
    requests: list[ReplayRequest],
    api_key: str | None,
    fresh: bool = False,
    flush_key: str | None = None,
) -> list[Replayed]:
    """The plan sent to the mesh at `url`, one result per request in plan order; `fresh`:
    the replay started that mesh (its cache is flushed after a warmup, with `flush_key`
    where the router has an admin key)."""
    url = url.rstrip("/")
    client = ClientConfig(
        base_url=url,
        pace=config.pace,
        request_timeout_s=config.request_timeout_s,
        api_key=api_key,
        show_progress=config.show_progress,
    )
    if config.num_warmup:
        warm = asyncio.run(
            ReplayClient(client).run(f"{arm} warmup", warmup_plan(requests, config.num_warmup))
        )
        failed = sum(not r.observation.ok for r in warm)
        print(
            f"arm {arm}: {config.num_warmup} warmup requests sent, unmeasured ({failed} failed)",
            file=sys.stderr,
            flush=True,
        )
    if config.flush_cache or (fresh and config.num_warmup):
        flush_cache(url, flush_key or api_key)
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
        api_key = config.api_key or up_args.api_key
        flush_key = admin_key(config.admin_api_key_file, up_args)
        return replay_at(config, arm, url, requests, api_key, fresh=True, flush_key=flush_key)
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
    for h in recording.headers:
        if h.token_ids != "keep":
            raise ValueError(
                f"{args.file}:{h.line}: recorded with --record-token-ids {h.token_ids}: it holds "
                "no token ids to send or compare; replay needs a recording made with "
                "--record-token-ids keep"
            )
    arms, recorded = arms_from_args(args, recording)
    with contextlib.ExitStack() as stack:
        if recorded is not None:
            _announce(args.file, recording, recorded)
            if recorded.storage:  # never the recording mesh's store: a fresh one per arm
                arms = [_with_storage_dir(arm, stack) for arm in arms]
        resolved = [(arm, mesh_up_args(arm)) for arm in arms]
        check_arms_differ(resolved)
        report_path, plot_path = _outputs(args)
        writes: list[tuple[str, str | Path | None]] = [
            ("--report", report_path),
            ("--plot", plot_path),
        ]
        for arm, up_args in resolved:
            writes += [
                (f"arm {arm.name}'s --record", up_args.record),
                (f"arm {arm.name}'s --status-file", up_args.status_file),
            ]
        check_writes(args.file, writes)
        records = recording.requests[: config.num_requests]
        if not records:
            raise ValueError(f"{args.file}: no request lines to replay")
        requests = plan(records, config.pace)
        by_arm: dict[str, tuple[ArmTarget, list[Replayed]]] = {}
        try:
            if args.url is not None:
                replayed = replay_at(
                    config,
                    SINGLE_ARM,
                    args.url,
                    requests,
                    config.api_key,
                    flush_key=admin_key(config.admin_api_key_file),
                )
                by_arm[SINGLE_ARM] = (ArmTarget(args.url, False, config.num_warmup), replayed)
            for arm, up_args in resolved:
                target = ArmTarget(
                    f"hicache-mesh up {shlex.join(arm.up_flags)}", True, config.num_warmup
                )
                by_arm[arm.name] = (target, replay_on_mesh(config, arm.name, up_args, requests))
        except (RuntimeError, TimeoutError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    result = summarize(
        recording, records, requests, by_arm, config.pace, config.strict_cache, config.thresholds
    )
    return _finish(args, result)


def _announce(path: Path, recording: Recording, recorded: RecordedFlags) -> None:
    print(f"replaying on the mesh {path} was recorded with: {recorded.describe()}", file=sys.stderr)
    if other_segments_differ(recording):
        print(
            f"note: later segments of {path} name other mesh flags; the first segment's are "
            'used (--mesh-args "UP FLAGS" chooses)',
            file=sys.stderr,
        )


def _with_storage_dir(arm: Arm, stack: contextlib.ExitStack) -> Arm:
    directory = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"replay-{arm.name}-"))
    return Arm(arm.name, (*arm.up_flags, "--hicache-storage-dir", directory))


def _finish(args: argparse.Namespace, result: ReplayResult) -> int:
    report_path, plot_path = _outputs(args)
    for note in result.notes():
        print(f"note: {note}", file=sys.stderr)
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
