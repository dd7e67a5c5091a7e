"""The engine flags (`flags.py`) mapped onto an `EngineConfig` (this one imports torch)."""

from __future__ import annotations

import argparse
import logging

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.cache.storage_io import StorageFaults
from gpu_worker.cache.storage_tier import PrefetchTimeout
from gpu_worker.cache.transfer import DelayInjection
from gpu_worker.engine.engine import DebugHooks, EngineConfig
from gpu_worker.engine.nodes import NodeLayout
from gpu_worker.model.config import resolve_dtype
from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.scheduler.scheduler import SchedulerConfig
from gpu_worker.scheduler.spec_config import SELF_DRAFT, SpecConfig

log = logging.getLogger(__name__)


def _rank_raise(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    try:
        rank, token = (int(part) for part in value.split(":"))
    except ValueError:
        raise ValueError(f"--debug-rank-raise wants RANK:TOKEN, got {value!r}") from None
    return rank, token


def node_layout_from_args(args: argparse.Namespace) -> NodeLayout:
    """`--dist-init-addr`, `--nnodes`, `--node-rank` (`flags.add_node_args`), checked
    against the engine's world (TP x PP x CP ranks split evenly over the nodes)."""
    layout = NodeLayout(args.dist_init_addr, args.nnodes, args.node_rank)
    layout.ranks_per_node(args.tp_size * args.pp_size * args.cp_size)
    return layout


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    page_size = args.page_size
    if page_size <= 0 or args.max_total_tokens < page_size:
        raise ValueError("--page-size must be positive and --max-total-tokens >= --page-size")
    if args.debug_transfer_delay_ms < 0:
        raise ValueError("--debug-transfer-delay-ms must be >= 0")
    if not args.debug_layer_delay_ms >= 0:
        raise ValueError("--debug-layer-delay-ms must be >= 0")
    if not args.cp_gather_buffer_mb > 0:
        raise ValueError(f"--cp-gather-buffer-mb must be positive, got {args.cp_gather_buffer_mb}")
    delay = DelayInjection(args.debug_transfer_delay_ms) if args.debug_transfer_delay_ms else None
    radix = not args.disable_radix_cache and (
        args.disaggregation_mode != "decode" or args.disaggregation_decode_enable_radix_cache
    )
    storage = args.hicache_storage_backend
    if storage is not None and not radix:
        # a cache-less engine (a P/D decode engine without its radix cache) has nothing to
        # store or prefetch: the mesh-wide storage flags do not apply to it
        log.info("no radix cache on this engine: --hicache-storage-backend is off")
        storage = None
    cache = CacheConfig(
        page_size=page_size,
        num_device_pages=args.max_total_tokens // page_size,
        enable_radix_cache=radix,
        enable_hierarchical_cache=args.enable_hierarchical_cache,
        hicache_ratio=args.hicache_ratio,
        hicache_size_gb=args.hicache_size,
        hicache_write_policy=args.hicache_write_policy,
        hicache_mem_layout=args.hicache_mem_layout,
        write_through_threshold=args.hicache_write_through_threshold,
        transfer_delay=delay,
        debug_fail_loads=args.debug_fail_loads,
        hicache_load_policy=args.hicache_load_policy,
        hicache_storage_backend=storage,
        hicache_storage_dir=args.hicache_storage_dir,
        hicache_storage_size_gb=args.hicache_storage_size,
        hicache_storage_key_file=args.hicache_storage_key_file,
        hicache_storage_prefetch_policy=args.hicache_storage_prefetch_policy,
        prefetch_timeout=PrefetchTimeout(
            args.hicache_storage_prefetch_timeout_base,
            args.hicache_storage_prefetch_timeout_per_ki_token,
            args.hicache_storage_prefetch_timeout_max,
        ),
        hicache_storage_write_policy=args.hicache_storage_write_policy,
        hicache_storage_write_threshold=args.hicache_storage_write_threshold,
        hicache_storage_key_scheme=args.hicache_storage_key_scheme,
        storage_layer_partition=args.hicache_storage_layer_partition,
        storage_head_partition=args.hicache_storage_head_partition,
        storage_faults=StorageFaults(read_delay_ms=args.debug_storage_read_delay_ms)
        if args.debug_storage_read_delay_ms
        else None,
    )
    sched = SchedulerConfig(
        args.chunked_prefill_size,
        args.max_running_requests,
        cp_gather_buffer_mb=args.cp_gather_buffer_mb,
    )
    debug = DebugHooks(
        args.debug_disable_agreement,
        _rank_raise(args.debug_rank_raise),
        perturb_sampler=args.debug_perturb_sampler,
        silent_flush=args.debug_silent_flush,
        layer_delay_s=args.debug_layer_delay_ms / 1000,
    )
    spec = SpecConfig(
        args.speculative_algorithm,
        args.speculative_draft_model_path,
        args.speculative_num_steps,
        _draft_quantization(args),
        args.speculative_draft_host_mode,
    )
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        seed=args.model_seed,
        context_len=args.context_length,
        cache=cache,
        scheduler=sched,
        parallel=ParallelConfig(
            args.tp_size,
            args.pp_size,
            args.cp_size,
            args.enable_kv_cache_sharding,
            args.cp_split,
            args.cp_gather_transport,
        ),
        batch_invariant=args.enable_deterministic_inference,
        spec=spec,
        debug=debug,
    )


def _draft_quantization(args: argparse.Namespace) -> str:
    """`--speculative-draft-quantization`, or its default: int8 for a `self` draft of a model
    that does not run in float64 (a real checkpoint: the int8 self-draft is the measured
    choice for SmolLM2), none for anything else (another draft model is used as given; a
    float64 preset's self draft is the tests' exact copy)."""
    if args.speculative_draft_quantization is not None:
        return str(args.speculative_draft_quantization)
    dtype = resolve_dtype(args.dtype, args.model, args.device)
    return (
        "int8" if args.speculative_draft_model_path == SELF_DRAFT and dtype != "float64" else "none"
    )
