"""TTFT of one long prompt on the tiny model: cold vs device, host and L3 hits, side by side.

Each round takes a new random prompt and runs the four cases back to back on the same engine
(interleaved, so machine noise hits all of them alike); the table reports medians and
ratios to cold:
- cold: a prompt never seen, every token computed (and written through to the host tier
  and to the `file` store);
- device hit: the prompt's prefix is in the device pool;
- host hit: the prefix was evicted from the device and is loaded back from the host tier;
- L3 hit: device and host flushed, the prefix is read from the store into host pages
  (`wait_complete`), then loaded like a host hit.

    .venv/bin/python benchmarks/bench_ttft.py --prompt-len 8192
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from tqdm import tqdm

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.scheduler.scheduler import SchedulerConfig


def ttft(engine: Engine, prompt: list[int]) -> tuple[float, tuple[int, int, int]]:
    start = time.perf_counter()
    out = engine.generate(prompt, SamplingParams(max_new_tokens=1))
    cached = out.cached
    return time.perf_counter() - start, (cached.device, cached.host, cached.storage)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--chunked-prefill-size", type=int, default=1024)
    parser.add_argument("--hicache-mem-layout", default="page_first")
    parser.add_argument(
        "--storage-dir", default=None, help="the file store's directory (default: a temp dir)"
    )
    args = parser.parse_args()
    storage_dir = args.storage_dir or tempfile.mkdtemp(prefix="bench-ttft-l3-")

    pages = -(-(args.prompt_len + 1) // args.page_size) + 1
    cache = CacheConfig(
        page_size=args.page_size,
        num_device_pages=pages * 2,
        enable_hierarchical_cache=True,
        hicache_mem_layout=args.hicache_mem_layout,
        hicache_storage_backend="file",
        hicache_storage_dir=storage_dir,
        hicache_storage_prefetch_policy="wait_complete",
        storage_batch_pages=64,
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
    engine.generate([rng.randrange(256) for _ in range(64)], SamplingParams(max_new_tokens=1))
    cases = ("cold", "device hit", "host hit", "L3 hit")
    times: dict[str, list[float]] = {case: [] for case in cases}
    hits: dict[str, tuple[int, int, int]] = {}
    for _ in tqdm(range(args.rounds), desc="rounds"):
        prompt = [rng.randrange(256) for _ in range(args.prompt_len)]
        for case in cases:
            engine.drain()  # backups committed and written to the store before each case
            if case == "host hit":
                engine.evict_device(engine.cache.tree.num_device_pages)
            elif case == "L3 hit":
                engine.flush_cache()
            t, hits[case] = ttft(engine, prompt)
            times[case].append(t)
    cold = statistics.median(times["cold"])
    print(
        f"\nTTFT, prompt {args.prompt_len} tokens, tiny model {args.dtype}, page {args.page_size}, "
        f"host layout {args.hicache_mem_layout}, file store, median of {args.rounds} rounds"
    )
    print(
        f"{'case':<12} {'cached device':>14} {'cached host':>12} {'cached L3':>10} "
        f"{'TTFT ms':>9} {'vs cold':>8}"
    )
    for case, ts in times.items():
        med = statistics.median(ts)
        d, h, s3 = hits[case]
        print(f"{case:<12} {d:>14} {h:>12} {s3:>10} {med * 1e3:>9.2f} {med / cold:>7.3f}x")
    engine.close()


if __name__ == "__main__":
    main()
