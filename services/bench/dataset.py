"""The `generated-shared-prefix` workload: groups of multi-turn conversations over random ids.

Each group has one system prompt that all of its conversations start with. Turn 1 of a
conversation is `system + question_1`; turn k is turn k-1's prompt, the answer the server
gave to it, then `question_k`. So every turn extends the one before it (multi-turn reuse),
and the conversations of a group share their first `system_prompt_len` tokens.

Lengths are drawn uniformly from `[range_ratio * len, len]` (a ratio of 1 gives exact
lengths); token ids are drawn uniformly from `[0, vocab_size)`. One seed fixes everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

BYTE_VOCAB_SIZE = 256  # the tiny model's vocabulary: one id per byte


@dataclass(frozen=True, slots=True)
class GspConfig:
    num_groups: int = 64
    prompts_per_group: int = 16  # conversations per group
    system_prompt_len: int = 2048
    question_len: int = 128
    output_len: int = 256
    num_turns: int = 1
    range_ratio: float = 1.0  # lengths drawn from [range_ratio * len, len]
    seed: int = 1
    vocab_size: int = BYTE_VOCAB_SIZE
    num_prompts: int | None = None  # keep only the first N conversations

    def __post_init__(self) -> None:
        if self.num_groups < 1 or self.prompts_per_group < 1 or self.num_turns < 1:
            raise ValueError("--gsp-num-groups, --gsp-prompts-per-group, --gsp-num-turns >= 1")
        if self.system_prompt_len < 0 or self.question_len < 1 or self.output_len < 1:
            raise ValueError(
                "--gsp-system-prompt-len >= 0, --gsp-question-len and --gsp-output-len >= 1"
            )
        if not 0.0 <= self.range_ratio <= 1.0:
            raise ValueError("--gsp-range-ratio must be in [0, 1]")
        if self.vocab_size < 1:
            raise ValueError("vocab_size must be positive")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError("--num-prompts must be positive")

    @property
    def num_conversations(self) -> int:
        total = self.num_groups * self.prompts_per_group
        return total if self.num_prompts is None else min(total, self.num_prompts)

    def describe(self) -> str:
        return (
            f"generated-shared-prefix: {self.num_groups} groups x {self.prompts_per_group} "
            f"conversations, system {self.system_prompt_len}, question {self.question_len}, "
            f"output {self.output_len}, {self.num_turns} turns, range ratio {self.range_ratio:g}"
        )


@dataclass(frozen=True, slots=True)
class Conversation:
    """The fixed parts of one conversation; the answers come from the server."""

    conversation_id: int
    group_id: int
    system_ids: tuple[int, ...]  # shared by every conversation of the group
    question_ids: tuple[tuple[int, ...], ...]  # one per turn
    output_lens: tuple[int, ...]  # max_tokens per turn

    @property
    def num_turns(self) -> int:
        return len(self.question_ids)

    def prompt(self, turn: int, answers: Sequence[Sequence[int]]) -> list[int]:
        """The prompt of `turn` (0-based), given the answers to turns `0 .. turn-1`."""
        if not 0 <= turn < self.num_turns:
            raise IndexError(f"turn {turn} of a {self.num_turns}-turn conversation")
        if len(answers) < turn:
            raise ValueError(f"turn {turn} needs {turn} answers, got {len(answers)}")
        ids = list(self.system_ids)
        for k in range(turn):
            ids += self.question_ids[k]
            ids += answers[k]
        ids += self.question_ids[turn]
        return ids


def generate_shared_prefix(config: GspConfig) -> list[Conversation]:
    """The conversations of the workload, group by group, in a fixed order for a seed."""
    rng = np.random.default_rng(config.seed)

    def draw_len(length: int) -> int:
        low = round(config.range_ratio * length)
        return int(rng.integers(low, length + 1))

    def draw_ids(length: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(0, config.vocab_size, size=length))

    conversations: list[Conversation] = []
    for group in range(config.num_groups):
        system_ids = draw_ids(draw_len(config.system_prompt_len))
        for _ in range(config.prompts_per_group):
            questions = tuple(
                draw_ids(max(1, draw_len(config.question_len))) for _ in range(config.num_turns)
            )
            outputs = tuple(max(1, draw_len(config.output_len)) for _ in range(config.num_turns))
            conversations.append(
                Conversation(len(conversations), group, system_ids, questions, outputs)
            )
    return conversations[: config.num_conversations]
