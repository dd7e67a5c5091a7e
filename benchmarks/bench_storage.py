"""A multi-turn agentic run whose working set is 4x the device + host cache: with and without L3.

Each of `--conversations` conversations resends its whole history every turn: turn t's
prompt is turn t-1's prompt and output plus `--user-tokens` new ones (the first turn: a
`--system-tokens` history of its own). Requests go turn by turn, conversation by
conversation, one at a time, to two engines side by side in one process (request i to
engine A, then to engine B, so machine noise hits both alike):
- "host only": device + host tiers (write_through);
- "host + L3": the same, plus a `file` store in a fresh temporary directory (write_through
  to the store, the default `timeout` prefetch policy).

The device pool plus the host pool hold a quarter of the tokens the conversations end with,
so most of a history has left both by the time its next turn comes. Reported per arm:
cached tokens (device / host / storage) as a fraction of the offline upper bound (every
page-aligned prefix of the prompt, but its last token, held by any earlier request's KV: an
infinite cache), and TTFT (submit to first token) median and p90.

    .venv/bin/python benchmarks/bench_storage.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from bus_schemas.page_hash import chain_hashes, root_hash
from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.driver import StepLoop
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.scheduler.scheduler import SchedulerConfig


@dataclass(slots=True)
class Arm:
    name: str
    engine: Engine
    ttfts: list[float] = field(default_factory=list)
    device: int = 0
    host: int = 0
    storage: int = 0

    @property
    def cached(self) -> int:
        return self.device + self.host + self.storage


def serve(arm: Arm, prompt: list[int], sp: SamplingParams) -> list[int]:
    """One request alone: its TTFT, cached tokens and output."""
    engine = arm.engine
    start = time.perf_counter()
    req, loop = engine.submit(prompt, sp), StepLoop(engine)
    while not req.output_ids and req.finish_reason is None:
        loop.step_or_wait()
    arm.ttfts.append(time.perf_counter() - start)
    out = engine.run([req])[0]
    arm.device += out.cached.device
    arm.host += out.cached.host
    arm.storage += out.cached.storage
    return out.output_ids


class UpperBound:
    """The offline upper bound: pages any earlier request left KV for (an infinite cache)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.seen: set[bytes] = set()
        self.root = root_hash("bound", "")

    def hit(self, prompt: list[int]) -> int:
        n = 0
        for h in chain_hashes(self.root, prompt[:-1], self.page_size):
            if h not in self.seen:
                break
            n += 1
        return n * self.page_size

    def add(self, tokens: list[int]) -> None:
        self.seen.update(chain_hashes(self.root, tokens, self.page_size))


def engine(args: argparse.Namespace, pages: int, storage_dir: str | None) -> Engine:
    """`pages` of device + host cache, a third on the device (at least what the longest
    request needs)."""
    device = max(pages // (1 + args.host_ratio), -(-args.context_len // args.page_size) + 2)
    cache = CacheConfig(
        page_size=args.page_size,
        num_device_pages=device,
        enable_hierarchical_cache=True,
        hicache_ratio=max(pages - device, 1) / device,
        hicache_mem_layout="page_first",
        hicache_storage_backend="file" if storage_dir else None,
        hicache_storage_dir=storage_dir or "",
    )
    return Engine(
        EngineConfig(
            dtype="float32",
            context_len=args.context_len,
            cache=cache,
            scheduler=SchedulerConfig(chunked_prefill_size=1024),
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--user-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--host-ratio", type=int, default=2, help="host pages per device page")
    parser.add_argument("--capacity-fraction", type=float, default=0.25)
    args = parser.parse_args()

    c, t, u, o = args.conversations, args.turns, args.user_tokens, args.output_tokens
    final_len = args.system_tokens + t * (u + o)
    args.context_len = final_len + 64
    working_set = c * final_len
    pages = int(working_set * args.capacity_fraction) // args.page_size
    arms = [
        Arm("host only", engine(args, pages, None)),
        Arm("host + L3", engine(args, pages, tempfile.mkdtemp(prefix="bench-l3-"))),
    ]
    rng = random.Random(0)
    histories = [[rng.randrange(256) for _ in range(args.system_tokens)] for _ in range(c)]
    bound = UpperBound(args.page_size)
    bound_total = 0
    sp = SamplingParams(max_new_tokens=o, ignore_eos=True)
    for _ in tqdm(range(t), desc="turns"):
        for i in range(c):
            prompt = histories[i] + [rng.randrange(256) for _ in range(u)]
            bound_total += bound.hit(prompt)
            outputs = [serve(arm, prompt, sp) for arm in arms]
            assert outputs[0] == outputs[1], "a cache hit changed an output"
            bound.add(prompt + outputs[0][:-1])
            histories[i] = prompt + outputs[0]
    device_tokens = arms[0].engine.cache.device_pool.num_pages * args.page_size
    host_pool = arms[0].engine.cache.host_pool
    host_tokens = host_pool.num_pages * args.page_size if host_pool else 0
    print(
        f"\n{c} conversations x {t} turns (history {args.system_tokens} + {u} per turn, "
        f"{o} out), tiny float32, page {args.page_size}; working set {working_set} tokens, "
        f"device {device_tokens} + host {host_tokens} tokens "
        f"({(device_tokens + host_tokens) / working_set:.2f}x of it); {c * t} requests"
    )
    print(f"offline upper bound of cached tokens: {bound_total}")
    head = (
        f"{'arm':<10} {'cached':>8} {'device':>8} {'host':>8} {'storage':>8} {'of bound':>9} "
        f"{'TTFT p50 ms':>12} {'p90 ms':>8}"
    )
    print(head)
    for arm in arms:
        ttfts = sorted(arm.ttfts)
        print(
            f"{arm.name:<10} {arm.cached:>8} {arm.device:>8} {arm.host:>8} {arm.storage:>8} "
            f"{arm.cached / bound_total:>9.3f} {statistics.median(ttfts) * 1e3:>12.1f} "
            f"{ttfts[int(0.9 * len(ttfts))] * 1e3:>8.1f}"
        )
        arm.engine.close()
    ratio = statistics.median(arms[1].ttfts) / statistics.median(arms[0].ttfts)
    print(f"TTFT p50 with L3 / without: {ratio:.3f}")


if __name__ == "__main__":
    main()
