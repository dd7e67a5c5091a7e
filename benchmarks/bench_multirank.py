"""Multi-rank engines on the tiny model: throughput per layout, and what agreement and the
rank consensus checker cost per step (issue 8, acceptance 4).

Every case is a fresh world of real rank processes (`launch_engine`, as the engine service
starts one) driven from a spawned rank-0 process through one steady-decode workload:
`--requests` prompts of `--prompt-len` tokens prefilled together, then decoding
`--max-new-tokens` tokens each (the host tier on, write_through, so ACKs flow). Cases run in
`--rounds` interleaved rounds (machine noise hits every case alike) and the table reports
medians:
- `tok/s`: generated tokens per second of the whole workload;
- `step ms`: rank 0's mean wall time per decode step (a step that runs only decoding rows);
- `sync %`: the share of rank 0's decode step time spent in the per-step exchange: rank 0's
  command list to its TP peers and down the pipeline (`pp_sync`, which carries the agreed
  count in the same header) and the ready-ACK all_reduce(MIN);
- `agree %`: the part of it that is agreement's own: the MIN reductions (they run only in
  steps with ACKs queued; `red/step` counts them) plus rank 0's waits for an agreed ACK
  whose copy was still running;
- `vs agreed`: the decode step time against the same layout's agreed run (on a 2-core
  machine shared by 4 rank processes this ratio moves by tens of percent between runs:
  the columns above are the direct measurement).
Variants on TP2 x PP2: "no agreement" (`--debug-disable-agreement all`: each rank consumes
its own ready count; the collective still carries the commands) and "checker on"
(`HICACHE_RANK_CONSENSUS=1`).

    .venv/bin/python benchmarks/bench_multirank.py --rounds 3
    .venv/bin/python benchmarks/bench_multirank.py --rounds 6 --only-tp2-pp2
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection

from tqdm import tqdm

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import DebugHooks, Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.parallel.config import ParallelConfig


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    tp: int
    pp: int
    disable: str = "none"
    checker: bool = False
    baseline: str = ""  # the case this one is compared with ("" for none)


CASES = (
    Case("TP1", 1, 1),
    Case("TP2", 2, 1),
    Case("PP2", 1, 2),
    Case("TP2xPP2", 2, 2),
    Case("TP2xPP2 no agreement", 2, 2, disable="all", baseline="TP2xPP2"),
    Case("TP2xPP2 checker on", 2, 2, checker=True, baseline="TP2xPP2"),
)


@dataclass(slots=True)
class Result:
    tokens_per_s: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    sync_share: list[float] = field(default_factory=list)
    agree_share: list[float] = field(default_factory=list)
    reductions_per_step: list[float] = field(default_factory=list)


Measured = tuple[float, float, float, float, float]


def workload(engine: Engine, args: argparse.Namespace) -> Measured:
    """(generated tokens/s, mean decode step ms, exchange and agreement shares of decode step
    time, agreement reductions per decode step)."""
    prompts = [[(7 * i + j) % 250 for j in range(args.prompt_len)] for i in range(args.requests)]
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    engine.generate_batch(prompts[:2], SamplingParams(max_new_tokens=2))  # warm up
    reqs = [engine.submit(p, sp) for p in prompts]
    sync, transfers = engine.sync, engine.cache.transfers
    assert transfers is not None
    start = time.perf_counter()
    decode_s = sync_s = agree_s = 0.0
    decode_steps = reductions = 0
    while any(r.finish_reason is None for r in reqs):
        decoding = all(len(r.output_ids) > 0 for r in reqs)
        before = (sync.seconds, sync.reduce_seconds, transfers.wait_seconds, sync.num_reductions)
        t0 = time.perf_counter()
        engine.step()
        if decoding:  # every row decodes: the steady state
            decode_s += time.perf_counter() - t0
            sync_s += sync.seconds - before[0]
            agree_s += sync.reduce_seconds - before[1] + transfers.wait_seconds - before[2]
            reductions += sync.num_reductions - before[3]
            decode_steps += 1
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.output_ids) for r in reqs)
    steps = max(1, decode_steps)
    busy = max(decode_s, 1e-9)
    return (
        tokens / elapsed,
        1e3 * decode_s / steps,
        sync_s / busy,
        agree_s / busy,
        reductions / steps,
    )


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


def run_case(case: Case, args: argparse.Namespace) -> Measured:
    cache = CacheConfig(
        page_size=16, num_device_pages=1024, enable_hierarchical_cache=True, hicache_ratio=2.0
    )
    config = EngineConfig(
        model="tiny-tp",
        dtype="float32",
        cache=cache,
        parallel=ParallelConfig(case.tp, case.pp),
        debug=replace(DebugHooks(), disable_agreement=case.disable),
    )
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    saved = os.environ.get("HICACHE_RANK_CONSENSUS")
    os.environ["HICACHE_RANK_CONSENSUS"] = "1" if case.checker else ""
    try:
        proc = ctx.Process(target=_rank0, args=(child, config, args))
        proc.start()
    finally:
        os.environ.pop("HICACHE_RANK_CONSENSUS")
        if saved is not None:
            os.environ["HICACHE_RANK_CONSENSUS"] = saved
    child.close()
    result: Measured = parent.recv()
    proc.join(60)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument(
        "--only-tp2-pp2", action="store_true", help="only the TP2xPP2 cases (agreement, checker)"
    )
    args = parser.parse_args()
    cases = [c for c in CASES if c.name.startswith("TP2xPP2")] if args.only_tp2_pp2 else CASES
    results = {case.name: Result() for case in cases}
    with tqdm(total=args.rounds * len(cases), desc="worlds") as bar:
        for _ in range(args.rounds):
            for case in cases:
                tps, step_ms, share, agree, per_step = run_case(case, args)
                r = results[case.name]
                r.tokens_per_s.append(tps)
                r.step_ms.append(step_ms)
                r.sync_share.append(share)
                r.agree_share.append(agree)
                r.reductions_per_step.append(per_step)
                bar.update()
    print(
        f"\ntiny-tp float32, {args.requests} requests x ({args.prompt_len} prompt + "
        f"{args.max_new_tokens} new tokens), median of {args.rounds} interleaved rounds; "
        f"{os.cpu_count()} CPU cores"
    )
    head = f"{'case':<22} {'tok/s':>8} {'step ms':>8} {'sync %':>7} {'agree %':>8}"
    print(f"{head} {'red/step':>9} {'vs agreed':>10}")
    med = {name: statistics.median(r.step_ms) for name, r in results.items()}
    for case in cases:
        r = results[case.name]
        vs = f"{med[case.name] / med[case.baseline]:.3f}x" if case.baseline else ""
        print(
            f"{case.name:<22} {statistics.median(r.tokens_per_s):>8.1f} {med[case.name]:>8.2f} "
            f"{100 * statistics.median(r.sync_share):>6.2f}% "
            f"{100 * statistics.median(r.agree_share):>7.3f}% "
            f"{statistics.median(r.reductions_per_step):>9.3f} {vs:>10}"
        )


if __name__ == "__main__":
    main()
