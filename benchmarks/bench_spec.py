"""Speculative decoding's decode throughput: speculation on vs off, batch 1 and 8.

For each model (`tiny`, float64 random weights; `smollm2-135m-instruct`, the real default
model, float32 on the CPU) and batch size, the engine decodes `--batch` distinct prompts of
`--prompt-len` seeded random token ids, greedy, `--new-tokens` tokens each with EOS ignored,
radix cache off, once without speculation and once per `--draft-quantization` scheme with
`--speculative-algorithm standalone --speculative-draft-model-path self` (the target's own
weights as the draft, re-quantized by the scheme: `int8` is the engine's default for a real
checkpoint, `none` the exact copy; `--steps` proposals a round). Decode tok/s = the batch's output tokens after the first / the time
from the last row's first token to the last row's last token. `accept len` is the tokens
a verify round emitted on average (accepted + 1), `accept rate` accepted / proposed.
Cases run in `--rounds` interleaved rounds after a warm-up (all arms of a round back to
back, their order rotating), so a shared machine's drift hits every arm alike; the table
reports medians with their min-max spread and the on/off ratio of the medians.

Where the time of a speculative step goes: the draft's and the target's forwards are timed
(`Timed` wraps the decoder's two executors; the CPU runs them synchronously), so the table
splits each measured decode's time per verify round into draft forwards, the verify forward
and the rest (sampling, bookkeeping, the scheduler's own step).

    .venv/bin/python benchmarks/bench_spec.py --rounds 2
    .venv/bin/python benchmarks/bench_spec.py --models smollm2-135m-instruct --rounds 5
    .venv/bin/python benchmarks/bench_spec.py --models tiny --device cuda
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.scheduler.request import Req
from gpu_worker.scheduler.scheduler import SchedulerConfig
from gpu_worker.scheduler.spec_config import SpecConfig

FIRST_ORDINARY_ID = 17  # SmolLM2's special tokens are ids 0..16


class Timed:
    """An executor whose `logits` calls add their wall time to `spent` (everything else is
    the executor's own): how long the draft's or the target's forwards took."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.spent = 0.0

    def logits(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        start = time.perf_counter()
        out: torch.Tensor = self.inner.logits(*args, **kwargs)
        self.spent += time.perf_counter() - start
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def make_engine(
    model: str, device: str, quant: str | None, steps: int, batch: int, plen: int
) -> Engine:
    """An engine without speculation (`quant` None) or with a `self` draft re-quantized by
    `quant`; with speculation, its decoder's draft and target executors are `Timed`."""
    spec = SpecConfig("standalone", "self", steps, quant) if quant else SpecConfig()
    eng = Engine(
        EngineConfig(
            model=model,
            dtype="auto",
            device=device,
            cache=CacheConfig(page_size=16, num_device_pages=1024, enable_radix_cache=False),
            scheduler=SchedulerConfig(chunked_prefill_size=batch * plen),
            spec=spec,
        )
    )
    if eng.spec is not None:
        eng.spec.draft = Timed(eng.spec.draft)  # type: ignore[assignment]
        eng.spec.target = Timed(eng.spec.target)  # type: ignore[assignment]
    return eng


def spent(eng: Engine) -> tuple[float, float]:
    """Seconds the draft's and the target's forwards took so far (0 without speculation)."""
    if eng.spec is None:
        return 0.0, 0.0
    draft, target = eng.spec.draft, eng.spec.target
    assert isinstance(draft, Timed) and isinstance(target, Timed)
    return draft.spent, target.spent


def prompts(vocab: int, batch: int, plen: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    hi = min(vocab, 256) if vocab < 1000 else vocab
    return [[rng.randrange(FIRST_ORDINARY_ID, hi) for _ in range(plen)] for _ in range(batch)]


@dataclass(slots=True)
class Decode:
    """One measured decode of a batch: tok/s, its requests, and its seconds in all, in draft
    forwards and in verify forwards."""

    rate: float
    reqs: list[Req]
    took: float
    draft: float
    verify: float


def decode_rate(eng: Engine, batch: list[list[int]], new_tokens: int) -> Decode:
    """Decode tok/s of one batch, and its requests (for their verify rounds)."""
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    reqs = [eng.submit(p, sp) for p in batch]
    while any(not r.output_ids for r in reqs):
        eng.step()
    draft0, verify0 = spent(eng)
    start = time.perf_counter()
    while any(r.finish_reason is None for r in reqs):
        eng.step()
    took = time.perf_counter() - start
    draft1, verify1 = spent(eng)
    rate = len(reqs) * (new_tokens - 1) / took
    return Decode(rate, reqs, took, draft1 - draft0, verify1 - verify0)


def spread(xs: list[float], fmt: Callable[[float], str]) -> str:
    """`median (min-max)`."""
    return f"{fmt(statistics.median(xs))} ({fmt(min(xs))}-{fmt(max(xs))})"


@dataclass(slots=True)
class Arm:
    """One engine's measured rounds at one batch size (`quant` None: speculation off)."""

    quant: str | None
    rates: list[float] = field(default_factory=list)
    verified: list[tuple[int, int]] = field(default_factory=list)  # (proposed, accepted)
    # per measured decode, ms per verify round: draft forwards, verify forward, the rest
    split: list[tuple[float, float, float]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return "off" if self.quant is None else f"self {self.quant}"

    def add(self, d: Decode) -> None:
        self.rates.append(d.rate)
        rounds = [x for r in d.reqs for x in r.spec_rounds]
        self.verified += rounds
        if self.quant is not None:
            steps = max(len(r.spec_rounds) for r in d.reqs)  # a step verifies every row
            ms = 1e3 / steps
            self.split.append((d.draft * ms, d.verify * ms, (d.took - d.draft - d.verify) * ms))


def loadavg() -> str:
    """/proc/loadavg (the machine is shared: how busy it was around the measurement)."""
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "unknown"


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
    ap.add_argument(
        "--draft-quantization",
        default="int8,none",
        help="the self draft's schemes, one speculative arm each (comma-separated)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    quants: list[str | None] = [None, *args.draft_quantization.split(",")]
    print(f"load before: {loadavg()}", flush=True)
    rows = []
    for model in args.models.split(","):
        engines = {
            q: make_engine(model, args.device, q, args.steps, 8, args.prompt_len) for q in quants
        }
        vocab = engines[None].model_config.vocab_size
        for b in (int(x) for x in args.batches.split(",")):
            arms = [Arm(q) for q in quants]
            for rnd in range(args.rounds + 1):  # round 0 warms up
                shift = rnd % len(arms)
                for arm in arms[shift:] + arms[:shift]:
                    d = decode_rate(
                        engines[arm.quant], prompts(vocab, b, args.prompt_len, rnd), args.new_tokens
                    )
                    if rnd:
                        arm.add(d)
            rows.append((model, b, arms))
        for eng in engines.values():
            eng.close()
    print(f"load after: {loadavg()}")
    print(
        f"\ndecode tok/s, speculation off vs on (draft self, K={args.steps}), "
        f"{args.device}, {args.threads} thread(s), prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, medians (min-max) of {args.rounds} interleaved rounds"
    )
    print(
        f"{'model':<24}{'batch':>6} {'arm':<11}{'tok/s':>22}{'on/off':>8}{'accept len':>11}"
        f"{'rate':>6} | ms per verify round: {'draft':>7}{'verify':>8}{'rest':>7}"
    )
    for model, b, arms in rows:
        off = statistics.median(arms[0].rates)
        for arm in arms:
            line = f"{model:<24}{b:>6} {arm.name:<11}{spread(arm.rates, lambda x: f'{x:.1f}'):>22}"
            line += f"{statistics.median(arm.rates) / off:>8.2f}"
            if arm.verified:
                accepted = sum(a for _, a in arm.verified)
                alen = (accepted + len(arm.verified)) / len(arm.verified)
                rate = accepted / sum(p for p, _ in arm.verified)
                d, v, o = (statistics.median(x[i] for x in arm.split) for i in range(3))
                line += f"{alen:>11.2f}{rate:>6.0%} | {'':>21}{d:>7.1f}{v:>8.1f}{o:>7.1f}"
            print(line)


if __name__ == "__main__":
    main()
