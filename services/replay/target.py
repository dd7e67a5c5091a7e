"""Which mesh a replay starts, and that it never writes where it must not.

Without `--url` or `--mesh-args` the replay starts the mesh the recording names: its header's
`mesh_flags` (`hicache-mesh up`'s own command line, docs/recording.md), less every flag that
would bind or write where the recording mesh did (`WHERE_THE_ORIGINAL_WAS`): its port, its
`--record` file (the input itself: a replay would append to what it reads), the status file,
the NATS and Redis it may have been pointed at, the L3 storage directory (a replay with a
storage backend gets a fresh directory per arm instead), and the masked `--api-key`. Flags
that did not name the model get the header's `model`: `up`'s default model may have changed
since.

Whatever the flags' origin, a replay never writes to its input: a `--record` or
`--status-file` of a mesh, or a `--report` or `--plot`, naming the input file is refused
before anything starts.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from services.replay.recording import Recording

# `hicache-mesh up` option dest -> why a replay does not take it from the recording
WHERE_THE_ORIGINAL_WAS: dict[str, str] = {
    "port": "the recording mesh's port (the replay takes a free one)",
    "record": "the recording mesh's record file (a replay never appends to its input)",
    "record_redact": "a --record setting",
    "record_token_ids": "a --record setting",
    "record_max_bytes": "a --record setting",
    "record_backups": "a --record setting",
    "tenant_keys": "a replay sends no keys",
    "status_file": "the recording mesh's status file",
    "nats_url": "the recording mesh's NATS (the replay starts its own)",
    "redis_url": "the recording mesh's Redis (the replay starts its own)",
    "hicache_storage_dir": "the recording mesh's L3 store (each arm gets a fresh one)",
    "api_key": "its value is masked in the recording",
}


@dataclass(frozen=True, slots=True)
class RecordedFlags:
    """The recording mesh's flags as the replay uses them, and what it left out."""

    kept: tuple[str, ...]
    dropped: tuple[str, ...]  # the flags left out, with their values
    storage: bool  # the mesh has an L3 backend: each arm needs a storage directory of its own

    def describe(self) -> str:
        gone = f" (left out: {' '.join(self.dropped)})" if self.dropped else ""
        return f"`hicache-mesh up {' '.join(self.kept)}`{gone}"


def _up_parser() -> argparse.ArgumentParser:
    from services.launch.up import add_up_args

    parser = argparse.ArgumentParser(prog="hicache-mesh up", add_help=False, exit_on_error=False)
    add_up_args(parser)
    return parser


def _action(parser: argparse.ArgumentParser, option: str) -> argparse.Action | None:
    """The action `option` names, as argparse resolves it (exact, else a unique prefix)."""
    actions = parser._option_string_actions
    if option in actions:
        return actions[option]
    found = {id(a): a for name, a in actions.items() if name.startswith(option)}
    return next(iter(found.values())) if len(found) == 1 else None


def split_flags(
    flags: Sequence[str], drop: Iterable[str]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(`flags` without the options whose dest is in `drop`, the options taken out), each
    option with its value (`--port 8000` and `--port=8000` alike)."""
    parser, drop = _up_parser(), set(drop)
    kept: list[str] = []
    dropped: list[str] = []
    i = 0
    while i < len(flags):
        flag = flags[i]
        name, eq, _ = flag.partition("=")
        action = _action(parser, name) if flag.startswith("-") else None
        takes_value = action is not None and action.nargs != 0 and not eq
        n = 2 if takes_value and i + 1 < len(flags) else 1
        (dropped if action is not None and action.dest in drop else kept).extend(flags[i : i + n])
        i += n
    return tuple(kept), tuple(dropped)


def recorded_flags(recording: Recording) -> RecordedFlags:
    """The flags of the mesh that made `recording` (its first segment), less
    `WHERE_THE_ORIGINAL_WAS`; ValueError when the recording names none."""
    header = recording.headers[0]
    if header.mesh_flags is None:
        raise ValueError(
            f"{recording.path} names no mesh flags (a trace, or a router that ran on its "
            "own, not under `hicache-mesh up`): give --url URL (a running mesh) or "
            '--mesh-args "UP FLAGS"'
        )
    flags = list(header.mesh_flags)
    if flags[:1] == ["up"]:
        flags = flags[1:]
    kept, dropped = split_flags(flags, WHERE_THE_ORIGINAL_WAS)
    if header.model is not None and not split_flags(kept, {"model"})[1]:
        kept += ("--model", header.model)
    try:
        parsed = _up_parser().parse_args(list(kept))
    except (argparse.ArgumentError, SystemExit) as e:
        raise ValueError(
            f"{recording.path}: the recorded mesh flags `{' '.join(kept)}` are not valid "
            f'`hicache-mesh up` flags here ({e}); give --mesh-args "UP FLAGS"'
        ) from None
    return RecordedFlags(kept, dropped, parsed.hicache_storage_backend is not None)


def other_segments_differ(recording: Recording) -> bool:
    """Whether a later segment (a router restart) names other mesh flags than the first."""
    first = recording.headers[0].mesh_flags
    return any(h.mesh_flags != first for h in recording.headers[1:])


def _same_file(a: Path, b: Path) -> bool:
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


def check_writes(input_path: Path, writes: Iterable[tuple[str, str | Path | None]]) -> None:
    """ValueError when one of `writes` ((what, path)) would write to the replay's input."""
    for what, path in writes:
        if path is not None and _same_file(Path(path), input_path):
            raise ValueError(
                f"{what} {path} is the replay's input: the replay would write to the file it "
                "reads (a mesh's --record appends to it). Write elsewhere, or leave the flag out"
            )
