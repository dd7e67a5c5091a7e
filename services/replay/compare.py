"""One request's answer against its reference: the recording, or another arm's answer.

What counts:
- the status, always: a rejected request must be rejected again with the same status;
- the outputs of a request that replays exactly: greedy (every choice's temperature below
  `GREEDY_BELOW`, the router's threshold, or absent) or seeded (the record has a `seed`).
  Token ids are compared per choice (the router returns `token_ids` in every choice, chat
  included), then the finish reason, then the text where both sides have one (a redacted
  record has none); the first difference is reported;
- the cached tokens per tier: reported separately (`Verdict.cache`), since a fresh mesh
  does not start with the recording mesh's cache; `--strict-cache` makes them count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.replay.observation import CachedTokens, Observation
from services.replay.recording import RecordedRequest

OUTPUT_FIELDS = frozenset({"stop"})  # redacted fields without which outputs may differ
GREEDY_BELOW = 1e-5  # a temperature below this samples greedily (router/protocol.py)
END = "<end>"  # the token shown where one output ended before the other


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The first difference in one request's answer."""

    line: int  # of the record in the input file
    endpoint: str
    arrival_s: float  # recorded arrival after the first request
    what: str  # "status" | "error" | "choices" | "tokens" | "finish_reason" | "text" | "cached"
    expected: str  # the reference's value (the token, status, ...)
    got: str
    choice: int | None = None
    position: int | None = None  # 0-based index of the first differing output token

    def describe(self, reference: str = "recorded", answer: str = "replayed") -> str:
        where = f"line {self.line} {self.endpoint}"
        if self.choice is not None:
            where += f" choice {self.choice}"
        what = {
            "tokens": f"output token {self.position} (0-based) differs",
            "status": "status differs",
            "error": "error differs",
            "choices": "number of choices differs",
            "finish_reason": "finish reason differs",
            "text": "text differs (same token ids)",
            "cached": "cached tokens differ",
        }[self.what]
        return f"{where}: {what}: {reference} {self.expected}, {answer} {self.got}"


@dataclass(frozen=True, slots=True)
class Verdict:
    """One request checked against its reference."""

    line: int
    endpoint: str
    arrival_s: float
    outputs_compared: bool  # greedy or seeded, and the reference has outputs
    mismatch: Mismatch | None  # status or outputs
    cache: Mismatch | None  # cached tokens per tier differ

    def failed(self, strict_cache: bool) -> Mismatch | None:
        return self.mismatch or (self.cache if strict_cache else None)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where `a` and `b` differ (the shorter's length when one is a prefix
    of the other); None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _sampling_params(body: Any, endpoint: str) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        return {}
    if endpoint == "/generate":
        sp = body.get("sampling_params")
        return sp if isinstance(sp, Mapping) else {}
    return body


def replays_exactly(rec: RecordedRequest) -> bool:
    """Whether `rec`'s outputs must come back token for token: greedy or seeded, and no
    field that changes the output was redacted (`stop` strings)."""
    if any(f.rsplit(".", 1)[-1] in OUTPUT_FIELDS for f in rec.redacted_fields):
        return False
    if rec.seed is not None:
        return True
    if rec.sampling:
        temps = [s.get("temperature") for s in rec.sampling]
    else:
        temps = [_sampling_params(rec.body, rec.endpoint).get("temperature")]
    return all(t is None or (isinstance(t, int | float) and t < GREEDY_BELOW) for t in temps)


def _tiers(c: CachedTokens) -> str:
    return f"(device {c.device}, host {c.host}, storage {c.storage})"


def check(
    rec: RecordedRequest,
    arrival_s: float,
    got: Observation,
    reference: Observation | None = None,
) -> Verdict:
    """`got` against `reference` (default: the recording's answer to `rec`)."""
    ref = rec.reference if reference is None else reference
    if ref is None:  # nothing to compare with (a trace without answers)
        return Verdict(rec.line, rec.endpoint, arrival_s, False, None, None)
    outputs = replays_exactly(rec) and ref.status == 200
    d = _difference(ref, got, outputs)
    mismatch = None
    if d is not None:
        mismatch = Mismatch(
            rec.line,
            rec.endpoint,
            arrival_s,
            d.what,
            d.expected,
            d.got,
            choice=d.choice,
            position=d.position,
        )
    cache = None
    if ref.cached is not None and got.cached is not None and ref.cached != got.cached:
        cache = Mismatch(
            rec.line, rec.endpoint, arrival_s, "cached", _tiers(ref.cached), _tiers(got.cached)
        )
    return Verdict(rec.line, rec.endpoint, arrival_s, outputs, mismatch, cache)


@dataclass(frozen=True, slots=True)
class _Difference:
    """What differs first between two answers (a `Mismatch` adds which request)."""

    what: str  # as `Mismatch.what`
    expected: str  # the reference's value
    got: str  # the answer's value
    choice: int | None = None  # the choice it is in, when it is in one
    position: int | None = None  # "tokens": 0-based index of the first differing token


def _difference(ref: Observation, got: Observation, outputs: bool) -> _Difference | None:
    if ref.status != got.status:
        return _Difference("status", str(ref.status), _status(got))
    if not outputs:
        return None
    if (ref.error is None) != (got.error is None):
        return _Difference("error", repr(ref.error), repr(got.error))
    if len(ref.choices) != len(got.choices):
        return _Difference("choices", str(len(ref.choices)), str(len(got.choices)))
    for i, (a, b) in enumerate(zip(ref.choices, got.choices, strict=True)):
        pos = first_difference(a.output_ids, b.output_ids)
        if pos is not None:
            expected, answered = _token(a.output_ids, pos), _token(b.output_ids, pos)
            return _Difference("tokens", expected, answered, choice=i, position=pos)
        if a.finish_reason != b.finish_reason:
            return _Difference(
                "finish_reason", repr(a.finish_reason), repr(b.finish_reason), choice=i
            )
        if a.text is not None and b.text is not None and a.text != b.text:
            return _Difference("text", repr(a.text[:80]), repr(b.text[:80]), choice=i)
    return None


def _token(ids: Sequence[int], pos: int) -> str:
    return str(ids[pos]) if pos < len(ids) else END


def _status(got: Observation) -> str:
    return str(got.status) if got.status else f"no answer ({got.error})"
