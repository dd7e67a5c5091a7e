"""`hicache-mesh generate` and `hicache-mesh consensus`: the subcommands that reach into
`gpu_worker`.

They live here because only `services/engine` crosses from the services into tensors
(DESIGN.md section 1): `services/cli.py` dispatches to them and imports nothing of
`gpu_worker` itself. `gpu_worker` is imported only when a command runs, so parsing flags (and
every other subcommand) never loads torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.engine.flags import add_engine_args


def add_generate_args(gen: argparse.ArgumentParser) -> None:
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


def run_generate(args: argparse.Namespace) -> int:
    """Run the engine offline on one prompt (`--repeat` times) and print each run's output
    and cached tokens per tier; 2 for an invalid request."""
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
            if out.spec_rounds:
                print(
                    f"  speculative: {out.spec_accepted}/{out.spec_proposed} proposals accepted "
                    f"in {len(out.spec_rounds)} verify rounds"
                )
            print(f"  text={text!r}")
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        engine.close()
        if ranks is not None:
            ranks.wait()
    return 0


def add_consensus_args(cons: argparse.ArgumentParser) -> None:
    cons.add_argument(
        "log_dir", type=Path, help="the HICACHE_RANK_CONSENSUS_DIR of a run (rank*.jsonl)"
    )


def run_consensus(args: argparse.Namespace) -> int:
    """Report the first entry on which the ranks' consensus logs differ; 1 when they do."""
    from gpu_worker.consensus.records import report_dir

    text, diverged = report_dir(args.log_dir)
    print(text)
    return 1 if diverged else 0
