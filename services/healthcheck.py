"""`python -m services.healthcheck`: container health probes that need nothing but the image.

The image (python:3.11-slim) has no curl or wget, so compose healthchecks run this:

    python -m services.healthcheck http URL                   # 2xx -> healthy (the router)
    python -m services.healthcheck engine [--nats-credentials FILE] [--nats-tls-ca-file PEM]
        NATS_URL ENGINE_ID
        # answers a stats request (as the engine's own NATS user where the bus has users:
        # an engine may ask itself for stats)
    python -m services.healthcheck nats-client MONITOR_URL[,MONITOR_URL...] NAME
        # a client named NAME is connected to NATS (the index: it serves no request); a
        # cluster: to any of its members

Exit 0 when healthy, 1 when not (with one line saying why on stderr), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import urllib.error
import urllib.request

from bus_schemas import SchemaError, StatsReply, StatsRequest, subjects
from bus_schemas.connection import (
    Credentials,
    add_tls_args,
    open_nats,
    read_credentials,
    server_list,
    tls_ca_file,
)


def check_http(url: str, timeout_s: float) -> str | None:
    """None when `url` answers 2xx, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return None if 200 <= resp.status < 300 else f"HTTP {resp.status}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return f"{url}: {e}"


def check_nats_client(monitor_url: str, name: str, timeout_s: float) -> str | None:
    """None when nats-server's monitoring endpoint lists a connection named `name`; with
    several comma-separated endpoints (a NATS cluster: the client may be on any member),
    when one of them does."""
    why = []
    for monitor in server_list(monitor_url):
        url = f"{monitor.rstrip('/')}/connz?limit=100000"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                conns = json.loads(resp.read()).get("connections") or []
        except (urllib.error.URLError, OSError, ValueError) as e:
            why.append(f"{url}: {e}")
            continue
        if any(c.get("name") == name for c in conns):
            return None
        why.append(f"no NATS client named {name!r} at {monitor}")
    return "; ".join(why)


async def check_engine(
    nats_url: str,
    engine_id: str,
    timeout_s: float,
    credentials: Credentials | None = None,
    tls_ca_file: str | None = None,
) -> str | None:
    """None when the engine answers a stats request over NATS (its service loop runs)."""
    import nats.errors

    try:
        nc = await open_nats(
            server_list(nats_url),
            credentials=credentials,
            tls_ca_file=tls_ca_file,
            allow_reconnect=False,
            connect_timeout=timeout_s,
        )
    except (OSError, nats.errors.Error, TimeoutError) as e:
        return f"NATS at {nats_url}: {e!r}"
    try:
        msg = await nc.request(
            subjects.engine_stats(engine_id), StatsRequest().encode(), timeout=timeout_s
        )
        StatsReply.decode(msg.data)
    except (nats.errors.Error, TimeoutError) as e:
        return f"engine {engine_id} did not answer: {e!r}"
    except SchemaError as e:
        return f"engine {engine_id} answered badly: {e}"
    finally:
        await nc.close()
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.healthcheck", description=__doc__)
    p.add_argument("--timeout", type=float, default=3.0, help="seconds per probe")
    sub = p.add_subparsers(dest="probe", required=True)
    http = sub.add_parser("http", help="GET URL answers 2xx")
    http.add_argument("url")
    engine = sub.add_parser("engine", help="the engine answers a stats request")
    engine.add_argument(
        "--nats-credentials", default=None, metavar="FILE", help="NATS `user:password` (0600)"
    )
    add_tls_args(engine)
    engine.add_argument("nats_url")
    engine.add_argument("engine_id")
    client = sub.add_parser("nats-client", help="a client with this name is connected")
    client.add_argument("monitor_url")
    client.add_argument("name")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.probe == "http":
        why = check_http(args.url, args.timeout)
    elif args.probe == "engine":
        try:
            creds = (
                None if args.nats_credentials is None else read_credentials(args.nats_credentials)
            )
            ca = tls_ca_file(args.nats_tls_ca_file)
        except ValueError as e:  # CredentialsError, TLSConfigError
            print(f"error: {e}", file=sys.stderr)
            return 2
        why = asyncio.run(check_engine(args.nats_url, args.engine_id, args.timeout, creds, ca))
    else:
        why = check_nats_client(args.monitor_url, args.name, args.timeout)
    if why is not None:
        print(f"unhealthy: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
