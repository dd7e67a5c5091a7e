"""`hicache-mesh up --bucket NAME[:key=value,...]` (repeatable) or `--buckets-file FILE.toml`:
the engine buckets to start, each with its own parallel layout.

Keys: `tp`, `pp` and `cp` (the bucket's engines' --tp-size/--pp-size/--cp-size; default:
the shared flags), `max_len` (prompt + max_tokens it serves: the router sends a request to
the smallest bucket that fits; one bucket may leave it out and serve any length) and
`engines` (how many; default: --engines). The TOML file holds the same as `[[bucket]]` tables:

    [[bucket]]
    name = "short"
    tp = 1
    max_len = 4096

    [[bucket]]
    name = "long"
    tp = 2
    pp = 2
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KEYS = ("tp", "pp", "cp", "max_len", "engines")


@dataclass(frozen=True, slots=True)
class LaunchBucket:
    name: str
    tp: int | None = None  # None: the shared --tp-size
    pp: int | None = None
    cp: int | None = None
    max_len: int | None = None  # None: any length
    engines: int | None = None  # None: the shared --engines

    def router_spec(self) -> str:
        """The router's `--bucket` value for it."""
        return self.name if self.max_len is None else f"{self.name}:max_len={self.max_len}"


def _bucket(name: Any, fields: dict[str, Any], where: str) -> LaunchBucket:
    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "-_" for c in name):
        raise ValueError(f"{where}: a bucket name is letters, digits, '-' or '_', got {name!r}")
    unknown = sorted(set(fields) - set(KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {list(KEYS)}")
    values: dict[str, int] = {}
    for key, value in fields.items():
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{where}: {key} must be a positive integer, got {value!r}")
        values[key] = value
    return LaunchBucket(name, **values)


def parse_bucket(spec: str) -> LaunchBucket:
    """`NAME[:key=value,...]`."""
    name, _, rest = spec.partition(":")
    fields: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--bucket {spec!r}: {item!r} is not key=value")
        fields[key] = value
    return _bucket(name, fields, f"--bucket {spec!r}")


def load_buckets(path: Path) -> list[LaunchBucket]:
    """The `[[bucket]]` tables of a TOML file."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"--buckets-file {path}: {e}") from None
    tables = data.get("bucket")
    if not isinstance(tables, list) or not tables:
        raise ValueError(f"--buckets-file {path}: no [[bucket]] tables")
    out = []
    for i, table in enumerate(tables):
        fields = dict(table)
        out.append(_bucket(fields.pop("name", None), fields, f"{path} bucket {i + 1}"))
    return out


def check(buckets: list[LaunchBucket]) -> None:
    names = [b.name for b in buckets]
    if len(set(names)) != len(names):
        raise ValueError(f"bucket names must be unique, got {names}")
    if sum(b.max_len is None for b in buckets) > 1:
        raise ValueError("at most one bucket may leave out max_len (it serves any length)")
