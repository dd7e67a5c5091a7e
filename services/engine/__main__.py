"""`python -m services.engine`: one engine service (colocated, prefill or decode) on NATS.

Exit status: 0 after SIGTERM/SIGINT, 1 when the engine's step loop crashed (its supervisor
restarts it), 2 for bad flags.

With `--nnodes N` the engine's ranks span N hosts: node 0 (`--node-rank 0`) is this service;
a node of rank > 0 runs only its ranks (`gpu_worker/engine/rank.py` `run_node`), never
connects to NATS, and exits when the world ends: 0 when node 0 stopped it, 3 when it lost
node 0 or a peer, 1 when its own rank failed, 2 for bad flags or a config unlike node 0's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from bus_schemas.connection import add_nats_url_arg, add_tls_args, read_credentials, tls_ca_file
from services.engine.config import engine_config_from_args, node_layout_from_args
from services.engine.flags import add_engine_args, add_node_args, add_pd_transfer_args
from services.engine.pd import PDConfig
from services.engine.service import EngineService, EngineServiceConfig

STOP_MARGIN_S = 10.0  # beyond --shutdown-grace, for the bounded bus steps of shutdown


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.engine", description=__doc__)
    parser.add_argument("--engine-id", required=True, help="unique id: letters, digits, - and _")
    parser.add_argument("--bucket", default="default")
    add_nats_url_arg(parser, "nats://127.0.0.1:4222")
    parser.add_argument(
        "--nats-credentials",
        default=None,
        metavar="FILE",
        help="NATS `user:password` of this engine, in a 0600 file (`hicache-mesh credentials`)",
    )
    add_tls_args(parser)
    parser.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds")
    parser.add_argument(
        "--shutdown-grace",
        type=float,
        default=10.0,
        help="seconds running requests get to finish on SIGTERM",
    )
    parser.add_argument("--log-level", default="INFO")
    add_pd_transfer_args(parser)
    pd = parser.add_argument_group("P/D test hooks")
    pd.add_argument(
        "--debug-corrupt-kv-frames",
        type=int,
        default=0,
        help="test hook: corrupt the first N KV frames sent",
    )
    pd.add_argument(
        "--debug-exit-after-kv-frames",
        type=int,
        default=0,
        help="test hook: die after sending N KV frames",
    )
    parser.add_argument(
        "--debug-crash-on-prompt-token",
        type=int,
        default=None,
        help="test hook: the step loop dies when a running request's prompt holds this token",
    )
    add_engine_args(parser)
    add_node_args(parser)
    return parser


async def serve(args: argparse.Namespace) -> int:
    """Run the engine until a signal (returns 0) or a crash of its step loop (returns 1)."""
    pd = PDConfig(
        frame_bytes=args.disaggregation_frame_bytes,
        window=args.disaggregation_window,
        window_bytes=args.disaggregation_window_bytes,
        ack_timeout_s=args.disaggregation_ack_timeout,
        debug_corrupt_frames=args.debug_corrupt_kv_frames,
        debug_exit_after_frames=args.debug_exit_after_kv_frames,
    )
    role = {"null": "colocated"}.get(args.disaggregation_mode, args.disaggregation_mode)
    config = EngineServiceConfig(
        role=role,
        pd=pd,
        engine_id=args.engine_id,
        nats_url=args.nats_url,
        nats_credentials=None
        if args.nats_credentials is None
        else read_credentials(args.nats_credentials),
        nats_tls_ca_file=tls_ca_file(args.nats_tls_ca_file),
        bucket=args.bucket,
        heartbeat_interval_s=args.heartbeat_interval,
        shutdown_grace_s=args.shutdown_grace,
        served_model_name=args.served_model_name or "",
        chat_template_file=Path(args.chat_template) if args.chat_template else None,
        debug_crash_on_prompt_token=args.debug_crash_on_prompt_token,
        nodes=node_layout_from_args(args),
    )
    service = EngineService(config, engine_config_from_args(args))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if await _until(service.start(), stop):  # False: SIGTERM while NATS was not up yet
        print(f"engine {args.engine_id} ready", flush=True)
        await _until(service.crashed_event.wait(), stop)
        if service.crashed_reason is not None:
            await service.abandon()
            return 1
    stopping = asyncio.ensure_future(service.stop())
    done, _ = await asyncio.wait({stopping}, timeout=args.shutdown_grace + STOP_MARGIN_S)
    if not done:  # every step of stop() is bounded: this backstop should never fire
        logging.getLogger(__name__).error("shutdown overran its deadline; exiting now")
        logging.shutdown()
        os._exit(1)  # a cancelled NATS call may not let the loop close either
    stopping.result()
    return 0


async def _until(aw: Coroutine[Any, Any, Any], stop: asyncio.Event) -> bool:
    """Await `aw` unless `stop` is set first (then cancel it); whether `aw` completed."""
    work = asyncio.ensure_future(aw)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, stopped):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    if work.done() and not work.cancelled():
        work.result()  # raises what start raised
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        if args.node_rank > 0:
            return _run_node(args)
        import uvloop

        code = uvloop.run(serve(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if code == 1:  # crashed: a broken world's threads must not run the interpreter's teardown
        logging.shutdown()
        sys.stdout.flush()
        os._exit(1)
    return code


def _run_node(args: argparse.Namespace) -> int:
    """A node of rank > 0: its ranks only (never returns once they joined the world)."""
    from gpu_worker.engine.rank import run_node

    run_node(engine_config_from_args(args), node_layout_from_args(args))
    return 0  # not reached: run_node ends the process with its rank's status


if __name__ == "__main__":
    sys.exit(main())
