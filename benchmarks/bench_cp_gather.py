"""Benchmark the CP gather (issue 22, acceptance 6b and 6c): its share of a prefill step at
1K / 8K / 32K-token prefixes with the all-gather and one scratch buffer (the gather runs
when its layer starts), with two (the next layer's gather runs while this layer attends),
and with the shared-memory transport (`--cp-gather-transport shm`, what CPU ranks of one
host use: every rank's rows in one shared file, attention reads each slot from its
owner's rows, no collective per layer), side by side; and the device bytes per rank of a
sharded pool against a replicated one.

    python benchmarks/bench_cp_gather.py                      # N = 2 and 4, CPU gloo
    python benchmarks/bench_cp_gather.py --cp-sizes 2 --prefixes 1024 --rounds 1
    python benchmarks/bench_cp_gather.py --model-shape smollm2-135m --chunk 512  # served

For each CP size one gloo world of N rank processes runs every case; within it, `--rounds`
interleaved rounds (1 buffer, 2 buffers, shm, compute only; A B C D A B C D) so machine
noise hits every case alike. One step is a prefill chunk of `--chunk` new tokens over the
prefix (pages in owner-cycle order, so each rank owns 1/N of them), every layer:
`before_attention` (the gather), the chunk's `set_kv`, `get_kv` of the whole sequence and
SDPA, then the pass's `after_layers`. The step is attention alone (no projections, no MLP),
so the gather's share is larger here than in a model's step. Figures are medians over rounds of the per-layer mean, on rank 0, with the
spread (max - min over rounds, of the step) beside them.

The gather table, per prefix, one row per arm (the all-gather with 1 or 2 buffers, shm):
- gather ms: time inside `before_attention` (with two buffers, only the part the prefetch
  did not hide; with shm, the pass's two barriers: its reads are `get_kv`'s one copy, as a
  replicated pool's); share: gather / step;
- step ms: the whole layer; compute ms: the same layer on a replicated pool (no gather);
- overhead: step / compute - 1 (the goal, 6b: <= 10% at CP4 8K); vs 1 buf: what the arm
  takes off the one-buffer all-gather's step.

The memory table, per prefix (the pool sized for the prefix and chunk): a replicated pool's
bytes on every rank, a sharded rank's owned rows (its 1/N plus one trash page) and both
scratch buffers as the step's plan sized them, the goal (replicated / N + scratch) and the
ratios.

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

ARMS = ("1 buffer", "2 buffers", "shm", "compute")
# SmolLM2-135M-Instruct, the served default: 30 layers, 9 query heads over 3 KV heads of 64,
# served in float32 on CPU
MODEL_SHAPES = {
    "smollm2-135m": {"layers": 30, "q_heads": 9, "kv_heads": 3, "head_dim": 64, "dtype": "float32"}
}
GATHER_ARMS = ARMS[:3]


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
            q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=False, enable_gqa=True
        )
    t = time.perf_counter()
    pool.after_layers(batch)  # shm: the pass's closing barrier
    gather += time.perf_counter() - t
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
            "1 buffer": ShardedDeviceKVPool(
                spec, num_pages, cpu, rank, world, group, 1, transport="collective"
            ),
            "2 buffers": ShardedDeviceKVPool(
                spec, num_pages, cpu, rank, world, group, 2, transport="collective"
            ),
            "shm": ShardedDeviceKVPool(
                spec, num_pages, cpu, rank, world, group, 1, transport="shm"
            ),
            "compute": DeviceKVPool(spec, num_pages, cpu),
        }
        pages = list(range(spec.pages_for(seq_len)))  # owner cycle 0, 1, .., N-1, 0, ..
        slots = pools["compute"].slot_ids(pages, seq_len)
        batch = ForwardBatch.build([([0] * args.chunk, prefix, slots)], cpu)
        new_slots = slots[prefix:]
        shape = (args.chunk, args.kv_heads, args.head_dim)
        kv = [torch.randn(shape, generator=gen).to(dtype) for _ in range(2)]
        q_shape = (1, args.q_heads or args.kv_heads, args.chunk, args.head_dim)
        q = torch.randn(q_shape, generator=gen).to(dtype)
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
        replicated = pools["compute"].kv
        replicated_bytes = replicated.numel() * replicated.element_size()
        rows.append((prefix, measured, sharded.device_bytes(), scratch, replicated_bytes))
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


GATHER_HEADER = (
    f"{'N':>2} {'prefix':>7} {'arm':>9} | {'gather ms':>9} | {'share':>6} | "
    f"{'step ms (spread)':>16} | {'compute ms':>10} | {'overhead':>8} | {'vs 1 buf':>8}"
)


def gather_rows(world: int, rows: list, layers: int) -> list[str]:
    """Per prefix and arm, the gather's share of the step and the step's overhead over
    compute alone; vs 1 buf: what the arm takes off the one-buffer all-gather's step."""
    out = []
    for prefix, measured, *_ in rows:
        med = {
            arm: [statistics.median(x[i] for x in runs) * 1e3 / layers for i in (0, 1)]
            for arm, runs in measured.items()
        }
        spread = {
            arm: (max(x[1] for x in runs) - min(x[1] for x in runs)) * 1e3 / layers
            for arm, runs in measured.items()
        }
        compute, one_buffer = med["compute"][1], med["1 buffer"][1]
        for arm in GATHER_ARMS:
            gather, step = med[arm]
            out.append(
                f"{world:>2} {prefix:>7} {arm:>9} | {gather:9.2f} | {gather / step:6.1%} | "
                f"{step:7.2f} ({spread[arm]:6.2f}) | {compute:10.2f} | "
                f"{step / compute - 1:+8.1%} | {1 - step / one_buffer:+8.1%}"
            )
    return out


MEMORY_HEADER = (
    f"{'N':>2} {'prefix':>7} | {'replicated':>10} {'sharded':>8} {'scratch':>8} {'total':>8} "
    f"{'goal':>8} | {'sharded/repl':>12} {'total/repl':>10} {'total/goal':>10}"
)


def memory_rows(world: int, rows: list) -> list[str]:
    """Device bytes per rank, MiB: sharded rows (+ scratch) against a replicated pool."""
    mib = 2**20
    out = []
    for prefix, _, sharded, scratch, replicated in rows:
        total, goal = sharded + scratch, replicated / world + scratch
        out.append(
            f"{world:>2} {prefix:>7} | {replicated / mib:10.2f} {sharded / mib:8.2f} "
            f"{scratch / mib:8.2f} {total / mib:8.2f} {goal / mib:8.2f} | "
            f"{sharded / replicated:12.3f} {total / replicated:10.3f} {total / goal:10.3f}"
        )
    return out


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
    parser.add_argument(
        "--q-heads", type=int, default=0, help="query heads (GQA; default: as many as KV heads)"
    )
    parser.add_argument(
        "--model-shape",
        choices=sorted(MODEL_SHAPES),
        default=None,
        help="a served model's attention shape (layers, heads, head size, dtype on CPU) "
        "instead of the flags",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    args = parser.parse_args()
    if args.model_shape is not None:
        for name, value in MODEL_SHAPES[args.model_shape].items():
            setattr(args, name, value)
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads; torch {torch.__version__}")
    print(
        f"{args.layers} layers, {args.q_heads or args.kv_heads} query heads over "
        f"{args.kv_heads} KV heads x {args.head_dim}, page "
        f"{args.page_size}, {args.dtype}, chunk {args.chunk}, {args.rounds} rounds (median)"
    )
    results = {world: run_world(world, args) for world in args.cp_sizes}
    print("\nThe gather's share of a prefill step, per layer: all-gather (1 or 2 buffers), shm")
    print(GATHER_HEADER)
    for world, rows in results.items():
        print("\n".join(gather_rows(world, rows, args.layers)))
    print("\nDevice bytes per rank, MiB (goal: replicated / N + the two scratch buffers)")
    print(MEMORY_HEADER)
    for world, rows in results.items():
        print("\n".join(memory_rows(world, rows)))


if __name__ == "__main__":
    main()
