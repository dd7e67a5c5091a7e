"""The engine service's NATS connection and its one publisher (`EngineBus`).

The first connect is retried with backoff until it succeeds (a supervisor may start engines
before nats-server), as are reconnects; each failed attempt logs one line. Streams and KV
events go out through one queue, in the order they were made; replies to requests
(flush, stats, model card, P/D) are published at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

from bus_schemas.connection import Backoff, Credentials, connect_nats
from services.tasks import OwnedTasks

log = logging.getLogger(__name__)

NATS_BACKOFF_S = (0.1, 5.0)  # first and longest wait between NATS connect attempts
STOP_STEP_TIMEOUT_S = 2.0  # the longest one bus step of shutdown may take (flush, close)


class EngineBus:
    """One engine's NATS connection: connect, subscribe, publish now or in order, close.

    `on_reconnected` runs after every reconnect (P/D prefill sends its unACKed frames
    again); `reconnects` counts them (heartbeats carry it: routers then check their
    streams)."""

    def __init__(
        self,
        url: str,
        engine_id: str,
        credentials: Credentials | None,
        tls_ca_file: str | None,
        on_reconnected: Callable[[], None],
    ) -> None:
        self.url = url
        self.engine_id = engine_id
        self.credentials = credentials
        self.tls_ca_file = tls_ca_file
        self.on_reconnected = on_reconnected
        self.reconnects = 0
        self._nc: NATS | None = None
        self._outbound: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
        self._tasks = OwnedTasks()  # the publisher
        self._failed_attempts = 0  # NATS attempts failed since the last (re)connect

    @property
    def nc(self) -> NATS:
        assert self._nc is not None
        return self._nc

    async def connect(self) -> None:
        """Connect to NATS, retrying (first connect and reconnects alike) with a doubling
        wait up to `NATS_BACKOFF_S[1]`; the wait starts over once connected. Then start
        the publisher."""
        self._nc = await connect_nats(
            self.url,
            name=f"engine-{self.engine_id}",
            log=log,
            credentials=self.credentials,
            tls_ca_file=self.tls_ca_file,
            backoff=Backoff(*NATS_BACKOFF_S),
            error_cb=self._on_error,
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
            drain_timeout=int(STOP_STEP_TIMEOUT_S),
            flush_timeout=STOP_STEP_TIMEOUT_S,  # a full buffer never blocks a publish forever
        )

    def start_publisher(self) -> None:
        self._tasks.spawn(self._publisher(), "publisher")

    async def _on_error(self, e: Exception) -> None:
        """One line per failed attempt (nats.py's default logs a traceback); the wait is
        `connect_nats`' backoff, which starts over once connected."""
        wait = Backoff(*NATS_BACKOFF_S).delay(self._failed_attempts)
        self._failed_attempts += 1
        log.warning("NATS %s: %s (next attempt in %.1f s)", self.url, brief(e), wait)

    async def _on_disconnected(self) -> None:
        if self._nc is not None and not (self._nc.is_closed or self._nc.is_draining):
            log.warning("NATS disconnected; reconnecting")

    async def _on_reconnected(self) -> None:
        log.info("NATS reconnected")
        self._failed_attempts = 0
        self.reconnects += 1
        self.on_reconnected()

    async def subscribe(self, subject: str, cb: Any, queue: str = "") -> Subscription:
        return await self.nc.subscribe(subject, queue=queue, cb=cb)

    def max_payload(self) -> int:
        """The largest message the NATS server takes (its INFO, as of the last connect)."""
        return self.nc.max_payload

    async def publish(self, subject: str, data: bytes, reply: str = "") -> None:
        """Publish now, ahead of what is queued (replies to requests, P/D frames)."""
        await self.nc.publish(subject, data, reply=reply)

    def enqueue(self, subject: str, data: bytes) -> None:
        """Queue a message for the publisher: streams and events go out in this order."""
        self._outbound.put_nowait((subject, data))

    async def _publisher(self) -> None:
        """The one place that publishes streams and events, in the order they were made."""
        nc = self.nc
        while True:
            subject, data = await self._outbound.get()
            try:
                await nc.publish(subject, data)
            except Exception as e:  # NATS down and its buffer full: this message is lost
                log.warning("publish to %s failed: %s", subject, brief(e))
            finally:
                self._outbound.task_done()

    async def flush_queue(self) -> None:
        """Publish what is queued (bounded in time), then end the publisher."""
        await bounded(self._outbound.join(), "publishing the last messages")
        await self._tasks.cancel_all()

    async def close(self) -> None:
        """Drain NATS; each step bounded in time."""
        nc = self._nc
        if nc is None or nc.is_closed:
            return
        # drain() can outlast any timeout around it (it flushes again once cancelled), so
        # only a server that answers a bounded flush gets drained; else the socket is closed
        responsive = nc.is_connected and await bounded(
            nc.flush(timeout=int(STOP_STEP_TIMEOUT_S)), "NATS flush"
        )
        if responsive and await bounded(nc.drain(), "NATS drain", 3 * STOP_STEP_TIMEOUT_S):
            return
        await bounded(nc.close(), "NATS close")


def brief(e: BaseException) -> str:
    """An exception in one line (nats.py errors often have an empty str())."""
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


async def bounded(aw: Any, what: str, timeout_s: float = STOP_STEP_TIMEOUT_S) -> bool:
    """Await `aw` for at most `timeout_s`; False (logged in one line) when it failed."""
    try:
        await asyncio.wait_for(aw, timeout_s)
        return True
    except Exception as e:
        log.warning("%s did not complete: %s", what, brief(e))
        return False
