"""Reading a `--record` file (docs/recording.md, format version 1) into a `Recording`.

The file is JSON lines: a header starts each segment (a router restart appends a new one),
request lines belong to the segment above them, `drops` lines count records the router
could not write. Every line is validated; the first bad one raises `RecordFormatError`
naming the file, the line number and what is wrong. A header of another format or version
is refused: this reader knows version 1 only.

Fields replay needs are required (`time`, `endpoint`, `status`, `request`); the rest are
optional, and when present must have the documented type.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import orjson

from services.replay.observation import CachedTokens, ChoiceOutput, Observation

FORMAT = "hicache-mesh-record"
VERSION = 1


class RecordFormatError(ValueError):
    """A line of the file is not valid version-1 record format."""

    def __init__(self, path: str, line: int, message: str) -> None:
        super().__init__(f"{path}:{line}: {message}")
        self.path = path
        self.line = line


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """One segment's header: what the recording mesh was."""

    line: int
    version: int
    redacted: bool  # prompts and texts dropped: replay sends `input_ids`
    model: str | None
    project_version: str | None
    git_revision: str | None
    created: float | None
    mesh_flags: tuple[str, ...] | None  # `hicache-mesh up` flags; None: a router on its own
    # "keep", or "hash"/"drop" (--record-token-ids): then there are no ids to send or compare
    token_ids: str = "keep"


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """One request line, with what the client got then (`reference`)."""

    line: int  # 1-based line number in the file
    segment: int  # index of its header in `Recording.headers`
    time_s: float  # unix seconds at arrival
    endpoint: str  # "/v1/completions", "/v1/chat/completions", "/generate"
    body: Any  # the JSON body as received (None: it was not JSON)
    input_ids: tuple[int, ...]  # the prompt as sent to the engine; () if rejected before
    seed: int | None  # the seed of choice 0 (choice i: seed + i); None: greedy
    sampling: tuple[Mapping[str, Any], ...]  # per choice, the engine's sampling parameters
    redacted: bool
    reference: Observation | None  # None: the input has no answers to compare with
    predicted_cached_tokens: int | None  # what the index promised when the router routed
    engine_id: str | None
    route_reason: str | None
    # request fields a redacted record dropped (`stop` strings change the output)
    redacted_fields: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Drop:
    """`N` records the router's queue could not take, before this line."""

    line: int
    time_s: float
    count: int


@dataclass(frozen=True, slots=True)
class Recording:
    path: str
    headers: tuple[RecordHeader, ...]
    requests: tuple[RecordedRequest, ...]  # in file order (the order they finished)
    drops: tuple[Drop, ...] = ()

    @property
    def num_dropped(self) -> int:
        return sum(d.count for d in self.drops)


def read_recording(path: str | Path) -> Recording:
    """The whole file, validated; raises RecordFormatError at the first bad line and
    OSError when the file cannot be read."""
    with open(path, "rb") as f:
        return parse_lines(str(path), f)


def parse_lines(path: str, lines: Iterable[bytes]) -> Recording:
    headers: list[RecordHeader] = []
    requests: list[RecordedRequest] = []
    drops: list[Drop] = []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise RecordFormatError(path, number, f"not a JSON line ({e})") from None
        f = _Fields(path, number, obj)
        kind = f.string("type")
        if kind == "header":
            headers.append(_header(f))
        elif not headers:
            f.fail(f"a {kind!r} line before the first header: not a version-{VERSION} recording")
        elif kind == "request":
            requests.append(_request(f, len(headers) - 1, headers[-1].redacted))
        elif kind == "drops":
            drops.append(Drop(number, f.number("time"), f.integer("count")))
        else:
            f.fail(f"unknown line type {kind!r} (expected header, request or drops)")
    if not headers:
        raise RecordFormatError(path, 1, "no header line: not a hicache-mesh recording")
    return Recording(path, tuple(headers), tuple(requests), tuple(drops))


def _header(f: _Fields) -> RecordHeader:
    fmt = f.string("format")
    if fmt != FORMAT:
        f.fail(f"format {fmt!r} is not {FORMAT!r}")
    version = f.integer("version")
    if version != VERSION:
        f.fail(
            f"format version {version} is not supported: this replay reads version {VERSION} "
            "(docs/recording.md)"
        )
    flags = f.optional_list("mesh_flags", str)
    created = f.optional_number("created")
    return RecordHeader(
        line=f.line,
        version=version,
        redacted=bool(f.optional_bool("redacted")),
        model=f.optional_string("model"),
        project_version=f.optional_string("project_version"),
        git_revision=f.optional_string("git_revision"),
        created=created,
        mesh_flags=None if flags is None else tuple(flags),
        token_ids=f.optional_string("token_ids") or "keep",
    )


def _request(f: _Fields, segment: int, redacted: bool) -> RecordedRequest:
    if "request" not in f.obj:
        f.fail("missing field 'request'")
    seed = f.optional_integer("seed")
    return RecordedRequest(
        line=f.line,
        segment=segment,
        time_s=f.number("time"),
        endpoint=f.string("endpoint"),
        body=f.obj["request"],
        input_ids=tuple(f.optional_list("input_ids", int) or ()),
        seed=seed,
        sampling=tuple(f.optional_list("sampling", dict) or ()),
        redacted=redacted,
        reference=_reference(f) if _comparable(f) else None,
        predicted_cached_tokens=f.optional_integer("predicted_cached_tokens"),
        engine_id=f.optional_string("engine_id"),
        route_reason=f.optional_string("route_reason"),
        redacted_fields=tuple(f.optional_list("redacted_fields", str) or ()),
    )


def _comparable(f: _Fields) -> bool:
    """False for a refused request whose body is not all there (too large to keep, or
    redacted): sent without what was left out, it may be refused otherwise or served."""
    if "omitted_bytes" in f.obj:
        return False
    return f.obj.get("status") == 200 or not f.obj.get("redacted_fields")


def _reference(f: _Fields) -> Observation:
    choices = []
    for i, c in enumerate(f.optional_list("choices", dict) or ()):
        cf = _Fields(f.path, f.line, c, f"choices[{i}].")
        choices.append(
            ChoiceOutput(
                output_ids=tuple(cf.optional_list("output_ids", int) or ()),
                text=cf.optional_string("text"),
                finish_reason=cf.optional_string("finish_reason"),
            )
        )
    usage = f.optional_object("usage") or {}
    uf = _Fields(f.path, f.line, usage, "usage.")
    tiers = uf.optional_object("cached_tokens")
    return Observation(
        status=f.integer("status"),
        choices=tuple(choices),
        prompt_tokens=uf.optional_integer("prompt_tokens"),
        cached=None if tiers is None else CachedTokens.from_tiers(tiers),
        ttft_s=f.optional_number("ttft_s"),
        itl_s=tuple(f.optional_list("itl_s", float) or ()),
        e2e_s=f.optional_number("e2e_s"),
        error=f.optional_string("error"),
    )


class _Fields:
    """Typed access to one line's fields; every failure names the file, line and field."""

    def __init__(self, path: str, line: int, obj: Any, prefix: str = "") -> None:
        self.path, self.line, self.prefix = path, line, prefix
        if not isinstance(obj, dict):
            self.fail(f"expected a JSON object, got {type(obj).__name__}")
        self.obj: dict[str, Any] = obj

    def fail(self, message: str) -> NoReturn:
        raise RecordFormatError(self.path, self.line, message)

    def _get(self, key: str, types: tuple[type, ...], what: str, optional: bool) -> Any:
        value = self.obj.get(key)
        if value is None:
            if optional:
                return None
            self.fail(f"missing field '{self.prefix}{key}' ({what})")
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            self.fail(f"field '{self.prefix}{key}' must be {what}, got {value!r:.80}")
        return value

    def string(self, key: str) -> str:
        return str(self._get(key, (str,), "a string", False))

    def optional_string(self, key: str) -> str | None:
        value = self._get(key, (str,), "a string", True)
        return None if value is None else str(value)

    def integer(self, key: str) -> int:
        return int(self._get(key, (int,), "an integer", False))

    def optional_integer(self, key: str) -> int | None:
        value = self._get(key, (int,), "an integer", True)
        return None if value is None else int(value)

    def number(self, key: str) -> float:
        return float(self._get(key, (int, float), "a number", False))

    def optional_number(self, key: str) -> float | None:
        value = self._get(key, (int, float), "a number", True)
        return None if value is None else float(value)

    def optional_bool(self, key: str) -> bool | None:
        value = self._get(key, (bool,), "true or false", True)
        return None if value is None else bool(value)

    def optional_object(self, key: str) -> dict[str, Any] | None:
        value = self._get(key, (dict,), "an object", True)
        return None if value is None else dict(value)

    def optional_list(self, key: str, item: type) -> list[Any] | None:
        value = self._get(key, (list,), "a list", True)
        if value is None:
            return None
        allowed: tuple[type, ...] = (int, float) if item is float else (item,)
        for i, v in enumerate(value):
            if isinstance(v, bool) or not isinstance(v, allowed):
                self.fail(f"field '{self.prefix}{key}[{i}]' must be {_NAMES[item]}, got {v!r:.80}")
        return [float(v) for v in value] if item is float else list(value)


_NAMES: Mapping[type, str] = {
    int: "an integer",
    float: "a number",
    str: "a string",
    dict: "an object",
}
