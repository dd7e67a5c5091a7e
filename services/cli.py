"""`hicache-mesh`: run the subcommand the command line names.

The subcommands and their flags are `services/parser.py`'s (its docstring is `--help`);
each one runs in the module that owns it. This module only dispatches: it imports no
`gpu_worker` (`generate` and `consensus` run in `services/engine/cli.py`, which loads it
lazily).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from services.bench.cli import run_bench
from services.engine.cli import run_consensus, run_generate
from services.launch.credentials import run_credentials
from services.launch.up import run_up
from services.parser import build_parser
from services.replay.cli import run_replay

__all__ = ["COMMANDS", "build_parser", "main"]

# subcommand name (`args.command`) -> what runs it; its exit status
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "generate": run_generate,
    "up": run_up,
    "bench": run_bench,
    "replay": run_replay,
    "credentials": run_credentials,
    "consensus": run_consensus,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.command_line = list(sys.argv[1:] if argv is None else argv)  # a record header's
    try:
        return int(COMMANDS[args.command](args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
