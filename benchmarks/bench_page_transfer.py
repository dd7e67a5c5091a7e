"""Benchmark page transfers: the Triton kernel and the torch reference against a plain
contiguous `copy_` of the same number of bytes.

    python benchmarks/bench_page_transfer.py              # CUDA if present, else CPU
    python benchmarks/bench_page_transfer.py --num-transfers 64 --iters 50

On CUDA (default shape: 32 layers, page_size 64, 8 KV heads, head_dim 128, bf16; 256 random
pages out of a 512-page pool) it times, with CUDA events and the median of `--iters` runs:
device pool -> device staging buffer, device pool -> pinned host, pinned host -> device
pool. On CPU it times only the torch path on a small shape: Triton runs on CPU only in its
interpreter, which is not a timing.

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

from gpu_worker.kernels.page_transfer import (
    PageView,
    transfer_pages_torch,
    transfer_pages_triton,
)
from gpu_worker.model.config import parse_dtype


@dataclass(frozen=True, slots=True)
class Shape:
    """The per-page geometry of a KV pool."""

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def page_numel(self) -> int:
        """Elements of one (page, layer, kv) block."""
        return self.page_size * self.num_kv_heads * self.head_dim

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all layers, K and V."""
        return self.num_layers * 2 * self.page_numel * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    run: Callable[[], object]  # one transfer; its result is ignored


def layer_first_pool(shape: Shape, num_pages: int, device: torch.device) -> PageView:
    """A device-style pool: (num_layers, 2, num_pages * page_size, num_kv_heads, head_dim)."""
    slots = num_pages * shape.page_size
    tensor = torch.empty(
        (shape.num_layers, 2, slots, shape.num_kv_heads, shape.head_dim),
        dtype=shape.dtype,
        device=device,
    )
    return PageView.layer_first(tensor.normal_(), shape.page_size)


def page_first_pool(
    shape: Shape, num_pages: int, device: torch.device, pin: bool = False
) -> PageView:
    """(num_pages, num_layers, 2, page_size, num_kv_heads, head_dim); pinned if `pin`."""
    tensor = torch.zeros(
        (num_pages, shape.num_layers, 2, shape.page_size, shape.num_kv_heads, shape.head_dim),
        dtype=shape.dtype,
        device=device,
        pin_memory=pin,
    )
    return PageView.page_first(tensor)


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
    print(f"\n{title}  ({nbytes / 2**20:.1f} MiB per transfer)")
    print(f"  {'case':<44} {'ms':>9} {'GB/s':>9} {'vs ' + cases[0].name:>16}")
    base_ms = None
    for case in cases:
        ms = time_ms(case.run, device, args.warmup, args.iters)
        base_ms = base_ms or ms
        print(f"  {case.name:<44} {ms:>9.3f} {nbytes / ms / 1e6:>9.1f} {base_ms / ms:>15.2f}x")


def random_ids(num_pages: int, n: int, device: torch.device) -> torch.Tensor:
    """`n` distinct page ids in [0, num_pages), int64 on `device`."""
    return torch.randperm(num_pages)[:n].to(device)


def bench_cuda(shape: Shape, args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    cpu = torch.device("cpu")
    n = args.num_transfers
    pool = layer_first_pool(shape, args.num_pages, device)
    staging = page_first_pool(shape, n, device)
    host_pool = page_first_pool(shape, args.num_pages, cpu, pin=True)
    host_staging = page_first_pool(shape, n, cpu, pin=True)
    pool_ids = random_ids(args.num_pages, n, device)
    host_ids = random_ids(args.num_pages, n, cpu)
    staging_ids = torch.arange(n, device=device)
    pool_run = pool.tensor.view(-1)[: staging.tensor.numel()]  # n pages' worth, contiguous
    staging_flat = staging.tensor.view(-1)
    host_flat = host_staging.tensor.view(-1)

    transfer_pages_triton(pool, staging, pool_ids, staging_ids)
    expected = page_first_pool(shape, n, device)
    transfer_pages_torch(pool, expected, pool_ids, staging_ids)
    if not torch.equal(staging.tensor, expected.tensor):
        raise SystemExit("triton and torch disagree on device pool -> staging")
    del expected

    def d2h_triton() -> None:
        transfer_pages_triton(pool, staging, pool_ids, staging_ids)
        host_flat.copy_(staging_flat, non_blocking=True)

    def h2d_triton() -> None:
        staging_flat.copy_(host_flat, non_blocking=True)
        transfer_pages_triton(staging, pool, staging_ids, pool_ids)

    d2d = [
        Case("copy_ (contiguous)", partial(staging_flat.copy_, pool_run)),
        Case("triton", partial(transfer_pages_triton, pool, staging, pool_ids, staging_ids)),
        Case(
            "torch reference", partial(transfer_pages_torch, pool, staging, pool_ids, staging_ids)
        ),
    ]
    d2h = [
        Case("copy_ (contiguous)", partial(host_flat.copy_, pool_run, non_blocking=True)),
        Case("triton -> device staging, copy_ -> host", d2h_triton),
        Case("torch reference", partial(transfer_pages_torch, pool, host_pool, pool_ids, host_ids)),
    ]
    h2d = [
        Case("copy_ (contiguous)", partial(pool_run.copy_, host_flat, non_blocking=True)),
        Case("copy_ -> device staging, triton", h2d_triton),
        Case("torch reference", partial(transfer_pages_torch, host_pool, pool, host_ids, pool_ids)),
    ]
    nbytes = n * shape.page_bytes
    report("device pool -> device staging (page_first)", d2d, nbytes, args)
    report("device pool -> pinned host page_first", d2h, nbytes, args)
    report("pinned host page_first -> device pool", h2d, nbytes, args)


def bench_cpu(shape: Shape, args: argparse.Namespace) -> None:
    cpu = torch.device("cpu")
    n = args.num_transfers
    pool = layer_first_pool(shape, args.num_pages, cpu)
    staging = page_first_pool(shape, n, cpu)
    host_pool = page_first_pool(shape, args.num_pages, cpu)
    pool_ids = random_ids(args.num_pages, n, cpu)
    host_ids = random_ids(args.num_pages, n, cpu)
    staging_ids = torch.arange(n)
    pool_run = pool.tensor.view(-1)[: staging.tensor.numel()]
    print(
        "CPU: timing the torch path only. Triton runs on CPU only in its interpreter "
        "(TRITON_INTERPRET=1), which is not a timing."
    )
    cases = [
        Case("copy_ (contiguous)", partial(staging.tensor.view(-1).copy_, pool_run)),
        Case(
            "torch: pool -> staging",
            partial(transfer_pages_torch, pool, staging, pool_ids, staging_ids),
        ),
        Case(
            "torch: pool -> host page_first",
            partial(transfer_pages_torch, pool, host_pool, pool_ids, host_ids),
        ),
        Case(
            "torch: host page_first -> pool",
            partial(transfer_pages_torch, host_pool, pool, host_ids, pool_ids),
        ),
    ]
    report("pool (layer_first) <-> page_first, random pages", cases, n * shape.page_bytes, args)


def parse_args() -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--num-layers", type=int, default=32 if cuda else 4)
    parser.add_argument("--page-size", type=int, default=64 if cuda else 16)
    parser.add_argument("--num-kv-heads", type=int, default=8 if cuda else 4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", help="float32, bfloat16, float16, float64")
    parser.add_argument("--num-pages", type=int, default=512 if cuda else 64, help="pool pages")
    parser.add_argument("--num-transfers", type=int, default=256 if cuda else 32)
    parser.add_argument("--warmup", type=int, default=5 if cuda else 2)
    parser.add_argument("--iters", type=int, default=20 if cuda else 10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.num_transfers > args.num_pages:
        parser.error("--num-transfers must not exceed --num-pages")
    return args


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    shape = Shape(
        args.num_layers, args.page_size, args.num_kv_heads, args.head_dim, parse_dtype(args.dtype)
    )
    print(
        f"shape: {shape.num_layers} layers, page_size {shape.page_size}, "
        f"{shape.num_kv_heads} kv heads, head_dim {shape.head_dim}, {shape.dtype}; "
        f"{args.num_transfers} of {args.num_pages} pages, {shape.page_bytes / 2**20:.2f} MiB/page"
    )
    device = torch.device(args.device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            bench_cuda(shape, args)
    else:
        bench_cpu(shape, args)


if __name__ == "__main__":
    main()
