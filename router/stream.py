"""One request on one engine over NATS: send it, take its `TokenChunk`s in `seq` order, and
abort it on the way out unless the engine finished it.

    async with EngineStream(hub, table, config, engine_id, request_id) as stream:
        await stream.send(subjects.engine_generate(engine_id), request.encode())  # reply_to=stream.reply_to
        async for chunk in stream:
            ...

The stream never hangs: it raises `EngineFailure` when for `request_timeout_s` (to the
first chunk and between chunks) no chunk comes and the engine shows no progress on the
request (`Progress`: it holds the request queued or computing and computes, so a busy
engine's long prefill is waited for and a hung step loop is not), and checks every
`liveness_poll_s` that the engine still heartbeats, so a killed or frozen engine is noticed
within a few heartbeat intervals. A P/D request's stream is the decode engine's; it also
`watch`es the prefill engine until the first chunk (`PrefillWatch`): an error the prefill
engine reports on the watch's subject, or its heartbeats stopping, fails the stream at once
(`EngineFailure.engine_id` names it), and its progress on the request counts as the
stream's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from types import TracebackType

from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from bus_schemas import (
    AbortRequest,
    Message,
    Progress,
    SchemaError,
    StreamCheck,
    StreamState,
    TokenChunk,
    subjects,
)
from router.config import RouterConfig
from router.engines import EngineTable
from router.reply_hub import RECONNECTED, ReplyHub

FAILURE_STATUS = {  # EngineFailure.kind -> the HTTP status the client sees
    "timeout": 504,  # no chunk (or admit reply) within its timeout
    "lost": 502,  # the engine's heartbeats stopped
    "bad_message": 502,  # a reply that does not decode
    "engine_error": 502,  # the engine reported an internal error
    "unavailable": 503,  # the engine reported it cannot take work (stopping, full)
    "rejected": 400,  # the engine found the request invalid
    "bus": 503,  # NATS itself is unusable
    "restore_failed": 502,  # P/D: decode could not restore the prefix it promised
    "transfer_timeout": 504,  # P/D: decode gave up waiting for the prefill engine's KV
    "engine_crashed": 500,  # the engine's step loop died with this request: never retried
    "transfer_failed": 502,  # P/D: the prefill engine could not send the KV (it names why)
}

# error chunk's error_code -> EngineFailure.kind (anything else: "engine_error")
ENGINE_ERRORS: Mapping[int, str] = {400: "rejected", 503: "unavailable"}
DECODE_ERRORS: Mapping[int, str] = {400: "rejected", 409: "restore_failed", 503: "transfer_timeout"}
# a watched P/D prefill engine's: 502 is a KV transfer that failed on its side
PREFILL_ERRORS: Mapping[int, str] = {**ENGINE_ERRORS, 502: "transfer_failed"}

RESUBSCRIBE_WAIT_S = 0.05  # after a reconnect, between questions the engine cannot hear yet
RESUBSCRIBE_GRACE_S = 5.0  # how long after a reconnect "no responders" may mean "not yet"


class EngineFailure(Exception):
    """The engine did not serve the request. `status` is what the client should see."""

    def __init__(
        self, kind: str, engine_id: str, message: str, num_chunks: int, epoch: str = ""
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.engine_id = engine_id  # the engine at fault (a P/D stream's prefill engine too)
        self.message = message
        self.num_chunks = num_chunks  # good chunks the engine had delivered before failing
        self.epoch = epoch  # the engine's epoch when the request went to it ("" unknown)

    @property
    def status(self) -> int:
        return FAILURE_STATUS[self.kind]

    @property
    def engine_broken(self) -> bool:
        """Whether the engine itself should sit out (not just this request failed)."""
        return self.kind in ("timeout", "lost", "bad_message", "unavailable", "engine_crashed")


class EngineStream:
    """The replies of one request (`request_id`) on one engine (`engine_id`)."""

    def __init__(
        self,
        hub: ReplyHub,
        table: EngineTable,
        config: RouterConfig,
        engine_id: str,
        request_id: str,
        errors: Mapping[int, str] = ENGINE_ERRORS,
    ) -> None:
        self.nc = hub.nc
        self.hub = hub
        self.table = table
        self.config = config
        self.request_id = request_id
        self.errors = errors  # error_code of an error chunk -> failure kind
        self.reply_to, self._queue = hub.open()
        self.engine_id = ""
        self.epochs: dict[str, str] = {}  # engine -> its epoch when the request was sent
        if engine_id:
            self.bind(engine_id)
        self.num_chunks = 0  # chunks handed out so far
        self.started = False  # the engine may hold the request (abort it unless finished)
        self.finished = False  # the engine sent its last chunk (no abort needed)
        self._pending: dict[int, TokenChunk] = {}  # arrived ahead of their turn, by seq
        # an engine whose failure fails the first chunk (a P/D stream's prefill engine)
        self.watched: PrefillWatch | None = None
        self._check_again_at: float | None = None  # after a reconnect: until the engine answers

    def bind(self, engine_id: str) -> None:
        """The engine the request goes to (a stream opened with engine_id "" gets it here,
        before `send`: the request, which names `reply_to`, can be encoded while the engine
        is being chosen)."""
        self.engine_id = engine_id
        self.epochs[engine_id] = self.table.epoch_of(engine_id)

    async def __aenter__(self) -> EngineStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.hub.close(self.reply_to)
        if self.watched is not None:
            await self.watched.close()
        if self.started and not self.finished:
            await self.abort()

    # ------------------------------------------------------------ to the engines

    async def send(self, subject: str, data: bytes) -> None:
        """Publish an encoded request to the engine, which may hold it from now on."""
        assert self.engine_id, "bind() first"
        self.started = True
        try:
            await self.nc.publish(subject, data)
        except NatsError as e:
            raise self._failure("bus", f"NATS publish failed: {e!r}") from None

    async def ask(self, subject: str, message: Message, timeout_s: float) -> bytes:
        """Request/reply with the engine (which may hold the request from now on). Fails
        early, like `next_chunk`, when the engine stops heartbeating or restarts. After a
        NATS reconnect (the router's or the engine's) the question or its answer may have
        been lost: it is asked again, within the same `timeout_s` (engines answer a repeated
        question alike), and "no responders" within `RESUBSCRIBE_GRACE_S` of a reconnect
        means the engine has not subscribed again yet. The engine's `Progress` on the
        request (a decode engine queues an admission until running requests free pages)
        restarts the `timeout_s`, and a question that timed out meanwhile is asked again."""
        self.started = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        data, asked_at = message.encode(), self._reconnects()
        reply = asyncio.ensure_future(self.nc.request(subject, data, timeout=timeout_s))
        try:
            while True:
                await asyncio.wait({reply}, timeout=self.config.liveness_poll_s)
                if self._take_progress():
                    deadline = loop.time() + timeout_s
                if not reply.done():
                    self._check_alive()
                elif (error := reply.exception()) is None:
                    return bytes(reply.result().data)
                elif isinstance(error, NoRespondersError) and self.hub.reconnected_within(
                    RESUBSCRIBE_GRACE_S
                ):
                    await asyncio.sleep(RESUBSCRIBE_WAIT_S)
                elif not (isinstance(error, NatsTimeoutError) and loop.time() < deadline):
                    raise error
                left = deadline - loop.time()
                if left <= 0:
                    raise NatsTimeoutError
                if reply.done() or self._reconnects() != asked_at:
                    asked_at = self._reconnects()
                    reply.cancel()
                    reply = asyncio.ensure_future(self.nc.request(subject, data, timeout=left))
        except NatsTimeoutError:
            raise self._failure(
                "timeout", f"engine {self.engine_id} did not answer within {timeout_s:g} s"
            ) from None
        except NoRespondersError:
            raise self._failure(
                "unavailable", f"engine {self.engine_id} is not listening"
            ) from None
        except NatsError as e:
            raise self._failure("bus", f"NATS request failed: {e!r}") from None
        finally:
            reply.cancel()  # no-op when it is done

    def _take_progress(self) -> bool:
        """Whether the engine's `Progress` on the request came since the last call; taken
        off the queue, everything else stays there, in order, for `next_chunk`."""
        progressed, kept = False, []
        while not self._queue.empty():
            item = self._queue.get_nowait()
            subject, data = item
            message = _status_message(data) if subject == self.reply_to else None
            if isinstance(message, Progress) and message.request_id == self.request_id:
                progressed = True
            else:
                kept.append(item)
        for item in kept:
            self._queue.put_nowait(item)
        return progressed

    def _reconnects(self) -> int:
        """NATS reconnects so far of the router and of this stream's engine."""
        return self.hub.reconnects[""] + self.hub.reconnects[self.engine_id]

    def watch(self, engine_id: str) -> PrefillWatch:
        """Until the first chunk, also fail when `engine_id` stops heartbeating or sends an
        error chunk to the returned watch's `subject`."""
        self.watched = PrefillWatch(self, engine_id)
        return self.watched

    async def abort(self) -> None:
        """Tell the engine to stop (fire and forget); no more chunks are expected."""
        self.finished = True
        await self._abort(self.engine_id)

    async def _abort(self, engine_id: str) -> None:
        msg = AbortRequest(self.request_id).encode()
        with contextlib.suppress(NatsError):
            await self.nc.publish(subjects.engine_abort(engine_id), msg)

    # ------------------------------------------------------------ from the engine

    async def __aiter__(self) -> AsyncIterator[TokenChunk]:
        while not self.finished:
            yield await self.next_chunk()

    async def next_chunk(self) -> TokenChunk:
        """The next chunk in order; raises EngineFailure (an error chunk included)."""
        loop = asyncio.get_running_loop()
        timeout_s = self.config.request_timeout_s
        deadline = loop.time() + timeout_s
        while self.num_chunks not in self._pending:
            now = loop.time()
            if now >= deadline:
                raise self._failure(
                    "timeout",
                    f"engine {self.engine_id} sent nothing for {timeout_s:g} s, "
                    "nor any progress on the request",
                )
            try:
                async with asyncio.timeout(min(self.config.liveness_poll_s, deadline - now)):
                    subject, data = await self._queue.get()
            except TimeoutError:
                self._check_alive()
                if self._check_again_at is not None and loop.time() >= self._check_again_at:
                    await self._check_stream()  # the engine may not have resubscribed yet
                if self.watched is not None and self.watched.check_due(loop.time()):
                    await self.watched.check()
                continue
            if subject == self.reply_to:
                progressed = self._accept(data)
            elif subject == RECONNECTED:
                progressed = False
                if data.decode() in ("", self.engine_id) and self.started:
                    await self._check_stream()
                if self.watched is not None and self.watched.may_have_lost(data.decode()):
                    await self.watched.check()
            else:  # only `watch` opens another subject into this queue
                assert self.watched is not None
                progressed = self.num_chunks == 0 and self.watched.on_message(data)
            if progressed:
                deadline = loop.time() + timeout_s
        chunk = self._pending.pop(self.num_chunks)
        if chunk.error is not None:
            self.finished = True
            kind = self.errors.get(chunk.error_code, "engine_error")
            if chunk.engine_crashed:
                kind = "engine_crashed"
            raise self._failure(kind, f"engine {self.engine_id}: {chunk.error}")
        self.num_chunks += 1
        self.finished = chunk.finished
        return chunk

    def _check_alive(self) -> None:
        if not self.table.is_alive(self.engine_id):
            raise self._failure("lost", f"engine {self.engine_id} stopped sending heartbeats")
        if self._restarted(self.engine_id):
            raise self._failure("lost", f"engine {self.engine_id} restarted: the request is lost")
        if self.watched is not None and self.num_chunks == 0:
            self.watched.check_alive()

    def _restarted(self, engine_id: str) -> bool:
        """The engine heartbeats with a new epoch: a new process that never had the request."""
        sent_to = self.epochs.get(engine_id, "")
        return bool(sent_to) and self.table.epoch_of(engine_id) != sent_to

    async def _check_stream(self) -> None:
        """After a reconnect: ask the engine whether it holds this stream and what it sent
        (its StreamState comes on `reply_to`, after those chunks). Asked again every
        `liveness_poll_s` until it answers."""
        loop = asyncio.get_running_loop()
        self._check_again_at = loop.time() + self.config.liveness_poll_s
        check = StreamCheck(self.request_id, self.reply_to)
        with contextlib.suppress(NatsError):  # the bus is down again: asked again later
            await self.nc.publish(subjects.engine_stream_check(self.engine_id), check.encode())

    def _accept(self, data: bytes) -> bool:
        """Take a message of the engine; True when it is progress on the request."""
        try:
            chunk = TokenChunk.decode(data)
        except SchemaError as e:
            other = _status_message(data)
            if other is None:
                raise self._failure("bad_message", f"undecodable chunk: {e}") from None
            if isinstance(other, Progress):
                return other.request_id == self.request_id
            self._on_state(other)
            return False
        if chunk.request_id != self.request_id or chunk.seq < self.num_chunks:
            return False  # not ours, or a duplicate
        self._pending.setdefault(chunk.seq, chunk)
        return False

    def _on_state(self, state: StreamState) -> None:
        """The engine's answer to `_check_stream`: every chunk it sent before it has come,
        or was lost while NATS reconnected. Lost replies fail the request at once (retried
        elsewhere when nothing was streamed) instead of after `request_timeout_s`."""
        if state.request_id != self.request_id or self._check_again_at is None:
            return
        self._check_again_at = None
        got = self.num_chunks
        while got in self._pending:
            if self._pending[got].finished:
                return  # the whole stream came
            got += 1
        if not state.held:
            raise self._failure(
                "bus", f"engine {self.engine_id} does not hold the request: lost on the bus"
            )
        if state.next_seq > got:
            raise self._failure(
                "bus",
                f"engine {self.engine_id} sent {state.next_seq} chunks, {got} came: "
                "replies lost while NATS reconnected",
            )

    def _failure(self, kind: str, message: str, engine_id: str | None = None) -> EngineFailure:
        engine_id = engine_id or self.engine_id
        epoch = self.epochs.get(engine_id, "")
        return EngineFailure(kind, engine_id, message, self.num_chunks, epoch)


class PrefillWatch:
    """The prefill engine a P/D stream watches until its first chunk: the engine's error
    reports and its answers to stream checks come on `subject` (into the stream's queue), and
    the stream fails (`EngineFailure.engine_id` naming this engine) when the engine stops
    heartbeating, restarts, reports an error or lost the request on the bus."""

    def __init__(self, stream: EngineStream, engine_id: str) -> None:
        self.stream = stream
        self.engine_id = engine_id
        stream.epochs[engine_id] = stream.table.epoch_of(engine_id)
        self.subject, _ = stream.hub.open(stream._queue)
        self.told = False  # the engine got work (abort it on a failure)
        self.check_at: float | None = None  # after a reconnect: until the engine answers

    async def tell(self, subject: str, message: Message) -> None:
        """Publish `message` to the watched engine."""
        self.told = True
        try:
            await self.stream.nc.publish(subject, message.encode())
        except NatsError as e:
            raise self._failure("bus", f"NATS publish failed: {e!r}") from None

    async def close(self) -> None:
        """Stop taking the engine's messages; abort its work when it got some and the stream
        delivered no chunk (the work is of no use any more)."""
        self.stream.hub.close(self.subject)
        if self.told and self.stream.num_chunks == 0:
            await self.stream._abort(self.engine_id)

    def check_alive(self) -> None:
        """Raise when the engine stopped heartbeating or restarted."""
        watched = self.engine_id
        if not self.stream.table.is_alive(watched):
            raise self._failure(
                "lost",
                f"prefill engine {watched} stopped sending heartbeats before its KV arrived",
            )
        if self.stream._restarted(watched):
            raise self._failure("lost", f"prefill engine {watched} restarted before its KV arrived")

    def check_due(self, now: float) -> bool:
        """Whether a `check` went unanswered for `liveness_poll_s`: it is asked again."""
        return self.check_at is not None and now >= self.check_at

    def may_have_lost(self, reconnected: str) -> bool:
        """Whether a NATS reconnect (the router's: "", or an engine's: its id) may have lost
        what the engine was told."""
        return self.told and reconnected in ("", self.engine_id)

    async def check(self) -> None:
        """After a reconnect, before the first chunk: ask the engine whether it got the
        request. One it never got would leave the decode engine waiting for KV until its
        transfer timeout."""
        stream = self.stream
        if stream.num_chunks > 0:
            self.check_at = None
            return
        loop = asyncio.get_running_loop()
        self.check_at = loop.time() + stream.config.liveness_poll_s
        check = StreamCheck(stream.request_id, self.subject)
        with contextlib.suppress(NatsError):
            await stream.nc.publish(subjects.engine_stream_check(self.engine_id), check.encode())

    def on_message(self, data: bytes) -> bool:
        """A message of the engine: an error report, the answer to a check, or its progress
        on the request (True)."""
        try:
            chunk = TokenChunk.decode(data)
        except SchemaError as e:
            other = _status_message(data)
            if other is None:
                raise self._failure("bad_message", f"undecodable chunk: {e}") from None
            if isinstance(other, Progress):
                return other.request_id == self.stream.request_id
            self._on_state(other)
            return False
        if chunk.request_id != self.stream.request_id or chunk.error is None:
            return False
        kind = PREFILL_ERRORS.get(chunk.error_code, "engine_error")
        if chunk.engine_crashed:
            kind = "engine_crashed"
        raise self._failure(kind, f"prefill engine {self.engine_id}: {chunk.error}")

    def _on_state(self, state: StreamState) -> None:
        """The engine's answer to `check`: it holds the request (or has delivered its KV),
        or the request was lost on the bus (retried at once)."""
        if state.request_id != self.stream.request_id or self.check_at is None:
            return
        self.check_at = None
        if not state.held:
            raise self._failure(
                "bus", f"prefill engine {self.engine_id} does not hold the request: lost on the bus"
            )

    def _failure(self, kind: str, message: str) -> EngineFailure:
        return self.stream._failure(kind, message, self.engine_id)


def _status_message(data: bytes) -> StreamState | Progress | None:
    """An engine's message on a stream that is not a chunk, or None when it is neither."""
    for kind in (Progress, StreamState):
        try:
            return kind.decode(data)
        except SchemaError:
            pass
    return None
