"""The article's CP comparison: CP4 replicated vs CP4 sharded at the same per-rank device
memory, host tier on, over a multi-turn agentic trace (issue 22, acceptance 6).

The article ("CP x HiCache", Figure 1d) ran two TP4/CP4 prefill engines with the KV either
replicated on every CP rank or sharded by page, at the same static memory. Sharding holds N
times the logical pages in the same per-rank memory, so more of a returning conversation's
history is still on the device: the device token hit rate rose by 40.48 points, the device +
host hit rate stayed near 93%, host-served tokens fell 81.2%, and mean prefill queue time
and forward time fell 56.2% and 31.3%.

    python benchmarks/bench_cp_article.py                 # CP4, tiny float32, ~10 minutes
    python benchmarks/bench_cp_article.py --conversations 8 --turns 3   # a quick look

The trace: `--conversations` agentic sessions, each a shared system prompt of `--system`
tokens then a random history of `--history` tokens that grows by `--user` tokens and the `--out` tokens answered per turn, every turn resent
whole. Turns go round-robin over the sessions, `--batch` sessions submitted together, so a
session's history has waited behind all the others' when it returns. The working set (the
histories at the last turn) is several times the replicated engine's device pool and fits in
the host pool of either arm.

Same per-rank device memory: the replicated engine's pool is `--device-pages` pages on every
rank. The sharded engine's rank holds `--device-pages` pages too: its owned rows (1/N of the
logical pool, plus one trash page) and, with the all-gather (`--cp-gather-transport
collective`), its two gather scratch buffers, sized for the largest batch of the trace (one
layer of the batch's pages each), so its logical pool is N x (device pages - 1 - scratch);
with `shm` (the default, what CPU ranks of one host use) there is no scratch buffer and
it is N x (device pages - 1). Both arms have the same logical host pool
(`--host-pages`; a sharded rank holds its 1/N of it).

Per request, on rank 0 (the figures the article plots):
- device / host hit: the prompt tokens served from the device / host tier (`CachedTokens`);
- queue ms: from submission to the step that starts its prefill (waiting and loading back);
- forward ms: from there to its first output token (its prefill chunks, in batches).
Both engines run the same trace, and their outputs are compared token by token.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

# Run as a script from a checkout where the project is not pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.config import PRESETS
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.scheduler.request import ReqState

MODEL = "tiny"


@dataclass(frozen=True, slots=True)
class Sample:
    """One request of the trace, as rank 0 saw it."""

    prompt_len: int
    device: int  # prompt tokens served from the device tier
    host: int  # ... from the host tier
    queue_s: float
    forward_s: float
    output_ids: tuple[int, ...]


def trace_turns(args: argparse.Namespace) -> list[list[list[int]]]:
    """Per turn, per session, the tokens the user adds (the first turn: the shared system
    prompt, then the session's own history)."""
    rng = random.Random(args.seed)
    system = [rng.randrange(256) for _ in range(args.system)]
    turns = []
    for t in range(args.turns):
        size = args.history if t == 0 else args.user
        first = system if t == 0 else []
        turns.append(
            [first + [rng.randrange(256) for _ in range(size)] for _ in range(args.conversations)]
        )
    return turns


def workload(engine: Engine, args: argparse.Namespace) -> tuple[list[Sample], dict[str, int]]:
    """Run the trace on rank 0; the samples, and the device pool's bytes on this rank."""
    sp = SamplingParams(max_new_tokens=args.out, ignore_eos=True)
    engine.generate_batch([[1, 2, 3, 4, 5]], SamplingParams(max_new_tokens=2))  # warm up
    engine.flush_cache()
    histories: list[list[int]] = [[] for _ in range(args.conversations)]
    samples: list[Sample] = []
    for added in trace_turns(args):
        for first in range(0, args.conversations, args.batch):
            sessions = range(first, min(first + args.batch, args.conversations))
            for s in sessions:
                histories[s] += added[s]
            t0 = time.perf_counter()
            reqs = [engine.submit(histories[s], sp) for s in sessions]
            started: dict[int, float] = {}
            first_token: dict[int, float] = {}
            while any(r.finish_reason is None for r in reqs):
                engine.step()
                now = time.perf_counter()
                for r in reqs:
                    if r.rid not in started and r.state not in (ReqState.WAITING, ReqState.LOADING):
                        started[r.rid] = now  # its prefill ran in this step (at the latest)
                    if r.rid not in first_token and r.output_ids:
                        first_token[r.rid] = now
            for s, r in zip(sessions, reqs, strict=True):
                if r.error is not None:
                    raise RuntimeError(f"request of session {s} failed: {r.error}")
                samples.append(
                    Sample(
                        len(r.prompt_ids),
                        r.cached.device,
                        r.cached.host,
                        started[r.rid] - t0,
                        first_token[r.rid] - started[r.rid],
                        tuple(r.output_ids),
                    )
                )
                histories[s] += r.output_ids
    pool = engine.cache.pools.device
    memory = {"rows": pool.kv.numel() * pool.kv.element_size()}
    scratch = getattr(pool, "scratch_bytes", None)
    memory["scratch"] = scratch() if scratch is not None else 0
    memory["logical_pages"] = pool.num_pages
    return samples, memory


def _rank0(conn: Connection, config: EngineConfig, args: argparse.Namespace) -> None:
    import torch

    from gpu_worker.engine.rank import launch_engine

    torch.set_num_threads(1)
    engine, ranks = launch_engine(config)
    try:
        conn.send(workload(engine, args))
    finally:
        engine.close()
        if ranks is not None:
            ranks.wait()


def run_arm(config: EngineConfig, args: argparse.Namespace) -> tuple[list[Sample], dict[str, int]]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_rank0, args=(child, config, args))
    proc.start()
    child.close()
    try:
        result: tuple[list[Sample], dict[str, int]] = parent.recv()
    except EOFError:
        raise SystemExit(f"the engine world died (rank 0 exit status {proc.exitcode})") from None
    proc.join(60)
    return result


def scratch_pages(args: argparse.Namespace, num_layers: int) -> int:
    """Pool pages (all layers) that the sharded rank's two scratch buffers take at the
    trace's largest batch: each buffer holds one layer of the batch's prefix pages (N chunks
    of the most pages one rank owns, at most ceil(pages / N) + 1 each), its new pages and a
    trash page."""
    p, n = args.page_size, args.cp_size
    longest = args.system + args.history + (args.turns - 1) * (args.user + args.out)
    per_req = -(-longest // p)
    batch_pages = args.batch * per_req
    per_buffer = n * (-(-batch_pages // n) + 1) + args.batch * (-(-args.user // p) + 1) + 1
    return -(-2 * per_buffer // num_layers)


def configs(args: argparse.Namespace) -> dict[str, EngineConfig]:
    num_layers = PRESETS[MODEL].num_layers
    # the all-gather's scratch buffers; shm reads the owners' rows and has none
    scratch = scratch_pages(args, num_layers) if args.cp_gather_transport == "collective" else 0
    owned = args.device_pages - 1 - scratch
    if owned <= 0:
        raise SystemExit(
            f"--device-pages {args.device_pages} leaves no rows after {scratch} scratch"
        )
    arms = {"replicated": (args.device_pages, False), "sharded": (args.cp_size * owned, True)}
    out = {}
    for name, (pages, sharded) in arms.items():
        if name not in args.arms.split(","):
            continue
        cache = CacheConfig(
            page_size=args.page_size,
            num_device_pages=pages,
            enable_hierarchical_cache=True,
            hicache_ratio=args.host_pages / pages,
            hicache_write_policy="write_through",
        )
        out[name] = EngineConfig(
            model=MODEL,
            dtype="float32",
            cache=cache,
            parallel=ParallelConfig(
                cp_size=args.cp_size,
                kv_sharding=sharded,
                cp_gather_transport=args.cp_gather_transport if sharded else "auto",
            ),
            batch_invariant=True,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp-size", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--system", type=int, default=256, help="a prompt every session shares")
    parser.add_argument("--history", type=int, default=768)
    parser.add_argument("--user", type=int, default=128)
    parser.add_argument("--out", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2, help="sessions submitted together")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device-pages", type=int, default=384, help="per rank, both arms")
    parser.add_argument("--host-pages", type=int, default=2048, help="logical, both arms")
    parser.add_argument("--seed", type=int, default=22)
    parser.add_argument("--arms", default="replicated,sharded", help="comma-separated")
    parser.add_argument(
        "--cp-gather-transport",
        choices=("shm", "collective"),
        default="shm",
        help="the sharded arm's gather: shm (what CPU ranks of one host use; no scratch "
        "buffer) or collective (the all-gather, its two scratch buffers out of the same memory)",
    )
    args = parser.parse_args()
    arms = configs(args)
    results = {}
    for name, config in arms.items():
        t0 = time.perf_counter()
        results[name] = run_arm(config, args)
        print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    longest = args.system + args.history + (args.turns - 1) * (args.user + args.out) + args.out
    print(
        f"CP{args.cp_size} {MODEL} float32, page {args.page_size}; {args.conversations} sessions x "
        f"{args.turns} turns (system {args.system} shared, history {args.history} + {args.user} user + {args.out} out per "
        f"turn), {args.batch} sessions per batch; sharded gather {args.cp_gather_transport}; "
        "working set "
        f"{args.system + args.conversations * (longest - args.system)} tokens; {platform.processor() or 'CPU'}, "
        f"{os.cpu_count()} cores"
    )
    print(
        f"{'arm':<11} {'logical pages':>13} {'rows MiB/rank':>13} {'scratch MiB':>11} "
        f"{'device %':>9} {'dev+host %':>10} {'host tok':>9} {'queue ms':>9} {'fwd ms':>8}"
    )
    figures = {}
    for name, (samples, memory) in results.items():
        prompt = sum(s.prompt_len for s in samples)
        device = sum(s.device for s in samples)
        host = sum(s.host for s in samples)
        queue = 1e3 * statistics.mean(s.queue_s for s in samples)
        forward = 1e3 * statistics.mean(s.forward_s for s in samples)
        figures[name] = (
            100 * device / prompt,
            100 * (device + host) / prompt,
            host,
            queue,
            forward,
        )
        print(
            f"{name:<11} {memory['logical_pages']:>13} {memory['rows'] / 2**20:>13.2f} "
            f"{memory['scratch'] / 2**20:>11.2f} {figures[name][0]:>8.2f}% "
            f"{figures[name][1]:>9.2f}% {host:>9} {queue:>9.1f} {forward:>8.1f}"
        )
    if len(figures) < 2:
        return
    rep, sh = figures["replicated"], figures["sharded"]
    print(
        f"sharded vs replicated: device hit {sh[0] - rep[0]:+.2f} points (goal >= +40), "
        f"combined {sh[1] - rep[1]:+.2f} points (goal within 1), host-served tokens "
        f"{100 * (sh[2] / rep[2] - 1) if rep[2] else 0.0:+.1f}% (goal <= -80%), queue "
        f"{100 * (sh[3] / rep[3] - 1):+.1f}%, forward {100 * (sh[4] / rep[4] - 1):+.1f}%"
    )
    same = [
        a.output_ids == b.output_ids for a, b in zip(*(r[0] for r in results.values()), strict=True)
    ]
    print(f"outputs equal in {sum(same)} of {len(same)} requests")


if __name__ == "__main__":
    main()
