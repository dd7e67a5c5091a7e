"""Benchmark the CP gather: its time per layer at 1K / 8K / 32K-token prefixes, with one
scratch buffer (the gather runs when its layer starts) and with two (the next layer's gather
runs while this layer attends).

    python benchmarks/bench_cp_gather.py                      # N = 2 and 4, CPU gloo
    python benchmarks/bench_cp_gather.py --cp-sizes 2 --prefixes 1024 --rounds 1

For each CP size one gloo world of N rank processes runs every case; within it, `--rounds`
interleaved rounds (1 buffer, 2 buffers, compute only; A B C A B C) so machine noise hits
every case alike. One step is a prefill chunk of `--chunk` new tokens over the prefix
(pages in owner-cycle order, so each rank owns 1/N of them), every layer: `before_attention`
(the gather), the chunk's `set_kv`, `get_kv` of the whole sequence and causal SDPA. Figures
are medians over rounds of the per-layer mean, on rank 0:

- gather ms: time inside `before_attention` (with two buffers, only the part the prefetch
  did not hide);
- step ms: the whole layer; compute ms: the same layer on a replicated pool (no gather);
- overhead: step / compute - 1.

On CPU the ranks share the machine's cores with each other and with gloo's threads, so the
overlap saves less than on a GPU with copy engines; the figures are this machine's.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

# Run as a script from a checkout where the project is not pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_worker.memory.device_pool import DeviceKVPool
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.memory.sharded_pool import ShardedDeviceKVPool
from gpu_worker.model.config import parse_dtype
from gpu_worker.model.forward_batch import ForwardBatch

ARMS = ("1 buffer", "2 buffers", "compute")


def one_step(pool: DeviceKVPool | ShardedDeviceKVPool, batch: ForwardBatch, new_slots, kv, q):
    """One prefill chunk through every layer; returns (gather seconds, step seconds)."""
    gather = 0.0
    start = time.perf_counter()
    for layer in range(pool.spec.num_layers):
        t = time.perf_counter()
        pool.before_attention(layer, batch)
        gather += time.perf_counter() - t
        pool.set_kv(layer, new_slots, *kv)
        k, v = pool.get_kv(layer, batch.slot_ids[0])  # (S, H, D)
        F.scaled_dot_product_attention(
            q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=False
        )
    return gather, time.perf_counter() - start


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=600)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    group = dist.new_group(list(range(world)), timeout=timeout)
    dtype = parse_dtype(args.dtype)
    spec = KVSpec(args.layers, args.kv_heads, args.head_dim, args.page_size, dtype)
    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for prefix in args.prefixes:
        seq_len = prefix + args.chunk
        num_pages = spec.pages_for(seq_len) + world
        pools: dict[str, DeviceKVPool | ShardedDeviceKVPool] = {
            "1 buffer": ShardedDeviceKVPool(spec, num_pages, cpu, rank, world, group, 1),
            "2 buffers": ShardedDeviceKVPool(spec, num_pages, cpu, rank, world, group, 2),
            "compute": DeviceKVPool(spec, num_pages, cpu),
        }
        pages = list(range(spec.pages_for(seq_len)))  # owner cycle 0, 1, .., N-1, 0, ..
        slots = pools["compute"].slot_ids(pages, seq_len)
        batch = ForwardBatch.build([([0] * args.chunk, prefix, slots)], cpu)
        new_slots = slots[prefix:]
        shape = (args.chunk, args.kv_heads, args.head_dim)
        kv = [torch.randn(shape, generator=gen).to(dtype) for _ in range(2)]
        q = torch.randn((1, args.kv_heads, args.chunk, args.head_dim), generator=gen).to(dtype)
        for pool in pools.values():  # the prefix's KV, written once
            for layer in range(spec.num_layers):
                full = [torch.randn((seq_len, *shape[1:]), generator=gen).to(dtype)] * 2
                pool.set_kv(layer, slots, *full)
        for arm in ARMS:  # warm-up: scratch buffers allocated, plans built once
            batch = ForwardBatch.build([([0] * args.chunk, prefix, slots)], cpu)
            one_step(pools[arm], batch, new_slots, kv, q)
        measured: dict[str, list[tuple[float, float]]] = {arm: [] for arm in ARMS}
        for _ in range(args.rounds):
            for arm in ARMS:
                dist.barrier(group)
                batch = ForwardBatch.build([([0] * args.chunk, prefix, slots)], cpu)
                measured[arm].append(one_step(pools[arm], batch, new_slots, kv, q))
        sharded = pools["2 buffers"]
        assert isinstance(sharded, ShardedDeviceKVPool)
        scratch = sharded.scratch_bytes_for(sharded.plan(batch))
        rows.append((prefix, measured, sharded.device_bytes(), scratch))
        del pools
    dist.barrier(group)
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def run_world(world: int, args: argparse.Namespace) -> list:
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, args, out)) for r in range(world)]
    for proc in procs:
        proc.start()
    rows = out.get(timeout=args.timeout_s)
    for proc in procs:
        proc.join(60)
    return rows  # type: ignore[no-any-return]


def cpu_name() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return platform.processor()
    for line in text.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--prefixes", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--chunk", type=int, default=128, help="new tokens per step")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads; torch {torch.__version__}")
    print(
        f"{args.layers} layers, {args.kv_heads} KV heads x {args.head_dim}, page "
        f"{args.page_size}, {args.dtype}, chunk {args.chunk}, {args.rounds} rounds (median)"
    )
    header = f"{'N':>2} {'prefix':>7} {'arm':>9} {'gather ms':>10} {'step ms':>9} {'overhead':>9}"
    for world in args.cp_sizes:
        print(f"\n{header}")
        for prefix, measured, device_bytes, scratch in run_world(world, args):
            per_layer = {
                arm: [statistics.median(x[i] for x in runs) * 1e3 / args.layers for i in (0, 1)]
                for arm, runs in measured.items()
            }
            compute = per_layer["compute"][1]
            for arm in ARMS:
                gather, step = per_layer[arm]
                shown = f"{gather:10.3f}" if arm != "compute" else f"{'-':>10}"
                over = f"{step / compute - 1:+9.1%}" if arm != "compute" else f"{'-':>9}"
                print(f"{world:>2} {prefix:>7} {arm:>9} {shown} {step:9.3f} {over}")
            print(
                f"   device bytes/rank {device_bytes / 2**20:.2f} MiB, "
                f"scratch (2 buffers) {scratch / 2**20:.2f} MiB"
            )


if __name__ == "__main__":
    main()
