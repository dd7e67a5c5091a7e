"""The router's key, tenant and recording flags that `hicache-mesh up` passes on as given.

Key material never goes on a command line: these flags name files (which the router
reads), never keys. Files are resolved to absolute paths, since the router may run elsewhere.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# (flag, kind, help): kind "file" (a path), "value", "append" (repeatable value) or "switch"
ROUTER_FLAGS: tuple[tuple[str, str, str], ...] = (
    (
        "--admin-api-key-file",
        "file",
        "the router's admin key (then only it opens /flush_cache and /stats) is the one "
        "line of FILE",
    ),
    (
        "--tenant-keys",
        "file",
        "API keys of tenants, one 'KEY TENANT [shared=NS,...]' per line: tenants never "
        "share prefix cache hits (README, 'Keys and tenants')",
    ),
    ("--shared-cache-namespace", "append", "a 'cache_namespace' every tenant may name"),
    (
        "--hide-cache-stats",
        "switch",
        "responses carry no cached-token figures, engine ids or Server-Timing",
    ),
    ("--record-token-ids", "value", "keep, hash or drop the token ids in records"),
    ("--record-max-bytes", "value", "rotate the record file past N bytes (0: never)"),
    ("--record-backups", "value", "rotated record files kept"),
)
CHOICES = {"--record-token-ids": ("keep", "hash", "drop")}


def add_router_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("router keys, tenants and recording")
    for flag, kind, help_text in ROUTER_FLAGS:
        if kind == "switch":
            g.add_argument(flag, action="store_true", help=help_text)
        elif kind == "append":
            g.add_argument(flag, action="append", default=None, metavar="NAME", help=help_text)
        elif kind == "file":
            g.add_argument(flag, default=None, metavar="FILE", help=help_text)
        else:
            g.add_argument(flag, default=None, choices=CHOICES.get(flag), help=help_text)


def router_flags_argv(args: argparse.Namespace) -> list[str]:
    """The router's share of `args`: the flags given, files as absolute paths."""
    argv: list[str] = []
    for flag, kind, _ in ROUTER_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is None or value is False:
            continue
        if kind == "switch":
            argv.append(flag)
        elif kind == "append":
            for v in value:
                argv += [flag, v]
        elif kind == "file":
            argv += [flag, str(Path(value).resolve())]
        else:
            argv += [flag, str(value)]
    return argv
