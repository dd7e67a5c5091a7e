"""Benchmark the relayout between the KV pool and `page_unified`: the Triton kernel and the
torch reference against a plain contiguous `copy_` of the same number of bytes.

    python benchmarks/bench_relayout.py              # CUDA if present, else CPU
    python benchmarks/bench_relayout.py --num-transfers 64 --group-heads 1 --iters 50

Two directions: backup (device pool -> unified staging buffer, the object order a store
writes) and load (unified staging -> device pool). On CUDA (default shape: 32 layers,
page_size 64, 8 KV heads in groups of 2, head_dim 128, bf16; 256 random pages out of a
512-page pool) it times the Triton kernel and the torch reference with CUDA events, the
median of `--iters` runs. On CPU it times only the torch path on a smaller shape: Triton
runs on CPU only in its interpreter, which is not a timing.

GB/s counts the bytes copied once (not read + written).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

# Run as a script from a checkout where the project is not pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_worker.kernels.relayout import RunView, relayout_pages_torch, relayout_pages_triton
from gpu_worker.model.config import parse_dtype


@dataclass(frozen=True, slots=True)
class Shape:
    """The per-page geometry of an MHA KV pool and its head grouping."""

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    group_heads: int
    dtype: torch.dtype

    @property
    def num_groups(self) -> int:
        return self.num_kv_heads // self.group_heads

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all layers, K and V."""
        numel = self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim
        return numel * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    run: Callable[[], object]  # one relayout; its result is ignored


def pool_view(shape: Shape, num_pages: int, device: torch.device) -> RunView:
    """The device pool: (num_layers, 2, num_pages * page_size, num_kv_heads, head_dim)."""
    tensor = torch.empty(
        (shape.num_layers, 2, num_pages * shape.page_size, shape.num_kv_heads, shape.head_dim),
        dtype=shape.dtype,
        device=device,
    )
    return RunView.pool(tensor.normal_(), shape.page_size, shape.group_heads)


def unified_view(shape: Shape, num_pages: int, device: torch.device) -> RunView:
    """(num_pages, num_groups, num_layers, 2, page_size, group_heads, head_dim), zeros."""
    tensor = torch.zeros(
        (
            num_pages,
            shape.num_groups,
            shape.num_layers,
            2,
            shape.page_size,
            shape.group_heads,
            shape.head_dim,
        ),
        dtype=shape.dtype,
        device=device,
    )
    return RunView.unified(tensor)


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Median milliseconds of `fn`: CUDA events on CUDA, the wall clock on CPU."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def report(title: str, cases: list[Case], nbytes: int, args: argparse.Namespace) -> None:
    """Time each case and print a table; the first case is the baseline of the ratios."""
    device = torch.device(args.device)
    print(f"\n{title}  ({nbytes / 2**20:.1f} MiB per relayout)")
    print(f"  {'case':<36} {'ms':>9} {'GB/s':>9} {'vs ' + cases[0].name:>16}")
    base_ms = None
    for case in cases:
        ms = time_ms(case.run, device, args.warmup, args.iters)
        base_ms = base_ms or ms
        print(f"  {case.name:<36} {ms:>9.3f} {nbytes / ms / 1e6:>9.1f} {base_ms / ms:>15.2f}x")


def check_triton(shape: Shape, pool: RunView, staging: RunView, pool_ids: torch.Tensor) -> None:
    """Exit unless Triton and the torch reference agree bit for bit, both directions."""
    staging_ids = torch.arange(pool_ids.numel(), device=pool_ids.device)
    unified_ref = RunView.unified(torch.zeros_like(staging.tensor))
    relayout_pages_triton(pool, staging, pool_ids, staging_ids)
    relayout_pages_torch(pool, unified_ref, pool_ids, staging_ids)
    if not torch.equal(staging.tensor, unified_ref.tensor):
        raise SystemExit("triton and torch disagree on pool -> unified")
    del unified_ref
    pools = [
        RunView.pool(torch.zeros_like(pool.tensor), shape.page_size, shape.group_heads)
        for _ in range(2)
    ]
    relayout_pages_triton(staging, pools[0], staging_ids, pool_ids)
    relayout_pages_torch(staging, pools[1], staging_ids, pool_ids)
    if not torch.equal(pools[0].tensor, pools[1].tensor):
        raise SystemExit("triton and torch disagree on unified -> pool")


def bench(shape: Shape, args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    n = args.num_transfers
    pool = pool_view(shape, args.num_pages, device)
    staging = unified_view(shape, n, device)
    pool_ids = torch.randperm(args.num_pages)[:n].to(device)
    staging_ids = torch.arange(n, device=device)
    pool_run = pool.tensor.view(-1)[: staging.tensor.numel()]  # n pages' worth, contiguous
    staging_flat = staging.tensor.view(-1)
    if on_cuda:
        check_triton(shape, pool, staging, pool_ids)
    else:
        print(
            "CPU: timing the torch path only. Triton runs on CPU only in its interpreter "
            "(TRITON_INTERPRET=1), which is not a timing."
        )

    backup = [Case("copy_ (contiguous)", partial(staging_flat.copy_, pool_run))]
    load = [Case("copy_ (contiguous)", partial(pool_run.copy_, staging_flat))]
    if on_cuda:
        backup.append(
            Case("triton", partial(relayout_pages_triton, pool, staging, pool_ids, staging_ids))
        )
        load.append(
            Case("triton", partial(relayout_pages_triton, staging, pool, staging_ids, pool_ids))
        )
    backup.append(
        Case("torch reference", partial(relayout_pages_torch, pool, staging, pool_ids, staging_ids))
    )
    load.append(
        Case("torch reference", partial(relayout_pages_torch, staging, pool, staging_ids, pool_ids))
    )
    nbytes = n * shape.page_bytes
    report("backup: pool (layer_first) -> unified staging, random pages", backup, nbytes, args)
    report("load: unified staging -> pool (layer_first), random pages", load, nbytes, args)


def parse_args() -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--num-layers", type=int, default=32 if cuda else 8)
    parser.add_argument("--page-size", type=int, default=64 if cuda else 16)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--group-heads", type=int, default=2, help="KV heads per head group")
    parser.add_argument("--dtype", default="bfloat16", help="float32, bfloat16, float16, float64")
    parser.add_argument("--num-pages", type=int, default=512 if cuda else 64, help="pool pages")
    parser.add_argument("--num-transfers", type=int, default=256 if cuda else 32)
    parser.add_argument("--warmup", type=int, default=5 if cuda else 2)
    parser.add_argument("--iters", type=int, default=20 if cuda else 10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.num_transfers > args.num_pages:
        parser.error("--num-transfers must not exceed --num-pages")
    if args.group_heads <= 0 or args.num_kv_heads % args.group_heads:
        parser.error("--group-heads must divide --num-kv-heads")
    return args


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    shape = Shape(
        args.num_layers,
        args.page_size,
        args.num_kv_heads,
        args.head_dim,
        args.group_heads,
        parse_dtype(args.dtype),
    )
    print(
        f"shape: {shape.num_layers} layers, page_size {shape.page_size}, "
        f"{shape.num_kv_heads} kv heads in {shape.num_groups} groups of {shape.group_heads}, "
        f"head_dim {shape.head_dim}, {shape.dtype}; {args.num_transfers} of {args.num_pages} "
        f"pages, {shape.page_bytes / 2**20:.2f} MiB/page"
    )
    device = torch.device(args.device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            bench(shape, args)
    else:
        bench(shape, args)


if __name__ == "__main__":
    main()
