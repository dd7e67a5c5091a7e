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
import sys
from pathlib import Path

from services.bench.cli import add_bench_args, run_bench
from services.engine.flags import add_engine_args
from services.launch.credentials import add_credentials_args, run_credentials
from services.launch.up import add_up_args, run_up
from services.replay.cli import add_replay_args, run_replay


def _generate(args: argparse.Namespace) -> int:
    from gpu_worker.engine.engine import InvalidRequestError, sampling_from
    from gpu_worker.engine.rank import launch_engine
    from services.engine.config import engine_config_from_args

    engine, ranks = launch_engine(engine_config_from_args(args))
    try:
        if args.input_ids is not None:
            ids = [int(t) for t in args.input_ids.split(",") if t.strip()]
        else:
            ids = engine.tokenizer.encode(args.prompt)
        sampling = sampling_from(args.max_tokens, args.temperature, args.top_p, args.seed)
        for turn in range(args.repeat):
            if turn and args.flush_device:  # backups done first: evicted pages stay on host
                engine.evict_device(engine.cache.tree.num_device_pages)
            out = engine.generate(ids, sampling)
            text = engine.tokenizer.decode(out.output_ids)
            print(
                f"[run {turn + 1}] prompt_tokens={out.prompt_len} "
                f"cached_tokens={out.cached.total} (device={out.cached.device}, "
                f"host={out.cached.host}) finish={out.finish_reason}"
            )
            print(f"  output_ids={out.output_ids}")
            print(f"  text={text!r}")
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        engine.close()
        if ranks is not None:
            ranks.wait()
    return 0


def _consensus(args: argparse.Namespace) -> int:
    from gpu_worker.consensus.records import report_dir

    text, diverged = report_dir(args.log_dir)
    print(text)
    return 1 if diverged else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hicache-mesh",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="run the engine offline on one prompt")
    add_engine_args(gen)
    src = gen.add_mutually_exclusive_group()
    src.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog.")
    src.add_argument("--input-ids", default=None, help="comma-separated token ids")
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--repeat", type=int, default=1, help="run the same prompt N times")
    gen.add_argument(
        "--flush-device",
        action="store_true",
        help="between repeats, evict the device cache so hits come from the host",
    )
    gen.set_defaults(func=_generate)
    up = sub.add_parser("up", help="run the mesh on loopback: nats, redis, index, engines, router")
    add_up_args(up)
    up.set_defaults(func=run_up)
    bench = sub.add_parser("bench", help="multi-turn benchmark: TTFT, ITL, cache hits per arm")
    add_bench_args(bench)
    bench.set_defaults(func=run_bench)
    replay = sub.add_parser(
        "replay", help="re-send recorded traffic to a mesh and compare with the recording"
    )
    add_replay_args(replay)
    replay.set_defaults(func=run_replay)
    cred = sub.add_parser(
        "credentials",
        help="write NATS/Redis credentials and server configs for a deployment (0600 files)",
    )
    add_credentials_args(cred)
    cred.set_defaults(func=run_credentials)
    cons = sub.add_parser(
        "consensus",
        help="report the first divergence in the rank consensus checker's per-rank logs",
    )
    cons.add_argument(
        "log_dir", type=Path, help="the HICACHE_RANK_CONSENSUS_DIR of a run (rank*.jsonl)"
    )
    cons.set_defaults(func=_consensus)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.command_line = list(sys.argv[1:] if argv is None else argv)  # a record header's
    try:
        return int(args.func(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
