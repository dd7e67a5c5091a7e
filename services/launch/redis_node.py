"""`python -m services.launch.redis_node`: (re)start a data node of a replicated Redis as
the sentinels see the set, then become the server (`exec`, same pid).

Nodes keep no data on disk (`--save ''`), so a primary that restarts comes back empty. Were
it to come back as a primary before the sentinels noticed it was gone, its replicas would
copy its emptiness, and Sentinel would never fail over. So before starting, the node asks
the sentinels where the primary is:
- they name another node: start as its replica (`--replicaof`, after the configured flags);
- they name this node, now dead: wait (at most `--wait`) for them to promote a replica, then
  start as its replica; with no failover by then (no replica to promote), start as
  configured;
- none answers: at the first start (the sentinels start after the nodes; no
  `--restart-marker` file yet) start as configured; at a restart, ask again until `--wait`
  is over (a busy machine may answer late), then start as configured.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from bus_schemas.connection import read_credentials
from bus_schemas.sentinel import Address, parse_sentinels

log = logging.getLogger("hicache.redis_node")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.launch.redis_node")
    p.add_argument("--redis-sentinel", action="append", required=True, metavar="HOST:PORT,...")
    p.add_argument("--redis-sentinel-master", required=True, metavar="NAME")
    p.add_argument("--redis-sentinel-credentials", default=None, metavar="FILE")
    p.add_argument("--node", required=True, metavar="HOST:PORT", help="this node's address")
    p.add_argument("--wait", type=float, default=10.0, help="seconds to wait for a failover")
    p.add_argument(
        "--restart-marker",
        default=None,
        metavar="FILE",
        help="made at the first start: when it exists, this start is a restart",
    )
    p.add_argument("server", nargs=argparse.REMAINDER, help="-- the server's command line")
    return p


def current_primary(sentinels: Sequence[redis.Redis], master: str) -> Address | None:
    """Where the first sentinel that answers says the primary is, whether or not it sees it
    up (a dead primary is still named until a replica is promoted); None: none answers."""
    for sentinel in sentinels:
        try:
            reply = sentinel.execute_command("SENTINEL", "get-master-addr-by-name", master)
        except (RedisError, OSError):
            continue
        if reply:
            return str(reply[0]), int(reply[1])
    return None


def choose_primary(
    sentinels: Sequence[redis.Redis],
    master: str,
    node: Address,
    wait_s: float,
    restart: bool = True,
) -> Address | None:
    """The primary this node should replicate, or None: start as configured."""
    deadline = time.monotonic() + wait_s
    while True:
        primary = current_primary(sentinels, master)
        if primary != node and (primary is not None or not restart):
            return primary
        if time.monotonic() >= deadline:
            log.warning("no failover away from %s:%d: starting as configured", *node)
            return None
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = build_parser().parse_args(argv)
    server = args.server[1:] if args.server[:1] == ["--"] else args.server
    if not server:
        print("error: give the server's command line after --", file=sys.stderr)
        return 2
    (node,) = parse_sentinels([args.node])
    # no retries: a sentinel that does not answer at once is skipped (at the first start,
    # none is up yet)
    asking: dict[str, object] = {"socket_timeout": 1.0, "socket_connect_timeout": 1.0}
    asking["retry"] = Retry(NoBackoff(), 0)
    if args.redis_sentinel_credentials:
        creds = read_credentials(args.redis_sentinel_credentials)
        asking |= {"username": creds.user, "password": creds.password}
    sentinels = [
        redis.Redis(host, port, decode_responses=True, **asking)  # type: ignore[arg-type]
        for host, port in parse_sentinels(args.redis_sentinel)
    ]
    restart = args.restart_marker is not None and os.path.exists(args.restart_marker)
    if args.restart_marker is not None:
        open(args.restart_marker, "a").close()
    primary = choose_primary(sentinels, args.redis_sentinel_master, node, args.wait, restart)
    if primary is not None:
        log.info("starting as a replica of %s:%d", *primary)
        server += ["--replicaof", primary[0], str(primary[1])]
    os.execv(server[0], server)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
