"""`hicache-mesh bench`: the multi-turn benchmark, against a running server or per arm.

With `--base-url` it measures that server as one arm (`--arm-name`). Otherwise each arm gets
a mesh of its own (`services.bench.meshes`: all up at once by default, or one at a time). An
arm is explicit, `--arm NAME="UP ARGS"` (repeated; the full `hicache-mesh up` flags of that
arm), or a name of the `--arms` shorthand, which expands to `--mesh-args` plus that arm's
flags from `ARM_FLAGS`. Two arms whose flags resolve to the same mesh are refused (exit 2):
the comparison would measure one setup against itself.

The arms run in `--num-rounds` interleaved rounds: in round k every arm runs the whole
workload once, one arm after the other, starting with arm k mod (number of arms) (A B, B A,
A B, ...), each after a flush of its cache. Load that drifts during the run then lands on
every arm alike, and each figure comes with its spread over the rounds
(`services.bench.report`). Every arm runs the same conversations (same `--seed`) in every
round. Records go to `--output-file` as JSON lines (with their round), a summary per arm
(and each arm against the first, round by round) to stdout, a figure to `--plot`.

The dataset is `generated-shared-prefix` (multi-turn conversations) or `mooncake`, a trace
file (`--dataset-path`, `services.bench.mooncake`): its requests start at `--request-rate`
arrivals in timestamp order, or at the trace's own times with `--use-trace-timestamps`
(stretched by `--mooncake-slowdown-factor`), at most `--max-concurrency` at a time. Each arm
of a trace also prints the offline upper bound of cached tokens at the arm's page size
beside the tokens it cached.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import shlex
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TypeVar

from services.bench.client import BenchClient, ClientConfig
from services.bench.dataset import Conversation, GspConfig, generate_shared_prefix
from services.bench.flags import ARM_FLAGS, DEFAULT_ARMS
from services.bench.meshes import ArmMesh, report_memory, room_for_another
from services.bench.mooncake import (
    MooncakeConfig,
    TraceRequest,
    describe,
    trace_conversations,
    upper_bound,
)
from services.bench.records import RequestResult
from services.bench.report import (
    compare_rounds,
    format_comparison,
    format_summary,
    plot,
    summarize_rounds,
)
from services.parser import build_parser

T = TypeVar("T")
# `hicache-mesh up` options that do not change what is measured (ignored when comparing arms)
_NOT_COMPARED = ("port", "command_line")


@dataclass(frozen=True, slots=True)
class Workload:
    """What every arm runs: the conversations, when they start, and the trace behind them."""

    description: str
    conversations: list[Conversation]
    start_times: list[float] | None = None  # s after the arm's start; None: --request-rate
    trace: list[TraceRequest] | None = None  # a trace's requests (for the upper bound)

    def upper_bound(self, page_size: int) -> int | None:
        """Cached tokens a perfect cache of `page_size` pages gives; None without a trace."""
        return None if self.trace is None else upper_bound(self.trace, page_size)


@dataclass(frozen=True, slots=True)
class Arm:
    """One benchmarked setup: its name and its full `hicache-mesh up` flags."""

    name: str
    up_flags: tuple[str, ...]


def gsp_config_from_args(args: argparse.Namespace) -> GspConfig:
    return GspConfig(
        num_groups=args.gsp_num_groups,
        prompts_per_group=args.gsp_prompts_per_group,
        system_prompt_len=args.gsp_system_prompt_len,
        question_len=args.gsp_question_len,
        output_len=args.gsp_output_len,
        num_turns=args.gsp_num_turns,
        range_ratio=args.gsp_range_ratio,
        seed=args.seed,
        num_prompts=args.num_prompts,
    )


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The dataset the flags name; ValueError for flags of the other dataset or a bad trace."""
    if args.dataset_name == "generated-shared-prefix":
        if args.dataset_path is not None or args.use_trace_timestamps:
            raise ValueError(
                "--dataset-path and --use-trace-timestamps need --dataset-name mooncake"
            )
        gsp = gsp_config_from_args(args)
        return Workload(gsp.describe(), generate_shared_prefix(gsp))
    if args.dataset_path is None:
        raise ValueError("--dataset-name mooncake needs --dataset-path FILE")
    config = MooncakeConfig(
        path=args.dataset_path,
        block_size=args.mooncake_block_size,
        seed=args.seed,
        num_prompts=args.num_prompts,
    )
    requests = config.read()
    start_times = None
    if args.use_trace_timestamps:
        if math.isfinite(args.request_rate):
            raise ValueError("--use-trace-timestamps and --request-rate exclude each other")
        if not args.mooncake_slowdown_factor > 0:
            raise ValueError("--mooncake-slowdown-factor must be positive")
        start_times = [r.arrival_s * args.mooncake_slowdown_factor for r in requests]
    return Workload(
        describe(config, requests), trace_conversations(requests), start_times, requests
    )


def default_page_size() -> int:
    """The engine's default `--page-size`."""
    from services.engine.flags import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return int(parser.parse_args([]).page_size)


def upper_bounds(
    args: argparse.Namespace,
    workload: Workload,
    targets: list[tuple[str, argparse.Namespace | None]],
) -> dict[str, int | None]:
    """Each arm's upper bound of cached tokens at its page size (None without a trace)."""
    if args.bound_page_size is not None and args.base_url is None:
        raise ValueError("--bound-page-size is for --base-url: a mesh arm uses its --page-size")
    if workload.trace is None:
        return dict.fromkeys((arm for arm, _ in targets), None)
    by_page_size: dict[int, int | None] = {}
    bounds: dict[str, int | None] = {}
    for arm, up_args in targets:
        if up_args is not None:
            page_size = int(up_args.page_size)
        else:
            page_size = args.bound_page_size or default_page_size()
        if page_size not in by_page_size:
            by_page_size[page_size] = workload.upper_bound(page_size)
        bounds[arm] = by_page_size[page_size]
    return bounds


def parse_arm(spec: str) -> Arm:
    """`NAME=UP ARGS` (from `--arm`) as an Arm; ValueError when malformed."""
    name, sep, flags = spec.partition("=")
    if not sep or not name.strip() or name.strip().startswith("-"):
        raise ValueError(f'--arm {spec!r}: expected NAME="UP ARGS", e.g. tree="--pd ..."')
    return Arm(name.strip(), tuple(shlex.split(flags)))


def shorthand_arm(name: str, mesh_args: str) -> Arm:
    """An `--arms` name expanded: `--mesh-args` plus the arm's flags from `ARM_FLAGS`."""
    if name not in ARM_FLAGS:
        raise ValueError(f"unknown arm {name!r}; arms: {', '.join(ARM_FLAGS)}")
    return Arm(name, (*shlex.split(mesh_args), *ARM_FLAGS[name]))


def arms_from_args(args: argparse.Namespace) -> list[Arm]:
    """The arms to run, in order, from `--arm` or the `--arms` shorthand."""
    if args.arm:
        if args.arms is not None or args.mesh_args:
            raise ValueError(
                "--arm gives each arm's full flags: do not combine it with --arms or --mesh-args"
            )
        arms = [parse_arm(spec) for spec in args.arm]
    else:
        names = [a.strip() for a in (args.arms or DEFAULT_ARMS).split(",") if a.strip()]
        arms = [shorthand_arm(name, args.mesh_args) for name in names]
    names = [a.name for a in arms]
    if not arms or len(set(names)) != len(names):
        raise ValueError(f"arms need distinct names, got {names}")
    return arms


def mesh_up_args(arm: Arm) -> argparse.Namespace:
    """The `hicache-mesh up` arguments of an arm's mesh (a free port unless given)."""
    from services.launch.servers import free_port

    argv = ["up", "--port", str(free_port()), *arm.up_flags]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed why
        raise ValueError(f"arm {arm.name!r}: `hicache-mesh {shlex.join(argv)}` was rejected") from e
    args.command_line = argv  # what a record header names as the mesh's flags
    return args


def check_arms_differ(resolved: list[tuple[Arm, argparse.Namespace]]) -> None:
    """ValueError when two arms resolve to the same mesh (flag order and the port aside)."""
    seen: dict[tuple[tuple[str, str], ...], Arm] = {}
    for arm, up_args in resolved:
        key = tuple(
            sorted((k, repr(v)) for k, v in vars(up_args).items() if k not in _NOT_COMPARED)
        )
        other = seen.setdefault(key, arm)
        if other is not arm:
            raise ValueError(
                f"arms {other.name!r} and {arm.name!r} resolve to the same mesh "
                f"(`hicache-mesh up {shlex.join(arm.up_flags)}`): the comparison would measure "
                "one setup against itself. Give each arm its own flags with "
                '--arm NAME="UP ARGS", or keep arm-specific flags out of --mesh-args'
            )


def admin_key(path: str | None, up_args: argparse.Namespace | None = None) -> str | None:
    """The admin key for `/flush_cache`: the one line of `path`, else of the started mesh's
    `--admin-api-key-file`; None when neither names one (the ordinary key then flushes)."""
    path = path or (getattr(up_args, "admin_api_key_file", None) if up_args else None)
    return Path(path).read_text().strip() or None if path else None


def flush_cache(base_url: str, api_key: str | None) -> None:
    """POST /flush_cache with `api_key` (the admin key where the router has one)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    req = urllib.request.Request(f"{base_url}/flush_cache", data=b"", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status = resp.status
    except urllib.error.HTTPError as e:
        status = e.code
    except (urllib.error.URLError, OSError) as e:
        print(f"warning: POST {base_url}/flush_cache failed: {e}", file=sys.stderr)
        return
    if status != 200:
        print(f"warning: POST {base_url}/flush_cache answered {status}", file=sys.stderr)


def round_order(items: Sequence[T], round_index: int) -> list[T]:
    """The arms in the order round `round_index` runs them: rotated by one each round."""
    k = round_index % len(items) if items else 0
    return [*items[k:], *items[:k]]


def _warmup(
    args: argparse.Namespace, base_url: str, api_key: str | None, workload: Workload
) -> None:
    client = BenchClient(_client_config(args, base_url, api_key))
    failed = asyncio.run(client.warmup(workload.conversations, args.warmup_requests))
    if failed:
        print(
            f"warning: {failed} of {args.warmup_requests} warmup requests failed", file=sys.stderr
        )


def _client_config(args: argparse.Namespace, base_url: str, api_key: str | None) -> ClientConfig:
    return ClientConfig(
        base_url=base_url.rstrip("/"),
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        seed=args.seed,
        request_timeout_s=args.request_timeout,
        api_key=api_key,
        show_progress=not args.disable_tqdm,
    )


def _measure(
    args: argparse.Namespace,
    arm: str,
    base_url: str,
    api_key: str | None,
    workload: Workload,
    out: IO[str] | None,
    round_index: int,
    flush_key: str | None = None,
) -> list[RequestResult]:
    """One round of `arm`: flush its cache (with `flush_key`, else `api_key`), then every
    conversation once."""
    results: list[RequestResult] = []

    def on_result(r: RequestResult) -> None:
        results.append(r)
        if out is not None:
            out.write(json.dumps(r.to_record()) + "\n")

    flush_cache(base_url.rstrip("/"), flush_key or api_key)
    config = _client_config(args, base_url, api_key)
    if args.cache_salt_per_round:
        config = dataclasses.replace(config, cache_salt=f"bench-round-{round_index}")
    client = BenchClient(config)
    asyncio.run(
        client.run(arm, workload.conversations, on_result, workload.start_times, round_index)
    )
    return results


def _bring_up(args: argparse.Namespace, mesh: ArmMesh, workload: Workload) -> str:
    url = mesh.start()
    print(f"arm {mesh.arm}: mesh up at {url}", file=sys.stderr, flush=True)
    _warmup(args, url, args.api_key or mesh.up_args.api_key, workload)
    return url


def _run_rounds(
    args: argparse.Namespace,
    workload: Workload,
    targets: list[tuple[str, argparse.Namespace | None]],
    out: IO[str] | None,
) -> dict[str, list[RequestResult]]:
    """Every arm's results over the interleaved rounds (see the module doc)."""
    by_arm: dict[str, list[RequestResult]] = {arm: [] for arm, _ in targets}
    meshes = {arm: ArmMesh(arm, up) for arm, up in targets if up is not None}
    at_once = not args.one_mesh_at_a_time
    try:
        if args.base_url is not None:
            _warmup(args, args.base_url, args.api_key, workload)
        elif at_once:
            up: list[ArmMesh] = []
            for each in meshes.values():
                if not room_for_another(up):
                    print(
                        f"note: too little memory left for arm {each.arm}'s mesh beside "
                        f"{len(up)} up (services/bench/meshes.py): one mesh at a time instead",
                        file=sys.stderr,
                    )
                    for m in up:
                        m.stop()
                    at_once = False
                    break
                _bring_up(args, each, workload)
                up.append(each)
            if at_once:
                report_memory(up)
        for k in range(args.num_rounds):
            for arm, _ in round_order(targets, k):
                mesh = meshes.get(arm)
                if mesh is None:
                    url, api_key = args.base_url, args.api_key
                    flush_key = admin_key(args.admin_api_key_file)
                else:
                    flush_key = admin_key(args.admin_api_key_file, mesh.up_args)
                    url = mesh.url or _bring_up(args, mesh, workload)
                    if k == 0 and not at_once:
                        report_memory([mesh])
                    api_key = args.api_key or mesh.up_args.api_key
                print(f"round {k + 1}/{args.num_rounds}: arm {arm}", file=sys.stderr, flush=True)
                by_arm[arm] += _measure(args, arm, url, api_key, workload, out, k, flush_key)
                if mesh is not None and not at_once:
                    mesh.stop()
    finally:
        for each in meshes.values():
            each.stop()
    return by_arm


def run_bench(args: argparse.Namespace) -> int:
    workload = workload_from_args(args)
    if args.num_rounds < 1:
        raise ValueError("--num-rounds must be positive")
    if args.base_url is not None:
        targets: list[tuple[str, argparse.Namespace | None]] = [(args.arm_name, None)]
    else:
        resolved = [(arm, mesh_up_args(arm)) for arm in arms_from_args(args)]  # fail early
        check_arms_differ(resolved)
        targets = [(arm.name, up_args) for arm, up_args in resolved]
    bounds = upper_bounds(args, workload, targets)
    out = open(args.output_file, "w") if args.output_file else None  # noqa: SIM115
    try:
        by_arm = _run_rounds(args, workload, targets, out)
    except (RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if out is not None:
            out.close()
    print(workload.description)
    summaries = [summarize_rounds(arm, results, bounds[arm]) for arm, results in by_arm.items()]
    for s in summaries:
        print(format_summary(s))
    for s in summaries[1:]:
        print(format_comparison(compare_rounds(summaries[0], s)))
    if args.plot:
        plot(by_arm, args.plot, workload.description)
        print(f"plot: {args.plot}")
    return 0 if all(s.pooled.num_failed == 0 for s in summaries) else 1
