"""Buckets: named groups of engines, each serving prompts up to a context length.

Production serves short and long contexts with differently parallel engines (DESIGN.md 2):
a request goes to the smallest bucket whose `max_len` fits its prompt plus `max_tokens`
(the last bucket may be unbounded); when that bucket cannot serve (no live engine), the next
larger one that can does. Engines announce their bucket in their heartbeats. A conversation
that grows past the short bucket moves to the long one, whose engines read what the short
one stored when both use the unified storage key scheme on one store.

Router flag: `--bucket NAME[:max_len=N]`, once per bucket (`hicache-mesh up --bucket
short:tp=1,max_len=4096 --bucket long:tp=2,pp=2` passes the names and lengths on).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

DEFAULT = "default"


@dataclass(frozen=True, slots=True)
class Bucket:
    name: str
    max_len: int | None = None  # prompt + max_tokens it serves; None: any

    def fits(self, num_tokens: int) -> bool:
        return self.max_len is None or num_tokens <= self.max_len


def parse_bucket(spec: str) -> Bucket:
    """`NAME` or `NAME:max_len=N` (other `key=value` fields, the launcher's, are ignored).
    Raises ValueError with what is wrong."""
    name, _, rest = spec.partition(":")
    if not name or not all(c.isalnum() or c in "-_" for c in name):
        raise ValueError(f"bucket {spec!r}: the name must be letters, digits, '-' or '_'")
    max_len = None
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"bucket {spec!r}: {item!r} is not key=value")
        if key == "max_len":
            if not value.isdigit() or int(value) <= 0:
                raise ValueError(f"bucket {spec!r}: max_len must be a positive integer")
            max_len = int(value)
    return Bucket(name, max_len)


def order(buckets: Sequence[Bucket]) -> tuple[Bucket, ...]:
    """Smallest first, unbounded last; names unique, at most one unbounded."""
    names = [b.name for b in buckets]
    if len(set(names)) != len(names):
        raise ValueError(f"bucket names must be unique, got {names}")
    if sum(b.max_len is None for b in buckets) > 1:
        raise ValueError("at most one bucket may be unbounded (no max_len)")
    return tuple(sorted(buckets, key=lambda b: (b.max_len is None, b.max_len or 0)))


def select(buckets: Sequence[Bucket], num_tokens: int, can_serve: Callable[[str], bool]) -> str:
    """The smallest bucket fitting `num_tokens` that can serve, else the smallest fitting
    one (its error names it); the largest when none fits (the request is refused there)."""
    fitting = [b.name for b in buckets if b.fits(num_tokens)] or [buckets[-1].name]
    return next((name for name in fitting if can_serve(name)), fitting[0])
