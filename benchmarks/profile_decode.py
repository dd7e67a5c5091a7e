"""Decode steps of one request, timed and profiled: where a decode step's time goes.

SmolLM2-135M-Instruct in float32 on one torch thread, radix cache off: a 256-token prompt of
random ids is prefilled, then `--new-tokens` decode steps are timed (`--repeats` times, ms per
step) and one more such run is profiled with cProfile, printing the functions with the most
own time. It uses only `Engine`'s public calls, so it runs against an older tree too: put
that tree first on PYTHONPATH to compare the two (BASE: a worktree of the older commit).

    .venv/bin/python benchmarks/profile_decode.py
    PYTHONPATH=BASE .venv/bin/python benchmarks/profile_decode.py
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

import torch

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.scheduler.scheduler import SchedulerConfig

FIRST_ORDINARY_ID = 17  # SmolLM2's special tokens are ids 0..16


def decode_ms(engine: Engine, rng: random.Random, prompt_len: int, new_tokens: int) -> float:
    """Prefill one request, then ms per decode step until it finishes."""
    vocab = engine.model_config.vocab_size
    prompt = [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(prompt_len)]
    req = engine.submit(prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    engine.step()  # the prefill (and the first token)
    start, steps = time.perf_counter(), 0
    while req.finish_reason is None:
        engine.step()
        steps += 1
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=18, help="functions printed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = Engine(
        EngineConfig(
            model="smollm2-135m-instruct",
            dtype="float32",
            cache=CacheConfig(page_size=16, num_device_pages=200, enable_radix_cache=False),
            scheduler=SchedulerConfig(chunked_prefill_size=2048),
        )
    )
    rng = random.Random(0)
    decode_ms(engine, rng, args.prompt_len, 4)  # warm-up: first calls pick kernels
    times = [decode_ms(engine, rng, args.prompt_len, args.new_tokens) for _ in range(args.repeats)]
    print("decode ms per step:", " ".join(f"{t:.2f}" for t in times))
    profile = cProfile.Profile()
    profile.enable()
    decode_ms(engine, rng, args.prompt_len, args.new_tokens)
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
