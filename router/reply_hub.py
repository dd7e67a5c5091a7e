"""The router's one wildcard subscription for every request's replies (`ReplyHub`), and its
marker for a NATS reconnect (`RECONNECTED`)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import time
from collections import Counter

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError

Reply = tuple[str, bytes]  # (subject, payload) of one message to a ReplyHub subject
# The subject of a ReplyHub marker (never a NATS subject): NATS reconnected, on the router's
# side (payload b"") or on one engine's (its id); replies may have been lost in between.
RECONNECTED = ""


class ReplyHub:
    """One wildcard subscription for every request's replies.

    Each request gets a subject under the router's own inbox prefix and a queue; the hub
    delivers by subject. This saves a SUB and an UNSUB round of protocol per request. Every
    engine may publish into the router's inbox (its replies go there), so a subject ends in
    a random part: an engine told one request's subject cannot guess another's.
    """

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self._prefix = nc.new_inbox()
        self._queues: dict[str, asyncio.Queue[Reply]] = {}
        self._next = 0
        self._sub: Subscription | None = None
        # reconnects seen, the router's own under "" and each engine's under its id
        self.reconnects: Counter[str] = Counter()
        self._last_reconnect = -math.inf  # time.monotonic() of the latest

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(f"{self._prefix}.*", cb=self._on_msg)

    async def stop(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            with contextlib.suppress(NatsError):
                await sub.unsubscribe()

    def open(self, queue: asyncio.Queue[Reply] | None = None) -> tuple[str, asyncio.Queue[Reply]]:
        """A new subject, delivering into `queue` (default: a new one) until `close`."""
        self._next += 1
        subject = f"{self._prefix}.{self._next}-{secrets.token_hex(8)}"
        if queue is None:
            queue = asyncio.Queue()
        self._queues[subject] = queue
        return subject, queue

    def close(self, subject: str) -> None:
        self._queues.pop(subject, None)

    def reconnected(self, engine_id: str = "") -> None:
        """NATS came back, for this router (`engine_id` "") or for one engine: every open
        stream (of that engine) asks its engine what it sent (`EngineStream.next_chunk`)."""
        self.reconnects[engine_id] += 1
        self._last_reconnect = time.monotonic()
        marker = (RECONNECTED, engine_id.encode())
        for queue in {id(q): q for q in self._queues.values()}.values():
            queue.put_nowait(marker)

    def reconnected_within(self, seconds: float) -> bool:
        """Whether NATS came back (for this router or any engine) in the last `seconds`."""
        return time.monotonic() - self._last_reconnect < seconds

    async def _on_msg(self, msg: Msg) -> None:
        queue = self._queues.get(msg.subject)
        if queue is not None:
            queue.put_nowait((msg.subject, msg.data))
