"""A scripted engine for router tests, and a helper that runs a router against it.

`FakeEngine` is a real NATS client in the test process speaking the engine side of the
bus_schemas contract: it publishes `Heartbeat`s, answers `GenerateRequest`s with
deterministic tokens (`output[i] = (input_ids[i % len] + 1) % vocab_size`, see
`expected_tokens`; asked for logprobs, token i has logprob `-(i + 1) / 10` and the top k are
`expected_top`), and serves abort, flush, stats and its model card (the byte tokenizer, no
chat template, or `chat_template`). It answers `StreamCheck`s from what it sent. Knobs make
it misbehave: go silent (no heartbeats, no chunks: a killed engine), stop answering while
still heartbeating (a hung engine), answer with an error chunk, or lose chunks on the bus
(`lose_chunks_from`: counted as sent, never published), report a NATS reconnect in its
heartbeats (`bus_reconnects`), or answer a card request with another card than the one its
heartbeats name (`served_card`).

`FakePrefill` and `FakeDecode` play the two P/D roles (DESIGN.md section 6) with the same
tokens: decode answers `DecodeAdmit` with a page-aligned `decode_prefix_len` (its
`cached_device + cached_host`, unless `reuse` is False), prefill sends ONE last KV frame of
positions `[decode_prefix_len, prompt_len)` (8 bytes per token) to the admit's `kv_subject`,
and decode streams once that frame arrives, with the P/D fields on its first chunk. Knobs:
`restore_fails_once` (decode answers its first stream with error 409), `admit_error`, a
decode `error` chunk instead of tokens, `mute_prefill` (prefill heartbeats but never sends),
`prefill_error` (prefill reports an error chunk); decode times a transfer out after the
admit's `transfer_timeout_s` with a 503 chunk. Busy engines: `token_delay_s` before each
chunk, `prefill_delay_s` before prefill's frame, `admit_delay_s` before decode admits (a copy
of a pending admit gets the same answer), each showing `Progress` on the request every
`progress_every_s` (0: none, a hung engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import nats
import orjson
from aiohttp.test_utils import TestClient, TestServer
from bus_helpers import barrier
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bus_schemas import (
    AbortRequest,
    DecodeAdmit,
    DecodeAdmitReply,
    FlushReply,
    GenerateRequest,
    Heartbeat,
    ModelCard,
    PrefillRequest,
    Progress,
    Sampling,
    StatsReply,
    StreamCheck,
    StreamState,
    TokenChunk,
    subjects,
)
from bus_schemas.kv_frame import KVFrameHeader, decode_frame, encode_frame
from router.app import init
from router.config import RouterConfig
from router.keys import NATS as NATS_KEY

VOCAB_SIZE = 260
EOS_ID = 257
KV_BYTES_PER_TOKEN = 8


def expected_tokens(input_ids: Sequence[int], n: int, vocab_size: int = VOCAB_SIZE) -> list[int]:
    """What a FakeEngine generates for `input_ids` with max_new_tokens `n` (no EOS hit)."""
    return [(input_ids[i % len(input_ids)] + 1) % vocab_size for i in range(n)]


def expected_top(
    token: int, i: int, k: int, vocab_size: int = VOCAB_SIZE
) -> list[tuple[int, float]]:
    """A FakeEngine's top `k` logprobs at output position `i` (token `token` first)."""
    return [((token + j) % vocab_size, -(i + 1) / 10 - j) for j in range(k)]


@dataclass
class FakeEngine:
    engine_id: str
    nats_url: str
    bucket: str = "default"
    model: str = "tiny-test"
    namespace: str = "test-ns"
    page_size: int = 4
    context_len: int = 256
    vocab_size: int = VOCAB_SIZE
    interval_s: float = 0.2
    role: str = "colocated"
    token_delay_s: float = 0.0  # pause before each chunk
    progress_every_s: float = 0.0  # during a pause, a Progress on the request this often
    tokens_per_chunk: int = 1
    # --- knobs a test may change while running
    inflight_tokens: int = 0  # reported in heartbeats
    waiting: int = 0  # reported in heartbeats (running: the requests being streamed)
    token_usage: float = 0.0  # reported in heartbeats
    evicted_device_pages: int = 0  # reported in heartbeats
    cached_device: int = 0  # reported in the first chunk
    cached_host: int = 0
    silent: bool = False  # no heartbeats, no chunks, no replies (a killed engine)
    silent_after_chunks: int | None = None  # go silent after sending this many chunks
    mute_generate: bool = False  # heartbeats continue, generate requests go unanswered
    error: tuple[int, str] | None = None  # answer every request with this error chunk
    crashed: bool = False  # mark error chunks engine_crashed (its step loop died)
    flush_success: bool = True
    chat_template: str | None = None  # its model card's
    tokenizer_json: str = ""  # its model card's tokenizer (a `tokenizers` JSON), else bytes
    bos_token_id: int | None = None  # its model card's
    eos_token_ids: list[int] = field(default_factory=lambda: [EOS_ID])  # card and heartbeats
    served_card: ModelCard | None = None  # answered to card requests instead of its own
    store_id: str = ""  # its external store (heartbeats)
    mute_card: bool = False  # model card requests go unanswered
    lose_chunks_from: int | None = None  # chunks of this seq on are "sent" but never arrive
    bus_reconnects: int = 0  # reported in heartbeats
    # --- what it saw
    received: list[GenerateRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    flushes: int = 0
    stats_requests: int = 0
    card_requests: int = 0
    epoch: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    _nc: NATS | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _aborted: set[str] = field(default_factory=set)
    _chunks_sent: int = 0
    _running: int = 0
    _streams: dict[str, tuple[str, int]] = field(default_factory=dict)  # held: (reply_to, seq)

    @property
    def nc(self) -> NATS:
        assert self._nc is not None, "not started"
        return self._nc

    async def start(self) -> None:
        self._nc = await nats.connect(self.nats_url, name=f"fake-{self.engine_id}")
        await self.nc.subscribe(subjects.engine_generate(self.engine_id), cb=self._on_generate)
        await self.nc.subscribe(subjects.engine_abort(self.engine_id), cb=self._on_abort)
        await self.nc.subscribe(subjects.engine_flush(self.engine_id), cb=self._on_flush)
        await self.nc.subscribe(subjects.engine_stats(self.engine_id), cb=self._on_stats)
        await self.nc.subscribe(subjects.engine_model_card(self.engine_id), cb=self._on_card)
        check = subjects.engine_stream_check(self.engine_id)
        await self.nc.subscribe(check, cb=self._on_stream_check)
        await self.subscribe_role()
        await barrier(self.nc)
        await self.beat()
        self._spawn(self._heartbeats())

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._nc is not None:
            await self._nc.close()
            self._nc = None

    async def beat(self) -> None:
        hb = Heartbeat(
            engine_id=self.engine_id,
            bucket=self.bucket,
            epoch=self.epoch,
            model=self.model,
            namespace=self.namespace,
            page_size=self.page_size,
            context_len=self.context_len,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            running=self._running,
            waiting=self.waiting,
            inflight_tokens=self.inflight_tokens,
            interval_s=self.interval_s,
            role=self.role,
            token_usage=self.token_usage,
            evicted_device_pages=self.evicted_device_pages,
            card_digest=self.card.digest,
            store_id=self.store_id,
            bus_reconnects=self.bus_reconnects,
        )
        await self.nc.publish(subjects.heartbeat(self.engine_id), hb.encode())

    @property
    def card(self) -> ModelCard:
        return ModelCard(
            self.model,
            self.model,
            "json" if self.tokenizer_json else "bytes",
            self.tokenizer_json,
            self.chat_template,
            self.eos_token_ids,
            self.bos_token_id,
            self.context_len,
            self.vocab_size,
        )

    async def sync(self) -> None:
        """Round trip to the server: everything published to us before is delivered."""
        await barrier(self.nc)

    # ---------------------------------------------------------------- internals

    async def subscribe_role(self) -> None:
        """Subscribe to what only this role serves (nothing more for a colocated engine)."""

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if not self.silent:
                await self.beat()

    async def _on_generate(self, msg: Msg) -> None:
        if self.silent:
            return
        req = GenerateRequest.decode(msg.data)
        self.received.append(req)
        self._aborted.discard(req.request_id)  # a retry under the id of an aborted attempt
        if not self.mute_generate:
            self._spawn(self._generate(req))

    async def _generate(self, req: GenerateRequest) -> None:
        self._running += 1
        try:
            await self._stream(req.request_id, req.input_ids, req.sampling, req.reply_to)
        finally:
            self._running -= 1
            self._streams.pop(req.request_id, None)

    async def _stream(
        self,
        request_id: str,
        input_ids: list[int],
        sampling: Sampling,
        reply_to: str,
        first: dict[str, Any] | None = None,
    ) -> None:
        """Send the tokens of one request (`first`: extra fields of chunk 0)."""
        if self.error is not None:
            code, text = self.error
            await self._send(
                reply_to, _error_chunk(request_id, self.engine_id, code, text, self.crashed)
            )
            return
        tokens = expected_tokens(input_ids, sampling.max_new_tokens, self.vocab_size)
        eos = set() if sampling.ignore_eos else set(self.eos_token_ids)
        stops = set(sampling.stop_token_ids) | eos
        for i, t in enumerate(tokens):
            if t in stops:
                tokens, reason = tokens[: i + 1], "stop"
                break
        else:
            reason = "length"
        batches = [
            tokens[i : i + self.tokens_per_chunk]
            for i in range(0, len(tokens), self.tokens_per_chunk)
        ]
        batches = batches or [[]]
        for seq, batch in enumerate(batches):
            if self.token_delay_s:
                await self._busy(request_id, reply_to, self.token_delay_s)
            if request_id in self._aborted:
                return
            last = seq == len(batches) - 1
            fields: dict[str, Any] = {
                "prompt_tokens": len(input_ids),
                "cached_device": self.cached_device,
                "cached_host": self.cached_host,
                "finished": last,
                "finish_reason": reason if last else None,
            }
            if seq == 0 and first:
                fields |= first
            if sampling.logprobs is not None:
                start = seq * self.tokens_per_chunk
                positions = range(start, start + len(batch))
                fields["logprobs"] = [-(i + 1) / 10 for i in positions]
                top = [
                    expected_top(t, i, sampling.logprobs)
                    for i, t in zip(positions, batch, strict=True)
                ]
                fields["top_logprob_ids"] = [[t for t, _ in pairs] for pairs in top]
                fields["top_logprobs"] = [[v for _, v in pairs] for pairs in top]
            chunk = TokenChunk(request_id, seq, batch, self.engine_id, **fields)
            if not await self._send(reply_to, chunk):
                return

    async def _busy(self, request_id: str, reply_to: str, seconds: float) -> None:
        """Work on a request for `seconds`, with a Progress every `progress_every_s`."""
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while (left := end - loop.time()) > 0:
            await asyncio.sleep(min(left, self.progress_every_s or left))
            if self.progress_every_s and not self.silent and loop.time() < end:
                progress = Progress(request_id, self.engine_id, "computing")
                await self.nc.publish(reply_to, progress.encode())

    async def _send(self, reply_to: str, chunk: TokenChunk) -> bool:
        if self.silent:
            return False
        if chunk.finished:
            self._streams.pop(chunk.request_id, None)
        else:
            self._streams[chunk.request_id] = (reply_to, chunk.seq + 1)
        if self.lose_chunks_from is None or chunk.seq < self.lose_chunks_from:
            await self.nc.publish(reply_to, chunk.encode())
        self._chunks_sent += 1
        if self.silent_after_chunks is not None and self._chunks_sent >= self.silent_after_chunks:
            self.silent = True
        return True

    async def _on_stream_check(self, msg: Msg) -> None:
        if self.silent:
            return
        check = StreamCheck.decode(msg.data)
        reply_to, seq = self._streams.get(check.request_id, ("", 0))
        held = reply_to == check.reply_to
        state = StreamState(check.request_id, self.engine_id, held, seq if held else 0)
        await self.nc.publish(check.reply_to, state.encode())

    async def _on_abort(self, msg: Msg) -> None:
        request_id = AbortRequest.decode(msg.data).request_id
        self.aborts.append(request_id)
        self._aborted.add(request_id)

    async def _on_flush(self, msg: Msg) -> None:
        if self.silent:
            return
        self.flushes += 1
        message = "flushed" if self.flush_success else "requests are running"
        await msg.respond(FlushReply(self.engine_id, self.flush_success, message).encode())

    async def _on_card(self, msg: Msg) -> None:
        if self.silent or self.mute_card:
            return
        self.card_requests += 1
        await msg.respond((self.served_card or self.card).encode())

    async def _on_stats(self, msg: Msg) -> None:
        if self.silent:
            return
        self.stats_requests += 1
        reply = StatsReply(self.engine_id, self.bucket, self.epoch, {"device_pages": 7})
        await msg.respond(reply.encode())


def _error_chunk(
    request_id: str, engine_id: str, code: int, text: str, crashed: bool = False
) -> TokenChunk:
    return TokenChunk(
        request_id,
        0,
        [],
        engine_id,
        finished=True,
        error=text,
        error_code=code,
        engine_crashed=crashed,
    )


@dataclass
class FakePrefill(FakeEngine):
    """The prefill role: one KV frame per `PrefillRequest`, or an error, or nothing."""

    role: str = "prefill"
    mute_prefill: bool = False  # heartbeats continue, prefill requests go unanswered
    prefill_error: tuple[int, str] | None = None  # report this error chunk instead
    lose_prefills: int = 0  # the first N prefill requests are lost on the bus (never seen)
    prefill_delay_s: float = 0.0  # computing before the frame goes out
    prefills: list[PrefillRequest] = field(default_factory=list)

    async def subscribe_role(self) -> None:
        await self.nc.subscribe(subjects.engine_prefill(self.engine_id), cb=self._on_prefill)

    async def _on_prefill(self, msg: Msg) -> None:
        if self.silent:
            return
        req = PrefillRequest.decode(msg.data)
        self.prefills.append(req)
        if self.lose_prefills > 0:
            self.lose_prefills -= 1
            return
        self._streams[req.request_id] = (req.reply_to, 0)  # held (and kept once delivered)
        if self.mute_prefill:
            return
        if self.prefill_error is not None:
            code, text = self.prefill_error
            await self.nc.publish(
                req.reply_to,
                _error_chunk(req.request_id, self.engine_id, code, text, self.crashed).encode(),
            )
            return
        if self.prefill_delay_s:
            await self._busy(req.request_id, req.reply_to, self.prefill_delay_s)
        first_token = expected_tokens(req.input_ids, 1, self.vocab_size)[0]
        start, end = req.decode_prefix_len, len(req.input_ids)
        header = KVFrameHeader(
            req.request_id,
            0,
            start,
            end,
            first_token=first_token,
            last=True,
            prefill_cached_device=self.cached_device,
            prefill_cached_host=self.cached_host,
        )
        frame = encode_frame(header, bytes((end - start) * KV_BYTES_PER_TOKEN))
        headers = {"prefill-engine": self.engine_id}
        await self.nc.publish(req.kv_subject, frame, headers=headers)


@dataclass
class FakeDecode(FakeEngine):
    """The decode role: admits, waits for the KV frame, then streams like FakeEngine.

    Its own reuse is `cached_device + cached_host` tokens, cut to whole pages of the prompt.
    """

    role: str = "decode"
    restore_fails_once: bool = False  # the first request that gets its KV fails with 409
    admit_error: tuple[int, str] | None = None  # refuse admits with this error
    lose_admits: int = 0  # the first N admits are lost on the bus (never answered)
    admit_delay_s: float = 0.0  # admissions wait this long (a decode engine out of pages)
    admits: list[DecodeAdmit] = field(default_factory=list)
    kv_frames: list[KVFrameHeader] = field(default_factory=list)
    _admitted: dict[str, tuple[DecodeAdmit, int]] = field(default_factory=dict)
    _admitting: dict[str, asyncio.Future[bytes]] = field(default_factory=dict)
    _admit_sub: Subscription | None = None
    _restore_failed: bool = False

    async def subscribe_role(self) -> None:
        await self.subscribe_admits()
        await self.nc.subscribe(subjects.engine_kv(self.engine_id), cb=self._on_kv)

    async def subscribe_admits(self) -> None:
        subject = subjects.engine_decode_admit(self.engine_id)
        self._admit_sub = await self.nc.subscribe(subject, cb=self._on_admit)
        await barrier(self.nc)

    async def unsubscribe_admits(self) -> None:
        """As an engine whose NATS connection has not come back yet: no responders."""
        if self._admit_sub is not None:
            await self._admit_sub.unsubscribe()
            self._admit_sub = None
            await barrier(self.nc)  # else the server may route admits here, to be dropped

    async def _on_admit(self, msg: Msg) -> None:
        if self.silent:
            return
        req = DecodeAdmit.decode(msg.data)
        self.admits.append(req)
        if self.lose_admits > 0:
            self.lose_admits -= 1
            return
        if self.admit_error is not None:
            code, text = self.admit_error
            reply = DecodeAdmitReply(
                req.request_id, self.engine_id, 0, "", error=text, error_code=code
            )
            await msg.respond(reply.encode())
            return
        if self.admit_delay_s:  # delayed once per request id; copies get the same answer
            answer = self._admitting.get(req.request_id)
            if answer is None:
                answer = self._admitting[req.request_id] = asyncio.Future()
                self._spawn(self._admit_later(req, answer))
            self._spawn(self._respond(msg, answer))
            return
        await msg.respond(self._admit(req))

    async def _admit_later(self, req: DecodeAdmit, answer: asyncio.Future[bytes]) -> None:
        await self._busy(req.request_id, req.reply_to, self.admit_delay_s)
        answer.set_result(self._admit(req))

    @staticmethod
    async def _respond(msg: Msg, answer: asyncio.Future[bytes]) -> None:
        await msg.respond(await asyncio.shield(answer))

    def _admit(self, req: DecodeAdmit) -> bytes:
        """Admit `req` now: the DecodeAdmitReply."""
        reused = self.cached_device + self.cached_host if req.reuse else 0
        prefix_len = min(reused, len(req.input_ids)) // self.page_size * self.page_size
        self._admitted[req.request_id] = (req, prefix_len)
        self._streams[req.request_id] = (req.reply_to, 0)  # held from admission, as engines do
        self._spawn(self._transfer_timeout(req))
        reply = DecodeAdmitReply(
            req.request_id,
            self.engine_id,
            prefix_len,
            subjects.engine_kv(self.engine_id),
            cached_device=min(self.cached_device, prefix_len) if req.reuse else 0,
            cached_host=prefix_len - min(self.cached_device, prefix_len) if req.reuse else 0,
        )
        return reply.encode()

    async def _transfer_timeout(self, req: DecodeAdmit) -> None:
        await asyncio.sleep(req.transfer_timeout_s)
        if self._admitted.pop(req.request_id, None) and req.request_id not in self._aborted:
            text = "KV transfer timed out"
            await self._send(req.reply_to, _error_chunk(req.request_id, self.engine_id, 503, text))

    async def _on_kv(self, msg: Msg) -> None:
        if self.silent:
            return
        header, payload = decode_frame(msg.data)
        self.kv_frames.append(header)
        admitted = self._admitted.pop(header.request_id, None)
        if admitted is None or header.request_id in self._aborted:
            return
        req, prefix_len = admitted
        if self.restore_fails_once and not self._restore_failed:
            self._restore_failed = True
            text = "restore lost pages"
            await self._send(req.reply_to, _error_chunk(req.request_id, self.engine_id, 409, text))
            return
        own_device = min(self.cached_device, prefix_len)
        first = {
            "cached_device": own_device,
            "cached_host": prefix_len - own_device,
            "decode_prefix_len": prefix_len,
            "transferred_tokens": header.token_end - header.token_start,
            "transferred_bytes": len(payload),
            "prefill_engine_id": (msg.headers or {}).get("prefill-engine", ""),
            "prefill_cached_device": header.prefill_cached_device,
            "prefill_cached_host": header.prefill_cached_host,
        }
        self._spawn(self._stream(req.request_id, req.input_ids, req.sampling, req.reply_to, first))


FAKES: dict[str, type[FakeEngine]] = {
    "colocated": FakeEngine,
    "prefill": FakePrefill,
    "decode": FakeDecode,
}


# -------------------------------------------------------------------- a router on top


@dataclass
class Mesh:
    client: TestClient[Any, Any]
    engines: list[FakeEngine]
    config: RouterConfig

    @property
    def prefills(self) -> list[FakePrefill]:
        return [e for e in self.engines if isinstance(e, FakePrefill)]

    @property
    def decodes(self) -> list[FakeDecode]:
        return [e for e in self.engines if isinstance(e, FakeDecode)]

    @property
    def colocated(self) -> list[FakeEngine]:
        return [e for e in self.engines if e.role == "colocated"]

    @property
    def router_nc(self) -> NATS:
        return self.client.app[NATS_KEY]

    async def sync(self) -> None:
        """Everything the router published so far has reached the engines."""
        await barrier(self.router_nc)
        for e in self.engines:
            if e._nc is not None:
                await e.sync()

    async def wait_for_engines(self, n: int, timeout_s: float = 5.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            resp = await self.client.get("/health", headers=self.auth)
            body = await resp.json()
            if len(body.get("ready_engines", [])) == n:
                return
            assert asyncio.get_running_loop().time() < deadline, f"engines not live: {body}"
            await asyncio.sleep(0.02)

    async def wait_for_ready(self, engine_ids: list[str], timeout_s: float = 5.0) -> None:
        """Until exactly `engine_ids` are ready (live, their model card held)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            body = await (await self.client.get("/health", headers=self.auth)).json()
            if sorted(body.get("ready_engines", [])) == sorted(engine_ids):
                return
            assert asyncio.get_running_loop().time() < deadline, f"engines not ready: {body}"
            await asyncio.sleep(0.02)

    @property
    def auth(self) -> dict[str, str]:
        key = self.config.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}


@contextlib.asynccontextmanager
async def running_mesh(
    nats_url: str,
    redis_url: str,
    num_engines: int = 2,
    engine_kw: dict[str, Any] | None = None,
    roles: Sequence[str] = (),
    **config_kw: Any,
) -> AsyncIterator[Mesh]:
    """`num_engines` FakeEngines (ids `<tag>-a`, `<tag>-b`, ...) and a router app served
    over real HTTP; the router sees every engine live before this yields. With `roles`, one
    engine per role listed instead (FakeEngine, FakePrefill or FakeDecode)."""
    tag = uuid.uuid4().hex[:6]
    kw = {"namespace": f"ns-{tag}"} | (engine_kw or {})
    roles = list(roles) or ["colocated"] * num_engines
    engines = [FAKES[role](f"e{tag}-{chr(97 + i)}", nats_url, **kw) for i, role in enumerate(roles)]
    config_kw = {"request_timeout_s": 5.0, "liveness_poll_s": 0.05} | config_kw
    config = RouterConfig(nats_url=nats_url, redis_url=redis_url, **config_kw)
    client: TestClient[Any, Any] = TestClient(TestServer(init(config)))
    try:
        await client.start_server()
        for e in engines:
            await e.start()
        mesh = Mesh(client, engines, config)
        await mesh.wait_for_engines(len(engines))
        yield mesh
    finally:
        await client.close()
        for e in engines:
            await e.stop()


async def read_sse(resp: Any) -> tuple[list[dict[str, Any]], bool]:
    """The JSON events of an SSE response, and whether it ended with `data: [DONE]`."""
    events: list[dict[str, Any]] = []
    done = False
    raw = (await resp.read()).decode()
    for block in raw.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        assert not done, "event after [DONE]"
        if data == "[DONE]":
            done = True
        else:
            events.append(orjson.loads(data))
    return events, done
