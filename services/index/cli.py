"""`python -m services.index`: the index service's flags, and its run until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

import nats.errors

from bus_schemas.connection import (
    Credentials,
    add_nats_url_arg,
    add_tls_args,
    read_credentials,
    tls_ca_file,
)
from bus_schemas.sentinel import add_sentinel_args, parse_sentinels, sentinel_redis_url
from services.index.config import IndexConfig
from services.index.service import IndexService

log = logging.getLogger("hicache.index")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m services.index",
        description="The index service: KV events and heartbeats from NATS -> Redis.",
    )
    defaults = IndexConfig()
    add_nats_url_arg(parser, defaults.nats_url)
    parser.add_argument(
        "--redis-url",
        default=None,
        help=f"the Redis server (default {defaults.redis_url}); with --redis-sentinel only "
        "scheme, credentials and db (default redis:///0)",
    )
    parser.add_argument(
        "--nats-credentials",
        default=None,
        metavar="FILE",
        help="NATS `user:password` (a 0600 file; `hicache-mesh credentials` makes them)",
    )
    parser.add_argument(
        "--redis-credentials", default=None, metavar="FILE", help="Redis `user:password` (0600)"
    )
    add_tls_args(parser, redis=True)
    add_sentinel_args(parser)
    parser.add_argument(
        "--sweep-interval",
        type=float,
        default=defaults.sweep_interval_s,
        help="seconds between expiry sweeps and Redis health checks",
    )
    parser.add_argument(
        "--snapshot-retry",
        type=float,
        default=defaults.snapshot_retry_s,
        help="seconds before an unanswered snapshot request is repeated",
    )
    parser.add_argument(
        "--redis-timeout",
        type=float,
        default=defaults.redis_timeout_s,
        help="seconds per Redis call before it counts as failed",
    )
    parser.add_argument(
        "--max-engines",
        type=int,
        default=defaults.max_engines,
        help="engines indexed at once; messages of a new engine beyond it are dropped",
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    return parser


def config_from_args(args: argparse.Namespace) -> IndexConfig:
    sentinels = parse_sentinels(args.redis_sentinel)
    redis_url = args.redis_url or IndexConfig().redis_url
    if sentinels:
        redis_url = sentinel_redis_url(args.redis_url, sentinels)
    return IndexConfig(
        nats_url=args.nats_url,
        redis_url=redis_url,
        sweep_interval_s=args.sweep_interval,
        snapshot_retry_s=args.snapshot_retry,
        redis_timeout_s=args.redis_timeout,
        max_engines=args.max_engines,
        nats_credentials=_credentials(args.nats_credentials),
        redis_credentials=_credentials(args.redis_credentials),
        nats_tls_ca_file=tls_ca_file(args.nats_tls_ca_file),
        redis_tls_ca_file=tls_ca_file(args.redis_tls_ca_file),
        redis_sentinels=sentinels,
        redis_sentinel_master=args.redis_sentinel_master,
        redis_sentinel_credentials=_credentials(args.redis_sentinel_credentials),
    )


def _credentials(path: str | None) -> Credentials | None:
    return None if path is None else read_credentials(path)


async def run(args: argparse.Namespace) -> None:
    """Run the index until SIGINT or SIGTERM, then shut it down gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    service = IndexService(config_from_args(args))
    try:
        starting = asyncio.create_task(service.start(), name="index-start")
        stopped = asyncio.create_task(stop.wait(), name="index-stop-wait")
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        starting.cancel()  # SIGTERM while NATS is still unreachable: give up waiting
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        await stopped
    finally:
        await service.stop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(run(args))
    except (OSError, nats.errors.Error) as e:
        log.error("index failed: %s", e)
        return 1
    return 0
