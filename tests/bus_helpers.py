"""Helpers for tests that talk to real engine processes over a real nats-server."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bus_schemas import Heartbeat, Progress, SchemaError, StreamState, TokenChunk
from bus_schemas import subjects as subj
from bus_schemas.connection import Credentials, inbox_prefix, read_credentials


def credentials_of(creds_dir: str | Path, server: str, user: str) -> Credentials:
    """`user`'s credentials for `server` ("nats" or "redis") in a mesh's credentials folder
    (`up`'s status `credentials_dir`: services/launch/credentials.py)."""
    return read_credentials(Path(creds_dir) / server / user)


async def connect_as(url: str, creds: Credentials | None, **options: Any) -> NATS:
    """A NATS client as `creds`' user (its replies under its own inbox prefix)."""
    if creds is not None:
        options |= {"user": creds.user, "password": creds.password}
    return await nats.connect(url, inbox_prefix=inbox_prefix(creds), **options)


def redis_url_as(url: str, creds: Credentials | None) -> str:
    """`url` with `creds` in it (`redis://user:password@host:port/db`)."""
    if creds is None:
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{quote(creds.user, safe='')}:{quote(creds.password, safe='')}@{rest}"


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

    sub = await nc.subscribe(subj.HEARTBEAT_ALL, cb=on)
    try:
        await asyncio.wait_for(done.wait(), timeout_s)
    finally:
        await sub.unsubscribe()
    return seen


def chunk_of(data: bytes) -> TokenChunk | None:
    """A message of a request's stream as its TokenChunk, or None for the engine's
    `Progress` on it (an engine sends those while it works on the request without sending
    chunks); anything else raises SchemaError."""
    try:
        return TokenChunk.decode(data)
    except SchemaError:
        Progress.decode(data)
        return None


async def next_chunk(sub: Subscription, timeout_s: float = 60) -> TokenChunk:
    """The next TokenChunk on `sub`, past the engine's `Progress` messages."""
    while (chunk := chunk_of((await sub.next_msg(timeout=timeout_s)).data)) is None:
        pass
    return chunk


async def next_state(sub: Subscription, timeout_s: float = 60) -> StreamState:
    """The next StreamState (an answer to a StreamCheck) on `sub`, past `Progress`."""
    while True:
        data = (await sub.next_msg(timeout=timeout_s)).data
        try:
            return StreamState.decode(data)
        except SchemaError:
            Progress.decode(data)


def spawn_engine(nats_url: str, engine_id: str, *flags: str) -> subprocess.Popen[bytes]:
    """`python -m services.engine` as its own process, with `flags` after the bus ones
    (`--nats-credentials FILE` among them where the bus has users)."""
    argv = [sys.executable, "-m", "services.engine", "--engine-id", engine_id]
    return subprocess.Popen([*argv, "--nats-url", nats_url, *flags])
