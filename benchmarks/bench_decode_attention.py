"""Decode attention in place vs gathered, side by side (issue 11, acceptance 6).

SmolLM2-135M-Instruct in float32 on the CPU, our engine only: `--batch` rows (and one row)
of `--prompt-len` random token ids are prefilled, then decode steps run in interleaved
rounds of `--steps` steps, alternating the two ways `attention_plan.DecodeGroup` can attend:
- `in place`: each row's runs of consecutive slots are read from the KV pool as views
  (`DeviceKVPool.kv_slice`), one attention call per row and run;
- `gathered`: every row's keys and values are gathered into one padded block first
  (`index_select`), one attention call per layer (what `MAX_DECODE_RUNS = 0` forces, and
  what a row of more than `MAX_DECODE_RUNS` runs still gets, and several rows on more than
  one torch thread: this script lifts that limit to measure both ways at any `--threads`).
The same requests continue across rounds, so the context grows by `--steps` tokens per
round for both ways alike. Reports the median ms per decode step of each way at each batch
size, their ratio, and decode tokens/s at the batch over batch 1 for each way.

    .venv/bin/python benchmarks/bench_decode_attention.py --rounds 6
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from tqdm import tqdm

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model import attention_plan
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.scheduler.scheduler import SchedulerConfig

MODEL = "smollm2-135m-instruct"
FIRST_ORDINARY_ID = 17  # SmolLM2's special tokens are ids 0..16
WAYS = {"in place": attention_plan.MAX_DECODE_RUNS, "gathered": 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per round and way")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    attention_plan.IN_PLACE_MAX_THREADS = args.threads  # both ways at every thread count
    page_size = 16
    new_tokens = 4 + 2 * args.rounds * args.steps
    per_row = -(-(args.prompt_len + new_tokens) // page_size)
    engine = Engine(
        EngineConfig(
            model=MODEL,
            dtype="float32",
            cache=CacheConfig(
                page_size=page_size,
                num_device_pages=(args.batch + 1) * per_row + 1,
                enable_radix_cache=False,
            ),
            scheduler=SchedulerConfig(chunked_prefill_size=args.batch * args.prompt_len),
        )
    )
    vocab = engine.model_config.vocab_size
    ms: dict[tuple[int, str], list[float]] = {}
    batches = (1, args.batch)
    with tqdm(total=len(batches) * args.rounds * len(WAYS), desc="rounds") as bar:
        for b in batches:
            rng = random.Random(b)
            prompts = [
                [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(args.prompt_len)]
                for _ in range(b)
            ]
            sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
            reqs = [engine.submit(p, sp) for p in prompts]
            for _ in range(4):  # the prefill, then a few decode steps to warm up
                engine.step()
            for rnd in range(args.rounds):
                ways = list(WAYS.items()) if rnd % 2 == 0 else list(reversed(WAYS.items()))
                for way, max_runs in ways:
                    attention_plan.MAX_DECODE_RUNS = max_runs
                    start = time.perf_counter()
                    for _ in range(args.steps):
                        engine.step()
                    step_ms = (time.perf_counter() - start) / args.steps * 1e3
                    ms.setdefault((b, way), []).append(step_ms)
                    bar.update()
            attention_plan.MAX_DECODE_RUNS = WAYS["in place"]
            while any(r.finish_reason is None for r in reqs):
                engine.step()
    engine.close()
    report(ms, args)


def report(ms: dict[tuple[int, str], list[float]], args: argparse.Namespace) -> None:
    med = {key: statistics.median(v) for key, v in ms.items()}
    print(
        f"\n{MODEL} float32, prompt {args.prompt_len} tokens, decode steps {args.steps} per"
        f" round and way, median of {args.rounds} interleaved rounds, torch threads"
        f" {args.threads}"
    )
    print(f"{'batch':>5}  {'in place ms':>11}  {'gathered ms':>11}  {'in place/gathered':>17}")
    for b in (1, args.batch):
        inp, gat = med[(b, "in place")], med[(b, "gathered")]
        print(f"{b:>5}  {inp:>11.1f}  {gat:>11.1f}  {inp / gat:>16.2f}x")
    for way in WAYS:
        ratio = args.batch * med[(1, way)] / med[(args.batch, way)]
        print(f"decode tok/s batch {args.batch} / batch 1, {way}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
