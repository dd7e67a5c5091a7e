"""The `mooncake` workload: a public Mooncake trace read as token ids, and its cache bound.

The format (github.com/kvcache-ai/Mooncake, FAST'25 traces): JSON lines, one request each,
with `timestamp` (arrival, ms), `input_length`, `output_length` (tokens) and `hash_ids`, one id
per 512-token block of the prompt; two requests whose `hash_ids` start with the same ids share
those prompt blocks. Other fields are ignored; blank lines are skipped.

Tokens. Hash id `h` becomes `block_size` ids drawn uniformly from `[0, vocab_size)` by a numpy
generator seeded with `(seed, h)`: the same id is the same block in every request, different
ids are independent draws. A prompt is its blocks in order, the last one cut so the prompt
has its length. Two prompts therefore share whole blocks exactly where their `hash_ids` agree;
inside the first block where they differ, the first few tokens can agree by chance (1 in
`vocab_size` per token), a whole page of 4 or more tokens practically never.

Scale. A trace counts in 512-token blocks: a line must hold `ceil(input_length / 512)` ids.
With another `block_size` (a small model) the whole request scales by `block_size / 512`:
every id is `block_size` tokens, the last block keeps its share rounded up
(`ceil(tail * block_size / 512)` of a `tail`-token block), and the output is
`ceil(output_length * block_size / 512)` tokens. At 512 the trace is taken as written. An
output length of 0 becomes 1 (a request generates at least one token).

Order. Requests are sorted by timestamp (stably: file order among equal ones); `arrival_s` is
seconds after the first. "Earlier" below means earlier in that order.

Upper bound. The cached tokens a perfect cache (infinite, one for all requests, every request
served after the ones before it) gives a request: the longest prefix of its prompt, without the
last token (a request computes at least one), that is whole pages of some earlier prompt,
counted in whole pages, as the engine matches (`HiCache.match`). Only prompts count: outputs are
generated and a later prompt holds trace blocks, not them. A page is known by its chained
`bus_schemas.page_hash` digest, so "whole pages of some earlier prompt" is one set lookup per
page. A run measures less where a request shares a prefix still being computed, where the
cache evicted, or where engines do not share their caches; more only by chance (an output
that a later prompt repeats) or when requests are served out of trace order.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bus_schemas.page_hash import chain_hashes, root_hash
from bus_schemas.token_ids import TYPECODE, TokenIds, as_token_ids
from services.bench.dataset import BYTE_VOCAB_SIZE, Conversation

TRACE_BLOCK_SIZE = 512  # tokens per hash id in the trace's own lengths


class TraceFormatError(ValueError):
    """A trace line that is not a Mooncake request; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class MooncakeConfig:
    path: str
    block_size: int = TRACE_BLOCK_SIZE  # tokens per hash id
    vocab_size: int = BYTE_VOCAB_SIZE
    seed: int = 1  # of the blocks' tokens
    num_prompts: int | None = None  # keep only the first N requests (in timestamp order)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("--mooncake-block-size must be positive")
        if self.vocab_size < 1:
            raise ValueError("vocab_size must be positive")
        if self.seed < 0:
            raise ValueError("--seed must be >= 0 with --dataset-name mooncake")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError("--num-prompts must be positive")

    def read(self) -> list[TraceRequest]:
        return read_mooncake(
            self.path, self.block_size, self.vocab_size, self.seed, self.num_prompts
        )


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One trace request as token ids."""

    arrival_s: float  # seconds after the trace's first request
    input_ids: TokenIds  # the prompt: its blocks, the last one cut
    output_len: int  # max_tokens (sent with ignore_eos: exactly this many come back)
    hash_ids: tuple[int, ...]
    line: int  # 1-based line of the trace file

    @property
    def input_len(self) -> int:
        return len(self.input_ids)


def block_ids(hash_id: int, block_size: int, vocab_size: int, seed: int) -> TokenIds:
    """The `block_size` token ids of hash id `hash_id` (the same for the same arguments)."""
    rng = np.random.default_rng([seed, hash_id])
    return as_token_ids(rng.integers(0, vocab_size, size=block_size, dtype=np.uint32).tobytes())


def scaled_len(trace_len: int, block_size: int) -> int:
    """`trace_len` tokens of 512-token blocks in `block_size`-token blocks (rounded up)."""
    return -(-trace_len * block_size // TRACE_BLOCK_SIZE)


@dataclass(frozen=True, slots=True)
class TraceLine:
    """One request as the trace writes it (its lengths count 512 tokens per hash id)."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    line: int  # 1-based


def read_mooncake(
    path: str | Path,
    block_size: int = TRACE_BLOCK_SIZE,
    vocab_size: int = BYTE_VOCAB_SIZE,
    seed: int = 1,
    num_prompts: int | None = None,
) -> list[TraceRequest]:
    """The requests of the trace at `path` in timestamp order (the first `num_prompts`, or
    all), as token ids. Every line is checked: TraceFormatError (a ValueError) names the
    first malformed one; a trace without requests is an error too."""
    blocks: dict[int, TokenIds] = {}

    def block(h: int) -> TokenIds:
        ids = blocks.get(h)
        if ids is None:
            ids = blocks[h] = block_ids(h, block_size, vocab_size, seed)
        return ids

    lines = read_trace_lines(path)[:num_prompts]
    first_ms = lines[0].timestamp_ms
    requests: list[TraceRequest] = []
    for t in lines:
        tail = t.input_length - TRACE_BLOCK_SIZE * (len(t.hash_ids) - 1)
        prompt = array(TYPECODE)
        for h in t.hash_ids[:-1]:
            prompt += block(h)
        prompt += block(t.hash_ids[-1])[: scaled_len(tail, block_size)]
        requests.append(
            TraceRequest(
                arrival_s=(t.timestamp_ms - first_ms) / 1e3,
                input_ids=prompt,
                output_len=max(1, scaled_len(t.output_length, block_size)),
                hash_ids=t.hash_ids,
                line=t.line,
            )
        )
    return requests


def read_trace_lines(path: str | Path) -> list[TraceLine]:
    """Every request line of the trace, checked, sorted by timestamp (stably)."""
    lines: list[TraceLine] = []
    with open(path) as f:
        for line_no, text in enumerate(f, 1):
            if text.strip():
                lines.append(parse_line(text, f"{path}:{line_no}", line_no))
    if not lines:
        raise TraceFormatError(f"{path}: no requests in the trace")
    lines.sort(key=lambda t: t.timestamp_ms)
    return lines


def parse_line(text: str, where: str, line_no: int) -> TraceLine:
    """One line of the trace; TraceFormatError starting with `where` when malformed."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    fields = ("timestamp", "input_length", "output_length", "hash_ids")
    missing = [k for k in fields if k not in obj]
    if missing:
        raise TraceFormatError(f"{where}: missing {', '.join(missing)}")
    timestamp, input_len, output_len, hash_ids = (obj[k] for k in fields)
    if not _is_number(timestamp) or not math.isfinite(timestamp) or timestamp < 0:
        raise TraceFormatError(f"{where}: timestamp must be a number of ms >= 0, got {timestamp!r}")
    if not _is_int(input_len) or input_len < 1:
        raise TraceFormatError(f"{where}: input_length must be an integer >= 1, got {input_len!r}")
    if not _is_int(output_len) or output_len < 0:
        raise TraceFormatError(
            f"{where}: output_length must be an integer >= 0, got {output_len!r}"
        )
    if not isinstance(hash_ids, list) or not all(_is_int(h) and h >= 0 for h in hash_ids):
        raise TraceFormatError(f"{where}: hash_ids must be a list of integers >= 0")
    need = -(-input_len // TRACE_BLOCK_SIZE)
    if len(hash_ids) != need:
        raise TraceFormatError(
            f"{where}: {len(hash_ids)} hash_ids for input_length {input_len}; a Mooncake trace "
            f"has one per {TRACE_BLOCK_SIZE}-token block, ceil({input_len} / "
            f"{TRACE_BLOCK_SIZE}) = {need}"
        )
    return TraceLine(float(timestamp), input_len, output_len, tuple(hash_ids), line_no)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


class PrefixBound:
    """The upper bound, request by request: `hit` a prompt, then `add` it (see the module)."""

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError("page_size must be positive")
        self.page_size = page_size
        self._root = root_hash("mooncake-upper-bound")
        self._seen: set[bytes] = set()  # chained digests of every earlier prompt's whole pages

    def hit(self, prompt: Sequence[int] | TokenIds) -> int:
        """Tokens of `prompt` a perfect cache holds after the prompts added so far."""
        num_pages = 0
        for digest in chain_hashes(self._root, prompt[:-1], self.page_size):
            if digest not in self._seen:
                break
            num_pages += 1
        return num_pages * self.page_size

    def add(self, prompt: Sequence[int] | TokenIds) -> None:
        self._seen.update(chain_hashes(self._root, prompt, self.page_size))


def upper_bound_per_request(requests: Iterable[TraceRequest], page_size: int) -> list[int]:
    """Each request's bound, in order (see the module)."""
    bound = PrefixBound(page_size)
    hits: list[int] = []
    for r in requests:
        hits.append(bound.hit(r.input_ids))
        bound.add(r.input_ids)
    return hits


def upper_bound(requests: Iterable[TraceRequest], page_size: int) -> int:
    """The offline upper bound of cached prompt tokens over `requests`, in order."""
    return sum(upper_bound_per_request(requests, page_size))


def trace_conversations(requests: Sequence[TraceRequest]) -> list[Conversation]:
    """The requests as one-turn conversations for the bench client (group 0, id = index)."""
    return [
        Conversation(i, 0, (), (tuple(r.input_ids),), (r.output_len,))
        for i, r in enumerate(requests)
    ]


def describe(config: MooncakeConfig, requests: Sequence[TraceRequest]) -> str:
    input_tokens = sum(r.input_len for r in requests)
    output_tokens = sum(r.output_len for r in requests)
    distinct = len({h for r in requests for h in r.hash_ids})
    span = requests[-1].arrival_s if requests else 0.0
    return (
        f"mooncake: {config.path}, {len(requests)} requests over {span:.1f} s, "
        f"{config.block_size} tokens per hash id, {distinct} distinct hash ids, "
        f"{input_tokens} input / {output_tokens} output tokens"
    )
