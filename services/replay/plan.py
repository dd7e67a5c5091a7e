"""What to send for each recorded request, and when.

The body is the recorded one, with changes that keep the answer the same:
- a sampled request that named no seed gets the seed the router drew for it (the record's
  `seed`; choice i then draws from `seed + i` as it did); `/generate` takes it in
  `sampling_params`;
- a redacted request (its header says `redacted`) has no prompt: its `input_ids` go to
  `/v1/completions` as the `prompt`, with the rest of the body (chat's own names become the
  completions ones: `max_completion_tokens` -> `max_tokens`, `logprobs: true` with
  `top_logprobs: k` -> `logprobs: k`). A redacted `/generate` request gets `input_ids`;
- a stream on the OpenAI endpoints asks for usage (`stream_options.include_usage`), so the
  cached tokens per tier come back: that adds a last chunk, and changes no other one.

Arrival times keep the recorded gaps from the first request, divided by `speed`; speed 0
sends every request as soon as `max_concurrency` allows (all at once without a cap).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.replay.recording import RecordedRequest

GENERATE = "/generate"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class Pace:
    """How fast to replay: `speed` 2 halves every gap, 0 drops them; at most
    `max_concurrency` requests in flight (None: no cap)."""

    speed: float = 1.0
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.speed) and self.speed >= 0):
            raise ValueError(f"--speed must be a finite number >= 0, got {self.speed}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be positive")

    def offset(self, arrival_s: float) -> float:
        """When to send a request that arrived `arrival_s` after the first one."""
        return 0.0 if self.speed == 0 else arrival_s / self.speed


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """One request to send."""

    line: int  # of the record, in the input file
    endpoint: str
    body: Any  # JSON
    stream: bool
    arrival_s: float  # recorded arrival after the first request
    send_at_s: float  # when to send it, after the replay's start


def plan(requests: Sequence[RecordedRequest], pace: Pace) -> list[ReplayRequest]:
    """The requests in arrival order (ties: file order), each with its send time."""
    ordered = sorted(requests, key=lambda r: (r.time_s, r.line))
    if not ordered:
        return []
    t0 = ordered[0].time_s
    out = []
    for rec in ordered:
        endpoint, body = request_to_send(rec)
        stream = isinstance(body, dict) and body.get("stream") is True
        arrival = rec.time_s - t0
        out.append(ReplayRequest(rec.line, endpoint, body, stream, arrival, pace.offset(arrival)))
    return out


def request_to_send(rec: RecordedRequest) -> tuple[str, Any]:
    """The endpoint and body that reproduce `rec`'s answer."""
    endpoint, body = rec.endpoint, rec.body
    if not isinstance(body, dict):
        return endpoint, body  # rejected as it was: not a JSON object
    if rec.redacted:
        endpoint, body = _unredacted(rec, body)
    if rec.seed is not None:
        body = _with_seed(endpoint, body, rec.seed)
    if endpoint != GENERATE and body.get("stream") is True:
        options = body.get("stream_options")
        if options is None or isinstance(options, dict):
            body = body | {"stream_options": (options or {}) | {"include_usage": True}}
    return endpoint, body


def _with_seed(endpoint: str, body: dict[str, Any], seed: int) -> dict[str, Any]:
    if endpoint == GENERATE:
        sp = body.get("sampling_params")
        if sp is None:
            return body | {"sampling_params": {"seed": seed}}
        if isinstance(sp, dict) and sp.get("seed") is None:
            return body | {"sampling_params": sp | {"seed": seed}}
        return body
    return body if body.get("seed") is not None else body | {"seed": seed}


def _unredacted(rec: RecordedRequest, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    if not rec.input_ids:  # rejected before tokenization: send it as it was
        return rec.endpoint, body
    if rec.endpoint == GENERATE:
        if body.get("text") is None and body.get("input_ids") is None:
            body = body | {"input_ids": list(rec.input_ids)}
        return GENERATE, body
    out = {k: v for k, v in body.items() if k not in ("prompt", "messages", "suffix")}
    if rec.endpoint == CHAT:
        alias = out.pop("max_completion_tokens", None)
        if alias is not None:
            out["max_tokens"] = alias
        want, top = out.pop("logprobs", None), out.pop("top_logprobs", None)
        if want is True:
            out["logprobs"] = top or 0
    out["prompt"] = list(rec.input_ids)
    return COMPLETIONS, out
