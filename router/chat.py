"""The chat template: how `/v1/chat/completions` messages become one prompt string.

The template is the served model's own (its model card carries it: a GGUF's
`tokenizer.chat_template`, a checkpoint's `tokenizer_config.json`, or the engine's
`--chat-template FILE`), a Jinja template rendered as Hugging Face's `apply_chat_template`
renders it: in a sandbox (`ImmutableSandboxedEnvironment`: a template cannot reach Python
internals or change its arguments), with `trim_blocks` and `lstrip_blocks`, loop controls,
`raise_exception`, `strftime_now` and a `tojson` that does not HTML-escape, given
`messages`, `add_generation_prompt=True`, `bos_token` and `eos_token`. The rendered text
holds the template's special tokens as text; it is tokenized without adding more.

A model without a template (the random-weight presets) gets `PLAIN_TEMPLATE`: each message
as `<|{role}|>\\n{content}\\n`, then `<|assistant|>\\n`. Example:

    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    -> "<|system|>\\nBe brief.\\n<|user|>\\nHi\\n<|assistant|>\\n"

Either way a conversation that grows by appending messages keeps its earlier prompt as a
prefix (for templates that render messages in order, as chat templates do), which is what
makes the KV cache hit turn after turn.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, NoReturn

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant")
PLAIN_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str  # one of ROLES
    content: str


class ChatTemplateError(ValueError):
    """The template refused the conversation (its `raise_exception`, or a render error)."""


class ChatTemplate:
    """One compiled template. Raises `jinja2.TemplateError` when `source` does not compile."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "") -> None:
        self.source = PLAIN_TEMPLATE if source is None else source
        self._template = _environment().from_string(self.source)
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}

    def render(self, messages: Sequence[ChatMessage], max_chars: int | None = None) -> str:
        """The prompt text for `messages`, ending with the assistant's turn opened.

        Raises `ChatTemplateError` for anything the template raises (its `raise_exception`,
        an IndexError of `format_map`, a sandbox refusal, a MemoryError) and when its output
        passes `max_chars`: the output is taken chunk by chunk (`generate`), so a template
        that writes without end stops at the budget. What bounds a template that loops
        without writing is the process it runs in (`router.prompt_workers`)."""
        chunks = self._template.generate(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=True,
            **self._tokens,
        )
        out: list[str] = []
        size = 0
        try:
            for chunk in chunks:
                size += len(chunk)
                if max_chars is not None and size > max_chars:
                    raise ChatTemplateError(
                        f"the model's chat template wrote more than {max_chars} characters"
                    )
                out.append(chunk)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the model's chat template refused the messages: {e}") from e
        except ChatTemplateError:
            raise
        except Exception as e:  # a template may raise anything; it is the request's 400
            raise ChatTemplateError(
                f"the model's chat template failed: {type(e).__name__}: {e}"
            ) from e
        finally:
            getattr(chunks, "close", lambda: None)()  # a generator: ends the render
        return "".join(out)


@cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change prompts
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)
