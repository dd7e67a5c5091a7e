"""A Mooncake-format trace of multi-turn conversations, for L3 under host pressure.

`python -m services.bench.conversation_trace --output trace.jsonl [options]` writes JSON lines
that `hicache-mesh bench --dataset-name mooncake --dataset-path trace.jsonl` reads
(`services.bench.mooncake`): `timestamp` (ms), `input_length`, `output_length` and `hash_ids`,
one id per 512-token block of the prompt.

The shape (the public multi-turn traces' one):
- every conversation opens with the same `shared_prefix_blocks` blocks (a hot system prompt);
- turn 1 adds `first_blocks` new blocks; every later turn is the previous turn's blocks plus
  `turn_blocks` new ones (the previous answer and the next question), so block ids chain;
- `active` conversations are open at a time, and each request is the next turn of one of them
  drawn at random; a finished conversation makes room for the next one. Between two turns of
  one conversation about `active` other requests run, so what a turn reuses was last touched
  about `active` requests ago: with `active` x the blocks of a conversation larger than the
  device and host pools together, the later turns' prefixes are found only in external storage.

Only the last block of a prompt is partial (`input_length` is a multiple of 512 less a draw
below 512), so a prompt's prefix up to its last whole block is what its next turn shares.
One seed fixes everything: the same arguments write the same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from services.bench.mooncake import TRACE_BLOCK_SIZE


@dataclass(frozen=True, slots=True)
class ConversationTraceConfig:
    num_conversations: int = 48
    turns: int = 6  # requests per conversation
    active: int = 16  # conversations open at a time (their turns interleave)
    shared_prefix_blocks: int = 8  # the hot prefix every conversation starts with
    first_blocks: tuple[int, int] = (4, 6)  # new blocks of turn 1, drawn in [lo, hi]
    turn_blocks: tuple[int, int] = (1, 3)  # new blocks of every later turn, in [lo, hi]
    output_length: tuple[int, int] = (64, 512)  # tokens, drawn in [lo, hi]
    interval_ms: float = 100.0  # between consecutive requests' timestamps
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.num_conversations, self.turns, self.active) < 1:
            raise ValueError("--num-conversations, --turns and --active must be >= 1")
        if self.shared_prefix_blocks < 0:
            raise ValueError("--shared-prefix-blocks must be >= 0")
        for name, (lo, hi) in (
            ("first-blocks", self.first_blocks),
            ("turn-blocks", self.turn_blocks),
            ("output-length", self.output_length),
        ):
            if not 0 <= lo <= hi:
                raise ValueError(f"--{name} LO HI needs 0 <= LO <= HI, got {lo} {hi}")
        if self.shared_prefix_blocks + self.first_blocks[0] < 1:
            raise ValueError("a first turn needs at least one block")
        if self.interval_ms < 0:
            raise ValueError("--interval-ms must be >= 0")


def generate(config: ConversationTraceConfig) -> list[dict[str, object]]:
    """The trace's lines in timestamp order (see the module docstring)."""
    rng = random.Random(config.seed)
    next_id = config.shared_prefix_blocks  # ids [0, shared) are the hot prefix

    def new_blocks(bounds: tuple[int, int]) -> list[int]:
        nonlocal next_id
        n = rng.randint(*bounds)
        next_id += n
        return list(range(next_id - n, next_id))

    shared = list(range(config.shared_prefix_blocks))
    waiting = config.num_conversations  # not started yet
    open_: list[tuple[list[int], int]] = []  # (blocks so far, turns done)
    lines: list[dict[str, object]] = []
    while waiting or open_:
        while waiting and len(open_) < config.active:
            open_.append(([], 0))
            waiting -= 1
        i = rng.randrange(len(open_))
        blocks, done = open_[i]
        blocks = (
            blocks + new_blocks(config.turn_blocks)
            if done
            else shared + new_blocks(config.first_blocks)
        )
        tail = rng.randint(1, TRACE_BLOCK_SIZE)  # tokens of the last, partial block
        lines.append(
            {
                "timestamp": round(len(lines) * config.interval_ms, 3),
                "input_length": TRACE_BLOCK_SIZE * (len(blocks) - 1) + tail,
                "output_length": rng.randint(*config.output_length),
                "hash_ids": blocks,
            }
        )
        if done + 1 == config.turns:
            open_.pop(i)
        else:
            open_[i] = (blocks, done + 1)
    return lines


def describe(lines: Sequence[dict[str, object]]) -> str:
    """Requests, distinct blocks (the working set) and the largest prompt, in blocks."""
    blocks = [b for line in lines for b in line["hash_ids"]]  # type: ignore[attr-defined]
    longest = max(len(line["hash_ids"]) for line in lines)  # type: ignore[arg-type]
    return (
        f"{len(lines)} requests, {len(set(blocks))} distinct blocks of {TRACE_BLOCK_SIZE} "
        f"tokens (the working set), the longest prompt {longest} blocks"
    )


def write(lines: Sequence[dict[str, object]], path: str) -> None:
    with open(path, "w") as f:
        for line in lines:
            f.write(json.dumps(line, separators=(",", ":")) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    d = ConversationTraceConfig()
    p = argparse.ArgumentParser(
        prog="python -m services.bench.conversation_trace",
        description="Write a Mooncake-format trace of interleaved multi-turn conversations.",
    )
    p.add_argument("--output", required=True, metavar="FILE")
    p.add_argument("--num-conversations", type=int, default=d.num_conversations)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--active", type=int, default=d.active, help="conversations open at once")
    p.add_argument("--shared-prefix-blocks", type=int, default=d.shared_prefix_blocks)
    p.add_argument("--first-blocks", type=int, nargs=2, default=d.first_blocks, metavar="N")
    p.add_argument("--turn-blocks", type=int, nargs=2, default=d.turn_blocks, metavar="N")
    p.add_argument("--output-length", type=int, nargs=2, default=d.output_length, metavar="N")
    p.add_argument("--interval-ms", type=float, default=d.interval_ms)
    p.add_argument("--seed", type=int, default=d.seed)
    args = p.parse_args(argv)
    try:
        config = ConversationTraceConfig(
            num_conversations=args.num_conversations,
            turns=args.turns,
            active=args.active,
            shared_prefix_blocks=args.shared_prefix_blocks,
            first_blocks=tuple(args.first_blocks),
            turn_blocks=tuple(args.turn_blocks),
            output_length=tuple(args.output_length),
            interval_ms=args.interval_ms,
            seed=args.seed,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    lines = generate(config)
    write(lines, args.output)
    print(f"{args.output}: {describe(lines)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
