"""Speculative decoding's decode throughput: speculation on vs off, batch 1 and 8.

For each model (`tiny`, float64 random weights; `smollm2-135m-instruct`, the real default
model, float32 on the CPU) and batch size, the engine decodes `--batch` distinct prompts of
`--prompt-len` seeded random token ids, greedy, `--new-tokens` tokens each with EOS ignored,
radix cache off, once without speculation and once with `--speculative-algorithm standalone
--speculative-draft-model-path self` (the target's own weights as the draft, `--steps`
proposals a round). Decode tok/s = the batch's output tokens after the first / the time
from the last row's first token to the last row's last token. `accept len` is the tokens
a verify round emitted on average (accepted + 1), `accept rate` accepted / proposed.
Cases run in `--rounds` interleaved rounds after a warm-up; the table reports medians and
the on/off ratio of those. The self draft costs as much as the target per token, so this
measures the step's overhead and the all-accepted ceiling (K+1 tokens per target verify),
not a deployable speed-up: that needs a cheaper draft (issue 23 build 2, re-quantized).

    .venv/bin/python benchmarks/bench_spec.py --rounds 2
    .venv/bin/python benchmarks/bench_spec.py --models tiny --device cuda
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.scheduler.request import Req
from gpu_worker.scheduler.scheduler import SchedulerConfig
from gpu_worker.scheduler.spec_config import SpecConfig

FIRST_ORDINARY_ID = 17  # SmolLM2's special tokens are ids 0..16


def make_engine(model: str, device: str, spec: bool, steps: int, batch: int, plen: int) -> Engine:
    return Engine(
        EngineConfig(
            model=model,
            dtype="auto",
            device=device,
            cache=CacheConfig(page_size=16, num_device_pages=1024, enable_radix_cache=False),
            scheduler=SchedulerConfig(chunked_prefill_size=batch * plen),
            spec=SpecConfig("standalone", "self", steps) if spec else SpecConfig(),
        )
    )


def prompts(vocab: int, batch: int, plen: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    hi = min(vocab, 256) if vocab < 1000 else vocab
    return [[rng.randrange(FIRST_ORDINARY_ID, hi) for _ in range(plen)] for _ in range(batch)]


def decode_rate(eng: Engine, batch: list[list[int]], new_tokens: int) -> tuple[float, list[Req]]:
    """Decode tok/s of one batch, and its requests (for their verify rounds)."""
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    reqs = [eng.submit(p, sp) for p in batch]
    while any(not r.output_ids for r in reqs):
        eng.step()
    start = time.perf_counter()
    while any(r.finish_reason is None for r in reqs):
        eng.step()
    took = time.perf_counter() - start
    return len(reqs) * (new_tokens - 1) / took, reqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,smollm2-135m-instruct")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=33)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for model in args.models.split(","):
        engines = {
            on: make_engine(model, args.device, on, args.steps, 8, args.prompt_len)
            for on in (False, True)
        }
        vocab = engines[False].model_config.vocab_size
        for b in (int(x) for x in args.batches.split(",")):
            rates: dict[bool, list[float]] = {False: [], True: []}
            verified: list[tuple[int, int]] = []  # (proposed, accepted) of measured rounds
            for rnd in range(args.rounds + 1):  # round 0 warms up
                for on in (False, True) if rnd % 2 else (True, False):
                    batch = prompts(vocab, b, args.prompt_len, rnd)
                    rate, reqs = decode_rate(engines[on], batch, args.new_tokens)
                    if rnd:
                        rates[on].append(rate)
                        verified += [x for r in reqs for x in r.spec_rounds]
            off, on = statistics.median(rates[False]), statistics.median(rates[True])
            accepted = sum(a for _, a in verified)
            alen = (accepted + len(verified)) / len(verified)
            rows.append((model, b, off, on, alen, accepted / sum(p for p, _ in verified)))
        for eng in engines.values():
            eng.close()
    print(
        f"\ndecode tok/s, speculation off vs on (draft self, K={args.steps}), "
        f"{args.device}, {args.threads} thread(s), prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, medians of {args.rounds} rounds"
    )
    print(
        f"{'model':<24}{'batch':>6}{'off':>10}{'on':>10}{'on/off':>8}{'accept len':>12}{'rate':>7}"
    )
    for model, b, off, on, alen, rate in rows:
        print(f"{model:<24}{b:>6}{off:>10.1f}{on:>10.1f}{on / off:>8.2f}{alen:>12.2f}{rate:>7.0%}")


if __name__ == "__main__":
    main()
