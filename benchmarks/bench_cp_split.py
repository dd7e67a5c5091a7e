"""Benchmark the CP prefill split: one cold prefill step of a whole model on CP2 / CP4, every
rank computing every token (`none`) against each rank computing its share (`zigzag`,
`interleave`; `--cp-split`, `gpu_worker/model/cp_split.py`), at 2K and 8K tokens.

    python benchmarks/bench_cp_split.py                       # N = 2 and 4, CPU gloo
    python benchmarks/bench_cp_split.py --cp-sizes 2 --tokens 2048 --rounds 1

For each CP size one gloo world of N rank processes (one torch thread each) runs every case;
within it, `--rounds` interleaved rounds (none, zigzag, interleave; A B C A B C) so machine
noise hits every arm alike. A step is `LlamaModel.forward` of one request of `--tokens` new
tokens and no prefix, into a replicated device pool (`--sharded`: a sharded one; a cold
prefill has no prefix pages to gather, so the two differ only in the rows each writes),
seeded random weights of `--model` in `--dtype`, the split set on the model as the engine's
executor sets it. Rank 0 times it after a barrier: its forward returns once the last rows'
hidden states are gathered, so the step waits for the slowest rank. Figures are medians
over rounds; `x none` is the arm's median over none's (below 1: faster).

What the split saves is the per-token work each rank no longer does (projections, MLP and
above all causal attention, quadratic in the tokens); what it adds is one all-gather of
the new K/V per layer and one of the last hidden rows. With N ranks on fewer free cores
than N (the shared 2-core machine) the ranks' compute does not run in parallel, and the
figures show the gathers' cost rather than the split's gain.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

# Run as a script from a checkout where the project is not pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_cp_gather import cpu_name
from gpu_worker.memory.device_pool import DeviceKVPool
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.memory.sharded_pool import ShardedDeviceKVPool
from gpu_worker.model.config import parse_dtype
from gpu_worker.model.cp_split import CPSplitConfig
from gpu_worker.model.forward_batch import ForwardBatch
from gpu_worker.model.llama import LlamaModel
from gpu_worker.model.weights import build_model

ARMS = ("none", "zigzag", "interleave")


def one_step(
    model: LlamaModel,
    pool: DeviceKVPool | ShardedDeviceKVPool,
    ids: list[int],
    slots: torch.Tensor,
    group: dist.ProcessGroup,
) -> tuple[float, torch.Tensor]:
    """One cold prefill of `ids` into `slots`, timed from a barrier: (seconds, logits)."""
    batch = ForwardBatch.build([(ids, 0, slots)], torch.device("cpu"))
    dist.barrier(group)
    start = time.perf_counter()
    with torch.inference_mode():
        logits = model(batch, pool)
    return time.perf_counter() - start, logits


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=args.timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    group = dist.new_group(list(range(world)), timeout=timeout)
    dtype = parse_dtype(args.dtype)
    cpu = torch.device("cpu")
    context = max(args.tokens)
    config, model = build_model(args.model, cpu, dtype, context_len=context)
    spec = KVSpec(config.num_layers, config.num_kv_heads, config.head_dim, args.page_size, dtype)
    rows = []
    for tokens in args.tokens:
        num_pages = spec.pages_for(tokens) + world
        pool: DeviceKVPool | ShardedDeviceKVPool = (
            ShardedDeviceKVPool(spec, num_pages, cpu, rank, world, group)
            if args.sharded
            else DeviceKVPool(spec, num_pages, cpu)
        )
        slots = pool.slot_ids(list(range(spec.pages_for(tokens))), tokens)
        ids = [(7 * i + 3) % config.vocab_size for i in range(tokens)]
        logits: dict[str, torch.Tensor] = {}
        measured: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for round_ in range(args.rounds + 1):  # round 0: warm-up
            for arm in ARMS:
                split = None if arm == "none" else CPSplitConfig(arm, rank, world, group)
                model.set_cp_split(split)
                seconds, logits[arm] = one_step(model, pool, ids, slots, group)
                if round_:
                    measured[arm].append(seconds)
        gap = max(float((logits[a] - logits["none"]).abs().max()) for a in ARMS)
        rows.append((tokens, {a: statistics.median(t) for a, t in measured.items()}, gap))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--model", default="tiny", help="a random-weight preset")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--sharded", action="store_true", help="a sharded pool per rank")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}; torch {torch.__version__}; one thread per rank")
    pool = "sharded" if args.sharded else "replicated"
    print(f"{args.model}, {args.dtype}, {pool} pool, {args.rounds} rounds (median)")
    header = (
        f"{'N':>2} {'tokens':>7} {'none ms':>9} {'zigzag ms':>10} {'x none':>7} "
        f"{'interleave ms':>14} {'x none':>7} {'max |dlogit|':>13}"
    )
    for world in args.cp_sizes:
        print(f"\n{header}")
        for tokens, t, gap in run_world(world, args):
            none, zig, inter = (t[a] * 1e3 for a in ARMS)
            print(
                f"{world:>2} {tokens:>7} {none:9.1f} {zig:10.1f} {zig / none:7.2f} "
                f"{inter:14.1f} {inter / none:7.2f} {gap:13.2e}"
            )


if __name__ == "__main__":
    main()
