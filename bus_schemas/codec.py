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
import functools
import types
import typing
from array import array
from collections.abc import Callable
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
    # Fields left out of the encoding while they hold their default: fields added to a
    # message without a version bump, so that a consumer of the older schema (which refuses
    # unknown fields) still reads every message that does not use them, and a new consumer
    # reads an old message (the field is optional). Each must have a plain default.
    OMIT_DEFAULTS: ClassVar[frozenset[str]] = frozenset()

    def to_dict(self) -> dict[str, Any]:
        out = {}
        plan = _plan(type(self))
        for name, convert in plan.encode:
            value = getattr(self, name)
            out[name] = _to_plain(value) if convert else value
        for name, default in plan.omit:
            if out[name] == default:
                del out[name]
        return out

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
        kind = body.pop("type", None)
        if kind != cls.TYPE:
            raise SchemaError(f"expected message type {cls.TYPE!r}, got {kind!r}")
        version = body.pop("v", None)
        if type(version) is not int or version != cls.VERSION:  # true and 1.0 are not 1
            raise SchemaError(
                f"{cls.TYPE}: unsupported schema version {version!r} "
                f"(this build speaks {cls.VERSION})"
            )
        return cls.from_dict(body)

    @classmethod
    def from_dict(cls: type[M], body: dict[str, Any], where: str = "") -> M:
        where = where or cls.TYPE
        plan = _plan(cls)
        if not body.keys() <= plan.names:
            raise SchemaError(f"{where}: unknown field(s) {sorted(body.keys() - plan.names)}")
        kwargs: dict[str, Any] = {}
        for name, exact, check, required in plan.decode:
            if name in body:
                value = body[name]
                # a value of the field's own scalar type passes as it is (the common case)
                kwargs[name] = value if type(value) is exact else check(value, f"{where}.{name}")
            elif required:
                raise SchemaError(f"{where}: missing field {name!r}")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise SchemaError(f"{where}: {e}") from None


_SCALARS = (int, float, str, bool, type(None))
Check = Callable[[Any, str], Any]  # (value, where it is) -> the value as its type, or raise


@dataclasses.dataclass(frozen=True, slots=True)
class _Plan:
    """How one message class travels, worked out once from its type hints."""

    names: frozenset[str]
    encode: tuple[tuple[str, bool], ...]  # (field, its value needs `_to_plain`)
    decode: tuple[tuple[str, type | None, Check, bool], ...]  # (field, exact, check, required)
    omit: tuple[tuple[str, Any], ...]  # (field, its default): left out while it holds it


_PLANS: dict[type, _Plan] = {}


def _plan(cls: type) -> _Plan:
    plan = _PLANS.get(cls)
    if plan is None:
        hints = get_type_hints(cls)
        fields = dataclasses.fields(cls)
        scalars = (int, str, bool, float)
        plan = _PLANS[cls] = _Plan(
            names=frozenset(f.name for f in fields),
            encode=tuple((f.name, not _plain_hint(hints[f.name])) for f in fields),
            decode=tuple(
                (
                    f.name,
                    hints[f.name] if hints[f.name] in scalars else None,
                    _checker(hints[f.name]),
                    f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                )
                for f in fields
            ),
            omit=_omitted(cls, fields),
        )
    return plan


def _omitted(cls: type, fields: tuple[dataclasses.Field[Any], ...]) -> tuple[tuple[str, Any], ...]:
    """`OMIT_DEFAULTS` of `cls` with each field's default; TypeError for a name that is not a
    field with a plain default (a message class written wrongly, found at its first use)."""
    defaults = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
    wanted: frozenset[str] = getattr(cls, "OMIT_DEFAULTS", frozenset())
    if not wanted <= defaults.keys():
        raise TypeError(f"{cls.__name__}.OMIT_DEFAULTS names fields without a plain default")
    return tuple((name, defaults[name]) for name in sorted(wanted))


def _plain_hint(hint: Any) -> bool:
    """Whether a value of `hint` goes into JSON as it is (a scalar, or an optional one)."""
    if get_origin(hint) in (Union, types.UnionType):
        return all(_plain_hint(option) for option in get_args(hint))
    return hint in _SCALARS


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


@functools.cache
def _checker(hint: Any) -> Check:
    """The check of a value against `hint`: returns the value converted to `hint` (lists stay
    lists), or raises SchemaError naming where the value is."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        nullable = type(None) in get_args(hint)
        options = [_checker(option) for option in get_args(hint) if option is not type(None)]

        def check_union(value: Any, where: str) -> Any:
            if value is None and nullable:
                return None
            for check in options:
                try:
                    return check(value, where)
                except SchemaError:
                    pass
            raise SchemaError(f"{where}: {value!r} matches none of {hint}")

        return check_union
    if origin in (list, tuple):
        (item,) = get_args(hint)[:1]
        check_item = _checker(item)
        as_tuple = origin is tuple

        def check_list(value: Any, where: str) -> Any:
            if not isinstance(value, list):
                raise SchemaError(f"{where}: expected a list, got {type(value).__name__}")
            if item is int and all(type(v) is int for v in value):  # token ids: one pass in C
                return tuple(value) if as_tuple else value
            checked = [check_item(v, f"{where}[{i}]") for i, v in enumerate(value)]
            return tuple(checked) if as_tuple else checked

        return check_list
    if origin is dict:
        _, item = get_args(hint)
        check_value = _checker(item)

        def check_dict(value: Any, where: str) -> Any:
            if not isinstance(value, dict):
                raise SchemaError(f"{where}: expected an object, got {type(value).__name__}")
            return {str(k): check_value(v, f"{where}.{k}") for k, v in value.items()}

        return check_dict
    if isinstance(hint, type) and issubclass(hint, Message):
        message = hint

        def check_message(value: Any, where: str) -> Any:
            if not isinstance(value, dict):
                raise SchemaError(f"{where}: expected an object, got {type(value).__name__}")
            return message.from_dict(value, where)

        return check_message
    if hint is TokenIds:
        return _token_ids
    if hint is typing.Any:
        return lambda value, where: value
    scalar = _SCALAR_CHECKS.get(hint)
    if scalar is None:
        raise TypeError(f"unsupported schema type {hint}")
    return scalar


def _check_none(value: Any, where: str) -> None:
    if value is not None:
        raise SchemaError(f"{where}: expected null")


def _check_bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise SchemaError(f"{where}: expected a boolean, got {type(value).__name__}")
    return value


def _check_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SchemaError(f"{where}: expected an integer, got {type(value).__name__}")
    return value


def _check_float(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SchemaError(f"{where}: expected a number, got {type(value).__name__}")
    return float(value)


def _check_str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise SchemaError(f"{where}: expected a string, got {type(value).__name__}")
    return value


_SCALAR_CHECKS: dict[Any, Check] = {
    type(None): _check_none,
    bool: _check_bool,
    int: _check_int,
    float: _check_float,
    str: _check_str,
}


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
