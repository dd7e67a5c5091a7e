"""TTFT of one long prompt on the tiny model: cold vs device hit vs host hit, side by side.

Each round runs the three cases back to back on the same engine (interleaved, so machine
noise hits all three alike) and the table reports medians and ratios to cold:
- cold: the cache flushed, every token computed;
- device hit: the prompt's prefix is in the device pool;
- host hit: the prefix was evicted from the device and is loaded back from the host tier.

    .venv/bin/python benchmarks/bench_ttft.py --prompt-len 4096
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from tqdm import tqdm

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.scheduler.scheduler import SchedulerConfig


def ttft(engine: Engine, prompt: list[int]) -> tuple[float, int, int]:
    start = time.perf_counter()
    out = engine.generate(prompt, SamplingParams(max_new_tokens=1))
    return time.perf_counter() - start, out.cached.device, out.cached.host


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--chunked-prefill-size", type=int, default=1024)
    parser.add_argument("--hicache-mem-layout", default="page_first")
    args = parser.parse_args()

    pages = -(-(args.prompt_len + 1) // args.page_size) + 1
    cache = CacheConfig(
        page_size=args.page_size,
        num_device_pages=pages * 2,
        enable_hierarchical_cache=True,
        hicache_mem_layout=args.hicache_mem_layout,
    )
    engine = Engine(
        EngineConfig(
            dtype=args.dtype,
            context_len=args.prompt_len + 8,
            cache=cache,
            scheduler=SchedulerConfig(chunked_prefill_size=args.chunked_prefill_size),
        )
    )
    rng = random.Random(0)
    prompt = [rng.randrange(256) for _ in range(args.prompt_len)]
    engine.generate(prompt[:64], SamplingParams(max_new_tokens=1))  # warm-up
    times: dict[str, list[float]] = {"cold": [], "device hit": [], "host hit": []}
    hits: dict[str, tuple[int, int]] = {}
    for _ in tqdm(range(args.rounds), desc="rounds"):
        engine.cache.drain()
        engine.flush_cache()
        t, d, h = ttft(engine, prompt)
        times["cold"].append(t)
        hits["cold"] = (d, h)
        engine.cache.drain()
        t, d, h = ttft(engine, prompt)
        times["device hit"].append(t)
        hits["device hit"] = (d, h)
        engine.cache.drain()
        engine.cache.evict_device(engine.cache.tree.num_device_pages)
        t, d, h = ttft(engine, prompt)
        times["host hit"].append(t)
        hits["host hit"] = (d, h)
    cold = statistics.median(times["cold"])
    print(
        f"\nTTFT, prompt {args.prompt_len} tokens, tiny model {args.dtype}, page {args.page_size}, "
        f"host layout {args.hicache_mem_layout}, median of {args.rounds} rounds"
    )
    print(f"{'case':<12} {'cached device':>14} {'cached host':>12} {'TTFT ms':>9} {'vs cold':>8}")
    for case, ts in times.items():
        med = statistics.median(ts)
        d, h = hits[case]
        print(f"{case:<12} {d:>14} {h:>12} {med * 1e3:>9.2f} {med / cold:>7.3f}x")
    engine.close()


if __name__ == "__main__":
    main()
