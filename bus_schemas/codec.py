"""Typed, versioned JSON messages: orjson on the wire, strict validation on decode.

A message is a frozen dataclass deriving from `Message`. `encode()` writes its fields plus
`"type"` and `"v"`; `decode()` rejects an unknown type or version, a missing or unknown
field, or a value of the wrong type with `SchemaError` (never a crash in the consumer).
Field types allowed: int, float, str, bool, None, `X | None`, `list[X]`, `dict[str, X]`,
nested `Message` subclasses, and `TokenIds` (array('I')), which travels as one base64 string of
its uint32 little-endian bytes: 4 bytes per id before base64 instead of a JSON list, encoded
and decoded in C, strictly (bad base64 or a length not a multiple of 4 is a SchemaError).
"""

from __future__ import annotations

import binascii
import dataclasses
import types
import typing
from array import array
from typing import Any, ClassVar, TypeVar, Union, get_args, get_origin, get_type_hints

import orjson

from bus_schemas.token_ids import TYPECODE, TokenIds, as_token_ids

M = TypeVar("M", bound="Message")


class SchemaError(ValueError):
    """A message that does not match its schema."""


class Message:
    """Base of every bus message. Subclasses are `@dataclass(frozen=True, slots=True)`."""

    TYPE: ClassVar[str]
    VERSION: ClassVar[int] = 1

    def to_dict(self) -> dict[str, Any]:
        return {name: _to_plain(getattr(self, name)) for name in _field_names(type(self))}

    def encode(self) -> bytes:
        body = self.to_dict()
        body["type"] = self.TYPE
        body["v"] = self.VERSION
        return orjson.dumps(body)

    @classmethod
    def decode(cls: type[M], data: bytes | str) -> M:
        try:
            body = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            raise SchemaError(f"{cls.TYPE}: not JSON: {e}") from None
        if not isinstance(body, dict):
            raise SchemaError(f"{cls.TYPE}: expected a JSON object")
        if body.get("type") != cls.TYPE:
            raise SchemaError(f"expected message type {cls.TYPE!r}, got {body.get('type')!r}")
        version = body.get("v")
        if type(version) is not int or version != cls.VERSION:  # true and 1.0 are not 1
            raise SchemaError(
                f"{cls.TYPE}: unsupported schema version {version!r} "
                f"(this build speaks {cls.VERSION})"
            )
        fields = {k: v for k, v in body.items() if k not in ("type", "v")}
        return cls.from_dict(fields)

    @classmethod
    def from_dict(cls: type[M], body: dict[str, Any], where: str = "") -> M:
        where = where or cls.TYPE
        hints = _hints(cls)
        unknown = body.keys() - _field_names(cls)
        if unknown:
            raise SchemaError(f"{where}: unknown field(s) {sorted(unknown)}")
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name in body:
                kwargs[f.name] = _check(body[f.name], hints[f.name], f"{where}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SchemaError(f"{where}: missing field {f.name!r}")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise SchemaError(f"{where}: {e}") from None


_HINTS: dict[type, dict[str, Any]] = {}
_NAMES: dict[type, tuple[str, ...]] = {}
_SCALARS = (int, float, str, bool, type(None))


def _field_names(cls: type) -> tuple[str, ...]:
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = get_type_hints(cls)
    return _HINTS[cls]


def _to_plain(value: Any) -> Any:
    if isinstance(value, array):
        return binascii.b2a_base64(as_token_ids(value).tobytes(), newline=False).decode("ascii")
    if isinstance(value, Message):
        return value.to_dict()
    if isinstance(value, list | tuple):
        if all(isinstance(v, _SCALARS) for v in value):  # token ids: the common, long case
            return list(value)
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


def _check(value: Any, hint: Any, where: str) -> Any:
    """Return `value` converted to `hint` (lists stay lists), or raise SchemaError."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        errors = []
        for option in get_args(hint):
            try:
                return _check(value, option, where)
            except SchemaError as e:
                errors.append(str(e))
        raise SchemaError(f"{where}: {value!r} matches none of {hint}")
    if hint is type(None):
        if value is not None:
            raise SchemaError(f"{where}: expected null")
        return None
    if hint is bool:
        if not isinstance(value, bool):
            raise SchemaError(f"{where}: expected a boolean, got {type(value).__name__}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SchemaError(f"{where}: expected an integer, got {type(value).__name__}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SchemaError(f"{where}: expected a number, got {type(value).__name__}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise SchemaError(f"{where}: expected a string, got {type(value).__name__}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise SchemaError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = get_args(hint)[:1]
        if item is int and all(type(v) is int for v in value):  # token ids: one pass in C
            return tuple(value) if origin is tuple else value
        checked = [_check(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(checked) if origin is tuple else checked
    if origin is dict:
        if not isinstance(value, dict):
            raise SchemaError(f"{where}: expected an object, got {type(value).__name__}")
        _, item = get_args(hint)
        return {str(k): _check(v, item, f"{where}.{k}") for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, Message):
        if not isinstance(value, dict):
            raise SchemaError(f"{where}: expected an object, got {type(value).__name__}")
        return hint.from_dict(value, where)
    if hint is TokenIds:
        return _token_ids(value, where)
    if hint is typing.Any:
        return value
    raise SchemaError(f"{where}: unsupported schema type {hint}")


def _token_ids(value: Any, where: str) -> array:
    """A base64 string of uint32 little-endian bytes -> array('I')."""
    if not isinstance(value, str):
        raise SchemaError(f"{where}: expected base64 token ids, got {type(value).__name__}")
    try:
        raw = binascii.a2b_base64(value, strict_mode=True)
    except (binascii.Error, ValueError) as e:
        raise SchemaError(f"{where}: bad base64 token ids: {e}") from None
    if len(raw) % 4:
        raise SchemaError(f"{where}: token id bytes must be a multiple of 4, got {len(raw)}")
    out = array(TYPECODE)
    out.frombytes(raw)
    return out
