"""Speculative decoding and prefix reuse on a multi-turn agentic trace (issue 23,
acceptance 4): does speculation change what the cache reuses, and does a restored prefix
give the draft back what it had?

`--conversations` conversations of `--turns` turns each share one system prompt; every turn
resends the whole history (system prompt, the earlier user turns and the model's replies)
plus a new user message, rendered with the model's own chat template and encoded as the
router does (`--model tiny`, which has no tokenizer: plain token ids, the history as the
earlier prompt and output plus `--user-tokens` random ids). Histories grow from ~300 to
~1,000 tokens on SmolLM2. Requests go one at a time, the same request to every arm back to
back (machine noise hits all alike), greedy, `--new-tokens` tokens with EOS ignored:
- `off`: speculation off, device + host tiers (write_through, threshold 1);
- `spec`: the same with speculation on (`self` draft, `--draft-quantization`, K steps);
- `spec+L3` (unless `--no-l3`): `spec` plus a `file` store in a fresh temporary directory;
- `cold`: speculation on, radix cache off: each request's acceptance with nothing reused.

Before each request its restore source is forced, in turn: `device` (nothing done: the
prefix is still on the device), `host` (the device emptied, `cache.evict_device`, after
the transfers drain: the prefix comes back from the host) and, with L3, `L3` (the L3 arm's
device and host flushed: its prefix is read back from the store; the other arms have their
device emptied, as for `host`). Reported per arm: cached tokens (device / host / storage)
against the offline upper bound (every page-aligned prefix but the last token any earlier
request left KV for: an infinite cache), median TTFT (submit to first token); per
speculative arm and restore source, the acceptance length (tokens per verify round) of its
requests against the same requests' `cold` acceptance length. The goals: `spec`'s hit/bound
within 1 point of `off`, acceptance after a restore >= 0.99 of cold. Every arm's output
must equal `off`'s token for token (asserted).

    .venv/bin/python benchmarks/bench_spec_reuse.py
    .venv/bin/python benchmarks/bench_spec_reuse.py --model tiny --conversations 2 --turns 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import torch

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.driver import StepLoop
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.model.tokenizer import Tokenizer, load_chat_template, load_tokenizer
from gpu_worker.scheduler.request import GenerateOutput
from gpu_worker.scheduler.scheduler import SchedulerConfig
from gpu_worker.scheduler.spec_config import SpecConfig
from router.chat import ChatMessage, ChatTemplate

# the scripts beside this one (benchmarks/ is sys.path[0] when a script runs)
from bench_spec import loadavg  # isort: skip
from bench_storage import UpperBound  # isort: skip

SYSTEM = (
    "You are a careful assistant inside a software team's workflow tool. You help engineers "
    "plan, review and explain changes to a large Python code base that serves language "
    "models. Answer briefly and precisely; when you are unsure, say what you would check "
    "and how. Prefer plain explanations over jargon, give small concrete examples, and keep "
    "lists short. Never invent function names or command-line flags that were not given to "
    "you; ask for them instead. When you are asked to review code, first say what the code "
    "does in one sentence, then list the problems you see in order of importance, each with "
    "a suggested fix. When you are asked for a plan, give numbered steps with one line each "
    "and say which step is the riskiest and why. The team works in small commits, runs its "
    "tests before each one, and writes commit messages that say why a change was made."
)
TOPICS = [
    "a radix tree that caches the key-value pages of prompts",
    "a scheduler that mixes prefill chunks and decode steps in one batch",
    "a host memory tier that backs up evicted device pages",
    "speculative decoding with a quantized copy of the model as the draft",
]
ASKS = [
    "Explain in a few sentences what {} is for and when it helps.",
    "What could go wrong in {}, and how would a test catch it?",
    "Suggest one small change that would make {} faster, with its risk.",
    "Summarize our discussion of {} in three short bullet points.",
]
SOURCES = ("device", "host", "L3")


@dataclass(slots=True)
class Arm:
    name: str
    engine: Engine
    ttfts: list[float] = field(default_factory=list)
    device: int = 0
    host: int = 0
    storage: int = 0
    outputs: list[GenerateOutput] = field(default_factory=list)

    @property
    def cached(self) -> int:
        return self.device + self.host + self.storage


def serve(arm: Arm, prompt: list[int], sp: SamplingParams) -> GenerateOutput:
    """One request alone: its TTFT, cached tokens and output."""
    engine = arm.engine
    start = time.perf_counter()
    req, loop = engine.submit(prompt, sp), StepLoop(engine)
    while not req.output_ids and req.finish_reason is None:
        loop.step_or_wait()
    arm.ttfts.append(time.perf_counter() - start)
    out = engine.run([req])[0]
    assert out.finish_reason == "length", out.finish_reason
    arm.device += out.cached.device
    arm.host += out.cached.host
    arm.storage += out.cached.storage
    arm.outputs.append(out)
    return out


def make_engine(args: argparse.Namespace, spec: bool, reuse: bool, l3_dir: str | None) -> Engine:
    cache = CacheConfig(
        page_size=args.page_size,
        num_device_pages=args.device_pages,
        enable_radix_cache=reuse,
        enable_hierarchical_cache=reuse,
        write_through_threshold=1,  # every page backed up at once: a host restore has it all
        hicache_storage_backend="file" if l3_dir else None,
        hicache_storage_dir=l3_dir or "",
    )
    return Engine(
        EngineConfig(
            model=args.model,
            dtype="auto",
            context_len=args.context_len,
            cache=cache,
            scheduler=SchedulerConfig(chunked_prefill_size=2048),
            batch_invariant=args.batch_invariant,
            spec=(
                SpecConfig("standalone", "self", args.steps, args.draft_quantization)
                if spec
                else SpecConfig()
            ),
        )
    )


def force(arms: list[Arm], source: str) -> None:
    """Make the next request's prefix come from `source` on the reusing arms."""
    if source == "device":
        return
    for arm in arms:
        eng = arm.engine
        if not eng.config.cache.enable_radix_cache:
            continue
        eng.drain()
        if source == "L3" and eng.config.cache.hicache_storage_backend:
            assert eng.flush_cache(), "flush refused: a request is still running"
        else:
            eng.cache.evict_device(eng.cache.tree.num_device_pages)


class Trace:
    """The conversations' prompts: the chat template over the growing history (SmolLM2),
    or plain token ids (`tiny`)."""

    def __init__(self, args: argparse.Namespace, vocab: int) -> None:
        self.args = args
        self.rng = random.Random(0)
        self.tokenizer: Tokenizer | None = None
        if args.model != "tiny":
            self.tokenizer = load_tokenizer(args.model)
            self.template = ChatTemplate(load_chat_template(args.model))
        self.messages = [[ChatMessage("system", SYSTEM)] for _ in range(args.conversations)]
        system = [self.rng.randrange(17, min(vocab, 256)) for _ in range(args.user_tokens * 3)]
        self.ids = [list(system) for _ in range(args.conversations)]
        self.vocab = vocab

    def prompt(self, conv: int, turn: int) -> list[int]:
        if self.tokenizer is None:
            user = [
                self.rng.randrange(17, min(self.vocab, 256)) for _ in range(self.args.user_tokens)
            ]
            return self.ids[conv] + user
        ask = ASKS[turn % len(ASKS)].format(TOPICS[(conv + turn) % len(TOPICS)])
        self.messages[conv].append(ChatMessage("user", ask))
        return self.tokenizer.encode(self.template.render(self.messages[conv]))

    def reply(self, conv: int, prompt: list[int], output: list[int]) -> None:
        if self.tokenizer is None:
            self.ids[conv] = prompt + output
        else:
            text = self.tokenizer.decode(output)
            self.messages[conv].append(ChatMessage("assistant", text))


def accept_len(outs: list[GenerateOutput]) -> float:
    rounds = [x for o in outs for x in o.spec_rounds]
    return (sum(a for _, a in rounds) + len(rounds)) / len(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-tokens", type=int, default=64, help="tiny: new ids per turn")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--draft-quantization", default="int8")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--device-pages", type=int, default=512)
    ap.add_argument("--context-len", type=int, default=2048)
    ap.add_argument("--no-l3", action="store_true", help="leave out the `spec+L3` arm")
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load before: {loadavg()}", flush=True)
    sources = SOURCES[:2] if args.no_l3 else SOURCES
    arms = [Arm("off", make_engine(args, False, True, None))]
    arms.append(Arm("spec", make_engine(args, True, True, None)))
    if not args.no_l3:
        l3 = tempfile.mkdtemp(prefix="bench-spec-l3-")
        arms.append(Arm("spec+L3", make_engine(args, True, True, l3)))
    cold = Arm("cold", make_engine(args, True, False, None))
    every = [*arms, cold]
    trace = Trace(args, arms[0].engine.model_config.vocab_size)
    bound = UpperBound(args.page_size)
    bound_total, lens = 0, []
    forced: list[str] = []
    sp = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    for turn in range(args.turns):
        for conv in range(args.conversations):
            prompt = trace.prompt(conv, turn)
            lens.append(len(prompt))
            source = sources[len(forced) % len(sources)] if turn else "device"
            forced.append(source)
            force(arms, source)
            bound_total += bound.hit(prompt)
            shift = len(forced) % len(every)
            outs = {arm.name: serve(arm, prompt, sp) for arm in every[shift:] + every[:shift]}
            for name, out in outs.items():
                assert out.output_ids == outs["off"].output_ids, (
                    f"{name} differs from off (conversation {conv}, turn {turn}): "
                    f"{out.output_ids} vs {outs['off'].output_ids}"
                )
            output = outs["off"].output_ids
            bound.add(prompt + output[:-1])
            trace.reply(conv, prompt, output)
    print(f"load after: {loadavg()}")
    print(
        f"\n{args.model} ({arms[0].engine.config.dtype}), {args.conversations} conversations x {args.turns} turns, "
        f"prompts {min(lens)}-{max(lens)} tokens, {args.new_tokens} out, page {args.page_size}, "
        f"self {args.draft_quantization} draft K={args.steps}, {args.threads} thread(s); "
        f"{len(lens)} requests, restore sources forced: "
        + ", ".join(f"{s} {forced.count(s)}" for s in ("device", *sources[1:]))
    )
    print(f"offline upper bound of cached tokens: {bound_total}; outputs equal in every arm")
    print(
        f"{'arm':<8} {'cached':>7} {'device':>7} {'host':>7} {'storage':>7} {'of bound':>9} "
        f"{'TTFT p50 ms':>12} {'accept len':>11}"
    )
    for arm in every:
        spec = f"{accept_len(arm.outputs):>11.3f}" if arm.outputs[0].spec_rounds else ""
        print(
            f"{arm.name:<8} {arm.cached:>7} {arm.device:>7} {arm.host:>7} {arm.storage:>7} "
            f"{f'{arm.cached / bound_total:.3f}' if arm is not cold else '-':>9} "
            f"{statistics.median(arm.ttfts) * 1e3:>12.1f} {spec}"
        )
    print("\nacceptance length by restore source (requests after turn 1), vs the same cold")
    print(
        f"{'arm':<8} {'source':<7} {'requests':>8} {'restored':>9} {'accept len':>11} "
        f"{'cold':>7} {'ratio':>7}"
    )
    for arm in arms[1:]:
        has_store = arm.engine.config.cache.hicache_storage_backend is not None
        # without a store, an `L3` request had its device emptied: a host restore
        got = [s if s != "L3" or has_store else "host" for s in forced]
        for source in sources:
            idx = [i for i, s in enumerate(got) if s == source and i >= args.conversations]
            if not idx:
                continue
            tier = {"device": "device", "host": "host", "L3": "storage"}[source]
            restored = sum(getattr(arm.outputs[i].cached, tier) for i in idx)
            mine = accept_len([arm.outputs[i] for i in idx])
            ref = accept_len([cold.outputs[i] for i in idx])
            print(
                f"{arm.name:<8} {source:<7} {len(idx):>8} {restored:>9} {mine:>11.3f} "
                f"{ref:>7.3f} {mine / ref:>7.3f}"
            )
    off_rate = arms[0].cached / bound_total
    for arm in arms[1:]:
        print(
            f"hit/bound {arm.name} - off: {(arm.cached / bound_total - off_rate) * 100:+.2f} points"
        )
    for arm in every:
        arm.engine.close()


if __name__ == "__main__":
    main()
