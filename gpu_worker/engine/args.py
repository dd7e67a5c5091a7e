"""Engine command-line flags (named like SGLang's) and their mapping to EngineConfig."""

from __future__ import annotations

import argparse

from gpu_worker.cache.hicache import LOAD_POLICIES, WRITE_POLICIES, CacheConfig
from gpu_worker.engine.engine import EngineConfig
from gpu_worker.memory.host_pool import HOST_LAYOUTS
from gpu_worker.scheduler.scheduler import SchedulerConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        "--model-path",
        dest="model",
        default="tiny",
        help="preset name (tiny) or a Hugging Face checkpoint directory",
    )
    g.add_argument(
        "--dtype", default="float64", choices=["float64", "float32", "bfloat16", "float16"]
    )
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    g.add_argument("--model-seed", type=int, default=0, help="seed of a preset's random weights")
    g.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="max prompt + output tokens (default: the model's); a preset's random weights "
        "take any length, a checkpoint is capped at its own",
    )
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    g.add_argument(
        "--max-total-tokens", type=int, default=32768, help="device KV pool size in tokens"
    )
    g.add_argument("--chunked-prefill-size", type=int, default=512)
    g.add_argument("--max-running-requests", type=int, default=64)
    g.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="no prefix reuse at all (the oracle's cold run)",
    )
    g.add_argument(
        "--disaggregation-mode",
        default="null",
        choices=["null", "prefill", "decode"],
        help="P/D role of the engine (null: colocated prefill and decode)",
    )
    g.add_argument(
        "--disaggregation-decode-enable-radix-cache",
        action="store_true",
        help="decode engines reuse their own prefix cache (off: every turn's KV "
        "comes from prefill)",
    )
    g.add_argument(
        "--debug-fail-loads",
        type=int,
        default=0,
        help="test hook: the next N host->device loads fail",
    )
    h = parser.add_argument_group("hierarchical cache")
    h.add_argument(
        "--enable-hierarchical-cache",
        action="store_true",
        help="back the device cache with a host-memory tier",
    )
    h.add_argument(
        "--hicache-ratio",
        type=float,
        default=2.0,
        help="host pool size as a multiple of the device pool",
    )
    h.add_argument(
        "--hicache-size",
        type=float,
        default=0.0,
        help="host pool size in GB (overrides --hicache-ratio when > 0)",
    )
    h.add_argument("--hicache-write-policy", default="write_through", choices=WRITE_POLICIES)
    h.add_argument("--hicache-mem-layout", default="layer_first", choices=HOST_LAYOUTS)
    h.add_argument(
        "--hicache-load-policy",
        default="always",
        choices=LOAD_POLICIES,
        help="cost: load a host hit only when the measured copy is cheaper than "
        "recomputing it (single-rank engines)",
    )
    h.add_argument(
        "--hicache-write-through-threshold",
        type=int,
        default=2,
        help="hits before write_through_selective backs a node up",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    page_size = args.page_size
    if page_size <= 0 or args.max_total_tokens < page_size:
        raise ValueError("--page-size must be positive and --max-total-tokens >= --page-size")
    cache = CacheConfig(
        page_size=page_size,
        num_device_pages=args.max_total_tokens // page_size,
        enable_radix_cache=not args.disable_radix_cache
        and (args.disaggregation_mode != "decode" or args.disaggregation_decode_enable_radix_cache),
        enable_hierarchical_cache=args.enable_hierarchical_cache,
        hicache_ratio=args.hicache_ratio,
        hicache_size_gb=args.hicache_size,
        hicache_write_policy=args.hicache_write_policy,
        hicache_mem_layout=args.hicache_mem_layout,
        write_through_threshold=args.hicache_write_through_threshold,
        debug_fail_loads=args.debug_fail_loads,
        hicache_load_policy=args.hicache_load_policy,
    )
    sched = SchedulerConfig(args.chunked_prefill_size, args.max_running_requests)
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        seed=args.model_seed,
        context_len=args.context_length,
        cache=cache,
        scheduler=sched,
    )


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of `args` as a command line (only those not at their default).

    `hicache-mesh up` passes its engine flags on to each engine process with this, so the
    flags an engine gets are exactly the ones `add_engine_args` defines.
    """
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    argv: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv
