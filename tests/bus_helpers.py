"""Helpers for tests that talk to real engine processes over a real nats-server."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bus_schemas import Heartbeat
from bus_schemas import subjects as subj


async def barrier(nc: NATS) -> None:
    """Return once the server has processed everything `nc` queued so far.

    `nc.flush()` alone is not that: nats-py writes its PING straight to the socket, ahead of
    the SUB, UNSUB and PUB commands still in its pending buffer, so the PONG can come back
    before them. By the time the first PONG is back the flusher task has written what was
    pending (it was woken first), so a second PING follows it on the socket."""
    await nc.flush()
    await nc.flush()


async def wait_heartbeats(
    nc: NATS, engine_ids: set[str], timeout_s: float = 90
) -> dict[str, Heartbeat]:
    """The first heartbeat of each engine in `engine_ids` (engines take seconds to start)."""
    seen: dict[str, Heartbeat] = {}
    done = asyncio.Event()

    async def on(msg: Msg) -> None:
        hb = Heartbeat.decode(msg.data)
        seen.setdefault(hb.engine_id, hb)
        if engine_ids <= seen.keys():
            done.set()

    sub = await nc.subscribe(subj.HEARTBEAT, cb=on)
    try:
        await asyncio.wait_for(done.wait(), timeout_s)
    finally:
        await sub.unsubscribe()
    return seen


def spawn_engine(nats_url: str, engine_id: str, *flags: str) -> subprocess.Popen[bytes]:
    """`python -m services.engine` as its own process, with `flags` after the bus ones."""
    argv = [sys.executable, "-m", "services.engine", "--engine-id", engine_id]
    return subprocess.Popen([*argv, "--nats-url", nats_url, *flags])
