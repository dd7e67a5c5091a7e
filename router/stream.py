"""One request on one engine over NATS: send it, take its `TokenChunk`s in `seq` order, and
abort it on the way out unless the engine finished it.

    async with EngineStream(hub, table, config, engine_id, request) as stream:
        async for chunk in stream:
            ...

The stream never hangs: it raises `EngineFailure` when no chunk comes within
`request_timeout_s` (first chunk and between chunks), and checks every `liveness_poll_s`
that the engine still heartbeats, so a killed engine is noticed within a few heartbeat
intervals.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from types import TracebackType

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError

from bus_schemas import AbortRequest, GenerateRequest, SchemaError, TokenChunk, subjects
from router.config import RouterConfig
from router.engines import EngineTable

FAILURE_STATUS = {  # EngineFailure.kind -> the HTTP status the client sees
    "timeout": 504,  # no chunk within the request timeout
    "lost": 502,  # the engine's heartbeats stopped
    "bad_message": 502,  # a reply that does not decode
    "engine_error": 502,  # the engine reported an internal error
    "unavailable": 503,  # the engine reported it cannot take work (stopping, full)
    "rejected": 400,  # the engine found the request invalid
    "bus": 503,  # NATS itself is unusable
}


class EngineFailure(Exception):
    """The engine did not serve the request. `status` is what the client should see."""

    def __init__(self, kind: str, engine_id: str, message: str, num_chunks: int) -> None:
        super().__init__(message)
        self.kind = kind
        self.engine_id = engine_id
        self.message = message
        self.num_chunks = num_chunks  # good chunks the engine had delivered before failing

    @property
    def status(self) -> int:
        return FAILURE_STATUS[self.kind]

    @property
    def engine_broken(self) -> bool:
        """Whether the engine itself should sit out (not just this request failed)."""
        return self.kind in ("timeout", "lost", "bad_message", "unavailable")


class ReplyHub:
    """One wildcard subscription for every request's replies.

    Each request gets a subject under the router's own inbox prefix and a queue; the hub
    delivers by subject. This saves a SUB and an UNSUB round of protocol per request.
    """

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self._prefix = nc.new_inbox()
        self._queues: dict[str, asyncio.Queue[bytes]] = {}
        self._next = 0
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(f"{self._prefix}.*", cb=self._on_msg)

    async def stop(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            with contextlib.suppress(NatsError):
                await sub.unsubscribe()

    def open(self) -> tuple[str, asyncio.Queue[bytes]]:
        self._next += 1
        subject = f"{self._prefix}.{self._next}"
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        self._queues[subject] = queue
        return subject, queue

    def close(self, subject: str) -> None:
        self._queues.pop(subject, None)

    async def _on_msg(self, msg: Msg) -> None:
        queue = self._queues.get(msg.subject)
        if queue is not None:
            queue.put_nowait(msg.data)


class EngineStream:
    def __init__(
        self,
        hub: ReplyHub,
        table: EngineTable,
        config: RouterConfig,
        engine_id: str,
        request: GenerateRequest,
    ) -> None:
        self.nc = hub.nc
        self.table = table
        self.config = config
        self.engine_id = engine_id
        self.hub = hub
        reply_to, self._queue = hub.open()
        self.request = replace(request, reply_to=reply_to)
        self.num_chunks = 0  # chunks handed out so far
        self.finished = False  # the engine sent its last chunk (no abort needed)
        self._pending: dict[int, TokenChunk] = {}  # arrived ahead of their turn, by seq

    async def __aenter__(self) -> EngineStream:
        try:
            await self.nc.publish(subjects.engine_generate(self.engine_id), self.request.encode())
        except NatsError as e:
            self.hub.close(self.request.reply_to)
            raise self._failure("bus", f"NATS publish failed: {e!r}") from None
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.hub.close(self.request.reply_to)
        if not self.finished:
            await self.abort()

    async def abort(self) -> None:
        """Tell the engine to stop (fire and forget); no more chunks are expected."""
        self.finished = True
        msg = AbortRequest(self.request.request_id).encode()
        with contextlib.suppress(NatsError):
            await self.nc.publish(subjects.engine_abort(self.engine_id), msg)

    def __aiter__(self) -> AsyncIterator[TokenChunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[TokenChunk]:
        while not self.finished:
            yield await self.next_chunk()

    async def next_chunk(self) -> TokenChunk:
        """The next chunk in order; raises EngineFailure (an error chunk included)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.request_timeout_s
        while self.num_chunks not in self._pending:
            now = loop.time()
            if now >= deadline:
                raise self._failure(
                    "timeout",
                    f"engine {self.engine_id} sent nothing for {self.config.request_timeout_s:g} s",
                )
            try:
                async with asyncio.timeout(min(self.config.liveness_poll_s, deadline - now)):
                    data = await self._queue.get()
            except TimeoutError:
                if not self.table.is_alive(self.engine_id):
                    raise self._failure(
                        "lost", f"engine {self.engine_id} stopped sending heartbeats"
                    ) from None
                continue
            self._accept(data)
        chunk = self._pending.pop(self.num_chunks)
        if chunk.error is not None:
            self.finished = True
            kind = {400: "rejected", 503: "unavailable"}.get(chunk.error_code, "engine_error")
            raise self._failure(kind, f"engine {self.engine_id}: {chunk.error}")
        self.num_chunks += 1
        self.finished = chunk.finished
        return chunk

    def _accept(self, data: bytes) -> None:
        try:
            chunk = TokenChunk.decode(data)
        except SchemaError as e:
            raise self._failure("bad_message", f"undecodable chunk: {e}") from None
        if chunk.request_id != self.request.request_id or chunk.seq < self.num_chunks:
            return  # not ours, or a duplicate
        self._pending.setdefault(chunk.seq, chunk)

    def _failure(self, kind: str, message: str) -> EngineFailure:
        return EngineFailure(kind, self.engine_id, message, self.num_chunks)
