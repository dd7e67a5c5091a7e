"""`hicache-mesh`: the command line of the mesh.

Subcommands:
- `generate`: run the engine offline on one prompt and print the output and the cached-token
  counts per tier (with `--repeat N` the same prompt runs N times, so the cache shows).
- `up`: the whole mesh on loopback (nats, redis, index, engines, router); prints the URL.
- `bench`: the multi-turn generated-shared-prefix benchmark, per arm or against a server.
- `replay FILE`: re-send recorded traffic (`up --record FILE`) to a mesh and compare the
  answers with the recording (and between arms).
- `credentials DIR --engines ID,...`: NATS users with their permissions, Redis ACL users,
  and one 0600 file per identity, for deployments `up` does not start (compose secrets).
- `consensus DIR`: read the rank consensus checker's per-rank logs and report the first
  entry on which the ranks differ.

Only `generate` loads torch (lazily): `up`, `bench` and `replay` start processes and parse
flags.
"""

from __future__ import annotations

import argparse

from services.bench.flags import add_bench_args
from services.engine.cli import add_consensus_args, add_generate_args
from services.launch.credentials import add_credentials_args
from services.launch.up import add_up_args
from services.replay.flags import add_replay_args


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand and its flags; `args.command` names the one chosen
    (`services/cli.py` runs it). `bench` and `replay` parse an arm's `up` flags with it."""
    parser = argparse.ArgumentParser(
        prog="hicache-mesh",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="run the engine offline on one prompt")
    add_generate_args(gen)
    up = sub.add_parser("up", help="run the mesh on loopback: nats, redis, index, engines, router")
    add_up_args(up)
    bench = sub.add_parser("bench", help="multi-turn benchmark: TTFT, ITL, cache hits per arm")
    add_bench_args(bench)
    replay = sub.add_parser(
        "replay", help="re-send recorded traffic to a mesh and compare with the recording"
    )
    add_replay_args(replay)
    cred = sub.add_parser(
        "credentials",
        help="write NATS/Redis credentials and server configs for a deployment (0600 files)",
    )
    add_credentials_args(cred)
    cons = sub.add_parser(
        "consensus",
        help="report the first divergence in the rank consensus checker's per-rank logs",
    )
    add_consensus_args(cons)
    return parser
