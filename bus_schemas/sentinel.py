"""Finding the Redis/Valkey primary through Sentinel: the flags the index and the router share,
and the marker that says the index is in step with the primary it writes to.

Flags: `--redis-sentinel HOST:PORT[,HOST:PORT...]` (may be repeated) lists the sentinels,
`--redis-sentinel-master NAME` names the monitored primary (default `hicache`), and
`--redis-sentinel-credentials FILE` the `user:password` the sentinels require (their
`requirepass`: user `default`). With sentinels, `--redis-url` gives only what Sentinel does
not: the scheme (`redis://` or `rediss://`), the credentials and the db, as `redis:///0`; a URL
that names a host or port contradicts the sentinels and is refused.

The marker (`INDEX_SYNCED`): after a failover the new primary holds what its replica had
received, which may lack the index's last writes (a removal among them: a page the primary
lists for an engine that no longer holds it). The index therefore writes, once every engine's
entries were rebuilt from its snapshot on a primary, that primary's `run_id` under
`INDEX_SYNCED`. A replica copies the key but has a run id of its own, so on a promoted
replica (or a restarted server, or a Redis the index has not resynced yet) the marker and
`INFO server`'s run id differ, and the router routes by load instead of trusting the index.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from urllib.parse import urlsplit

DEFAULT_MASTER = "hicache"
INDEX_SYNCED = "hc:index:synced"  # STRING: run id of the primary the index last resynced on

Address = tuple[str, int]


def parse_sentinels(values: Iterable[str] | None) -> tuple[Address, ...]:
    """`HOST:PORT[,HOST:PORT...]` items (the flag may be repeated) as (host, port) pairs.
    ValueError names a malformed one."""
    out: list[Address] = []
    for value in values or ():
        for item in value.split(","):
            item = item.strip()
            host, sep, port = item.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--redis-sentinel expects HOST:PORT, got {item!r}")
            out.append((host.strip("[]"), int(port)))
    if len(set(out)) != len(out):
        raise ValueError(f"--redis-sentinel lists a sentinel twice: {values}")
    return tuple(out)


def sentinel_redis_url(url: str | None, sentinels: Sequence[Address]) -> str:
    """The Redis URL to use beside `sentinels`: `url` (default `redis:///0`) when it names no
    host or port (Sentinel gives the primary's address); ValueError when it does."""
    if not sentinels:
        raise ValueError("no sentinels given")
    if url is None:
        return "redis:///0"
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(
            f"--redis-url with --redis-sentinel must be redis:// or rediss://, got {url!r}"
        )
    if parts.hostname or parts.port:
        raise ValueError(
            f"--redis-url {url!r} names a server, but with --redis-sentinel the primary comes "
            "from Sentinel: give only scheme, credentials and db (e.g. redis:///0), or no "
            "--redis-url"
        )
    return url


def add_sentinel_args(parser: argparse.ArgumentParser) -> None:
    """The Sentinel flags of every Redis client (index, router)."""
    parser.add_argument(
        "--redis-sentinel",
        action="append",
        default=None,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="find the Redis primary through these sentinels and follow its failovers (may "
        "be repeated); --redis-url then gives only scheme, credentials and db (redis:///0)",
    )
    parser.add_argument(
        "--redis-sentinel-master",
        default=DEFAULT_MASTER,
        metavar="NAME",
        help="the primary's name in the sentinels' configuration",
    )
    parser.add_argument(
        "--redis-sentinel-credentials",
        default=None,
        metavar="FILE",
        help="the sentinels' `user:password` (a 0600 file), where they require one",
    )


def same_server(marker: str | None, run_id: str) -> bool:
    """Whether the index resynced on the server whose `INFO server` run id is `run_id`."""
    return bool(marker) and marker == run_id
