"""The chat template: how `/v1/chat/completions` messages become one prompt string.

Each message becomes `<|{role}|>\\n{content}\\n`, in order, and the prompt ends with
`<|assistant|>\\n` so the model answers as the assistant. Example:

    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    -> "<|system|>\\nBe brief.\\n<|user|>\\nHi\\n<|assistant|>\\n"

Roles: system, user, assistant. The markers are plain text (the byte tokenizer has no
special tokens for them), so the same conversation always gives the same token ids and a
conversation that grows by appending messages keeps its earlier prompt as a prefix, which is
what makes the KV cache hit turn after turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ROLES = ("system", "user", "assistant")
GENERATION_PROMPT = "<|assistant|>\n"


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str  # one of ROLES
    content: str


def render(messages: Sequence[ChatMessage]) -> str:
    """The prompt text for `messages` (see the module docstring)."""
    parts = [f"<|{m.role}|>\n{m.content}\n" for m in messages]
    parts.append(GENERATION_PROMPT)
    return "".join(parts)
