"""Typed reads of a request body's JSON values; every error is a 400 naming the parameter.

A JSON list of token ids becomes a `TokenIds` (array('I')) in `parse_token_ids`, once, and
stays compact to the bus. Its checks are vectorised (a 32K-token prompt must cost well under
a millisecond): the array conversion rejects negatives, non-integers and ids >= 2**32 in C,
bools are looked for in C among the ids that converted to 0 or 1 (`_has_bool`), the
vocabulary bound is one `max()` (`protocol.check_limits`); the per-element loop runs only to
name the first bad id in the error.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import numpy as np
import orjson

from bus_schemas.token_ids import TokenIds
from router.chat import ROLES, ChatMessage
from router.errors import bad_request

MAX_SALT_LEN = 1024
MAX_STOP_LEN = 1024
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024


def parse_messages(value: Any) -> list[ChatMessage]:
    if value is None:
        raise bad_request("'messages' is required", "messages", "missing_required")
    if not isinstance(value, list):
        raise bad_request("'messages' must be a list", "messages", "invalid_type")
    if not value:
        raise bad_request("'messages' must not be empty", "messages", "empty")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(value)]


def _message(m: Any, param: str) -> ChatMessage:
    if not isinstance(m, dict):
        raise bad_request(f"{param} must be an object", param, "invalid_type")
    role = m.get("role")
    if role not in ROLES:
        raise bad_request(f"{param}.role must be one of {list(ROLES)}", f"{param}.role")
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text parts
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise bad_request("only text content parts are supported", f"{param}.content")
            if not isinstance(part.get("text"), str):
                raise bad_request("a text part needs a string 'text'", f"{param}.content[{j}]")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise bad_request(f"{param}.content must be a string", f"{param}.content", "invalid_type")
    return ChatMessage(role, content)


def parse_token_ids(value: Any, param: str, empty_ok: bool = False) -> tuple[TokenIds, int | None]:
    """A JSON list of token ids as array('I'), and its max (None when empty)."""
    if not isinstance(value, list):
        raise bad_request(f"'{param}' must be a list of token ids", param, "invalid_type")
    if not value and not empty_ok:
        raise bad_request(f"'{param}' must not be empty", param, "empty")
    try:
        ids = array("I", value)  # in C: OverflowError below 0 or from 2**32, TypeError
    except (OverflowError, TypeError):
        _raise_bad_id(value, param)
    if not ids:
        return ids, None
    view = np.frombuffer(ids, dtype=np.uint32)  # no copy; max() in C (Python's: 0.3 ms at 32K)
    if _has_bool(value, view):
        _raise_bad_id(value, param)
    return ids, int(view.max())


def _has_bool(values: list[Any], converted: np.ndarray) -> bool:
    """True when a JSON-decoded list of ints holds a bool. A JSON true/false converted to 1/0,
    so only the positions holding 0 or 1 are looked at, their types gathered in C (a small
    vocabulary has ids 0 and 1 in ~1% of positions: 250 at 32K tokens, 16 us). When they are
    many (a prompt of zeros), one pass over the whole list in C is cheaper: orjson writes ints
    as digits and bools as `true`/`false`."""
    suspects = np.flatnonzero(converted <= 1).tolist()
    if len(suspects) <= len(values) // 8:
        return bool in set(map(type, map(values.__getitem__, suspects)))
    dumped = orjson.dumps(values)
    return b"true" in dumped or b"false" in dumped


def _raise_bad_id(values: Sequence[Any], param: str) -> NoReturn:
    """Name the first id that is not an integer in [0, 2**32) (the slow path, errors only)."""
    for i, t in enumerate(values):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise bad_request(
                f"{param}[{i}] is {t!r}: token ids must be integers >= 0", param, "invalid_token_id"
            )
        if t >= 2**32:
            raise bad_request(
                f"{param}[{i}] is {t}: token ids must be integers in [0, 2**32)",
                param,
                "invalid_token_id",
            )
    raise AssertionError(f"no bad id in {param}")  # only called after a failed conversion


def nonempty(ids: TokenIds, param: str) -> TokenIds:
    if not ids:
        raise bad_request(f"'{param}' must not be empty", param, "empty")
    return ids


class Fields:
    """Typed reads of optional fields; `null` is "not given". Param names carry `prefix`."""

    def __init__(self, body: Mapping[str, Any], prefix: str = "") -> None:
        self.body = body
        self.prefix = prefix

    def int_(self, name: str, lo: int, hi: int | None) -> int | None:
        v = self.body.get(name)
        if v is None:
            return None
        param = self.prefix + name
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad_request(f"'{param}' must be an integer", param, "invalid_type")
        if v < lo or (hi is not None and v > hi):
            bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise bad_request(f"'{param}' must be {bound}, got {v}", param)
        return v

    def float_(self, name: str) -> float | None:
        v = self.body.get(name)
        if v is None:
            return None
        param = self.prefix + name
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise bad_request(f"'{param}' must be a number", param, "invalid_type")
        if not math.isfinite(v):
            raise bad_request(f"'{param}' must be finite", param)
        return float(v)

    def temperature(self) -> float:
        v = self.float_("temperature")
        if v is not None and v < 0:
            param = self.prefix + "temperature"
            raise bad_request(f"'{param}' must be >= 0, got {v}", param)
        return 0.0 if v is None else v

    def top_p(self) -> float:
        v = self.float_("top_p")
        if v is not None and not 0 < v <= 1:
            param = self.prefix + "top_p"
            raise bad_request(f"'{param}' must be in (0, 1], got {v}", param)
        return 1.0 if v is None else v

    def ranged(self, name: str, default: float, lo: float, hi: float) -> float:
        v = self.float_(name)
        if v is None:
            return default
        if not lo <= v <= hi:
            param = self.prefix + name
            raise bad_request(f"'{param}' must be in [{lo:g}, {hi:g}], got {v}", param)
        return v

    def positive(self, name: str, default: float) -> float:
        v = self.float_(name)
        if v is None:
            return default
        if v <= 0:
            param = self.prefix + name
            raise bad_request(f"'{param}' must be > 0, got {v}", param)
        return v

    def logit_bias(self) -> tuple[tuple[int, float], ...]:
        """`{"token id": bias}` as (id, bias) pairs, ids ascending."""
        v = self.body.get("logit_bias")
        param = self.prefix + "logit_bias"
        if v is None:
            return ()
        if not isinstance(v, dict):
            raise bad_request(f"'{param}' must be an object", param, "invalid_type")
        if len(v) > MAX_LOGIT_BIAS_ENTRIES:
            raise bad_request(f"'{param}' allows at most {MAX_LOGIT_BIAS_ENTRIES} entries", param)
        out = []
        for key, bias in v.items():
            if not (key.isascii() and key.isdigit()) or len(key) > 10:
                raise bad_request(f"'{param}' keys must be token ids, got {key!r}", param)
            if isinstance(bias, bool) or not isinstance(bias, int | float):
                raise bad_request(f"'{param}' values must be numbers", param, "invalid_type")
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise bad_request(f"'{param}' values must be in [-100, 100], got {bias}", param)
            out.append((int(key), float(bias)))
        return tuple(sorted(out))

    def bool_(self, name: str, default: bool) -> bool:
        v = self.body.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            param = self.prefix + name
            raise bad_request(f"'{param}' must be a boolean", param, "invalid_type")
        return v

    def str_(self, name: str) -> str | None:
        v = self.body.get(name)
        if v is not None and not isinstance(v, str):
            param = self.prefix + name
            raise bad_request(f"'{param}' must be a string", param, "invalid_type")
        return v

    def salt(self, name: str) -> str:
        v = self.str_(name) or ""
        if len(v) > MAX_SALT_LEN:
            param = self.prefix + name
            raise bad_request(f"'{param}' is longer than {MAX_SALT_LEN} characters", param)
        return v

    def stop(self, max_stop: int) -> tuple[str, ...]:
        v = self.body.get("stop")
        param = self.prefix + "stop"
        if v is None:
            return ()
        stops = [v] if isinstance(v, str) else v
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad_request(
                f"'{param}' must be a string or a list of strings", param, "invalid_type"
            )
        if len(stops) > max_stop:
            raise bad_request(f"'{param}' allows at most {max_stop} strings", param)
        if any(not s or len(s) > MAX_STOP_LEN for s in stops):
            raise bad_request(f"stop strings must have 1 to {MAX_STOP_LEN} characters", param)
        return tuple(stops)
