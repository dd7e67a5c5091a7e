"""One NATS connection policy for a long-running process: wait for the server with backoff,
then connect with reconnects forever, also with backoff.

Why: a supervisor may start processes in any order, so a process must START while NATS is
not up yet, and keep running (answering SIGTERM) while it is gone. nats.py retries a failed
first connect at a fixed pace and cannot be told to stop short of cancelling it; here each
failed attempt logs one line and waits `Backoff.delay(attempt)`. The caller cancels the
coroutine (e.g. on SIGTERM) to give up.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import nats
from nats.aio.client import Client as NATS
from nats.aio.client import Server


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential: `initial_s` doubling up to `max_s`."""

    initial_s: float = 0.1
    max_s: float = 1.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait before attempt `attempt` (0-based) after a failure."""
        return float(min(self.max_s, self.initial_s * 2 ** min(attempt, 30)))


async def wait_for_server(url: str, backoff: Backoff, log: logging.Logger) -> None:
    """Return once a TCP connect to `url` succeeds; one log line per failed attempt."""
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 4222
    attempt = 0
    while True:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 2.0)
        except (OSError, TimeoutError) as e:
            delay = backoff.delay(attempt)
            log.warning(
                "NATS at %s unreachable (%s); attempt %d, next in %.1fs",
                url,
                type(e).__name__,
                attempt + 1,
                delay,
            )
            attempt += 1
            await asyncio.sleep(delay)
            continue
        writer.close()
        return


async def connect_nats(
    url: str,
    *,
    name: str,
    log: logging.Logger,
    backoff: Backoff = Backoff(),
    **options: Any,
) -> NATS:
    """A client that reconnects forever (delay `backoff.delay(n)` before the n-th retry).

    `options` go to `nats.connect` (error_cb, disconnected_cb, reconnected_cb, ...).
    """

    def next_server(servers: list[Server], _info: dict[str, Any]) -> tuple[None, float]:
        tries = max((s.reconnects for s in servers), default=0)
        return None, backoff.delay(tries)

    await wait_for_server(url, backoff, log)
    return await nats.connect(
        url,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_to_server_handler=next_server,
        **options,
    )
