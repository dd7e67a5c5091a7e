"""The engine service: one engine behind its NATS subjects.

It takes `GenerateRequest`s on its own subject (the router's cache-aware choice) and on its
bucket's subject (queue group: any engine of the bucket), streams `TokenChunk`s back,
answers flush/stats, publishes heartbeats and KV events (with an epoch that changes at
every start and a per-epoch batch sequence), and answers the index's snapshot requests.

Shutdown: stop taking work, let running requests finish for a grace period, fail the rest
with a clear error, then drain NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bus_schemas import (
    AbortRequest,
    ErrorReply,
    FlushReply,
    GenerateRequest,
    Heartbeat,
    KVEvent,
    KVEventBatch,
    SchemaError,
    SnapshotRequest,
    StatsReply,
    TokenChunk,
    make_namespace,
)
from bus_schemas import subjects as subj
from gpu_worker.engine.engine import Engine, EngineConfig, InvalidRequestError
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.scheduler.request import CachedTokens, KVExport
from services.engine.pd import DecodeSide, PDConfig, PrefillSide
from services.engine.runner import EngineRunner, TokenUpdate
from services.tasks import OwnedTasks

log = logging.getLogger(__name__)

ROLES = ("colocated", "prefill", "decode")


@dataclass(frozen=True, slots=True)
class EngineServiceConfig:
    engine_id: str
    nats_url: str
    bucket: str = "default"
    role: str = "colocated"
    heartbeat_interval_s: float = 1.0
    shutdown_grace_s: float = 10.0
    pd: PDConfig = field(default_factory=PDConfig)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not subj.valid_token(self.engine_id) or not subj.valid_token(self.bucket):
            raise ValueError("--engine-id and --bucket may hold only letters, digits, '-', '_'")
        if self.heartbeat_interval_s <= 0:
            raise ValueError("--heartbeat-interval must be positive")


@dataclass(slots=True)
class _Stream:
    reply_to: str
    seq: int = 0


class EngineService:
    def __init__(self, config: EngineServiceConfig, engine_config: EngineConfig) -> None:
        self.config = config
        self.engine_config = engine_config
        self.epoch = str(time.time_ns())
        self.namespace = make_namespace(
            engine_config.model, engine_config.dtype, engine_config.cache.page_size
        )
        self._nc: NATS | None = None
        self._runner: EngineRunner | None = None
        self._streams: dict[str, _Stream] = {}
        self._work_subs: list[Subscription] = []
        self._tasks = OwnedTasks()
        self._outbound: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
        self._event_seq = 0
        self._accepting = False
        self._meta: dict[str, int] = {}
        self._decode: DecodeSide | None = None
        self._prefill: PrefillSide | None = None

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._runner = EngineRunner(self.engine_config, loop, self)
        await asyncio.wrap_future(self._runner.start())
        engine = self._engine_now()
        mc = engine.model_config
        self._meta = {"context_len": engine.context_len, "vocab_size": mc.vocab_size}
        self._eos = list(mc.eos_token_ids)
        self._nc = await nats.connect(
            self.config.nats_url,
            name=f"engine-{self.config.engine_id}",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
        )
        nc, eid = self._nc, self.config.engine_id
        self._work_subs = await self._subscribe_work(nc, eid)
        await nc.subscribe(subj.engine_abort(eid), cb=self._on_abort)
        await nc.subscribe(subj.engine_flush(eid), cb=self._on_flush)
        await nc.subscribe(subj.FLUSH_ALL, cb=self._on_flush)
        await nc.subscribe(subj.engine_stats(eid), cb=self._on_stats)
        await nc.subscribe(subj.engine_snapshot(eid), cb=self._on_snapshot)
        self._accepting = True
        self._tasks.spawn(self._publisher(), "publisher")
        self._tasks.spawn(self._heartbeats(), "heartbeats")
        await self._publish_snapshot()  # epoch starts with what the engine holds (nothing)
        log.info("engine %s up (bucket %s, epoch %s)", eid, self.config.bucket, self.epoch)

    async def _subscribe_work(self, nc: NATS, eid: str) -> list[Subscription]:
        role, runner = self.config.role, self._runner
        assert runner is not None
        if role == "decode":
            self._decode = DecodeSide(
                eid, runner, self._publish_raw, self._open_stream, self._fail_stream
            )
            return [
                await nc.subscribe(subj.engine_decode_admit(eid), cb=self._decode.on_admit),
                await nc.subscribe(subj.engine_kv(eid), cb=self._decode.on_frame),
            ]
        if role == "prefill":
            self._prefill = PrefillSide(
                eid,
                runner,
                self._publish_raw,
                self.config.pd,
                self._open_stream,
                self._fail_stream,
                self._close_stream,
            )
            return [
                await nc.subscribe(subj.engine_prefill(eid), cb=self._prefill.on_prefill),
                await nc.subscribe(subj.engine_kv_ack(eid), cb=self._prefill.on_ack),
            ]
        return [
            await nc.subscribe(subj.engine_generate(eid), cb=self._on_generate),
            await nc.subscribe(
                subj.bucket_generate(self.config.bucket),
                queue=subj.bucket_queue(self.config.bucket),
                cb=self._on_generate,
            ),
        ]

    async def _publish_raw(self, subject: str, data: bytes, reply: str = "") -> None:
        assert self._nc is not None
        await self._nc.publish(subject, data, reply=reply)

    def _open_stream(self, request_id: str, reply_to: str) -> None:
        self._streams[request_id] = _Stream(reply_to)

    def _close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def _fail_stream(self, request_id: str, message: str, code: int) -> None:
        """End a request with an error chunk (or silently, with an empty message)."""
        if not message:
            self._streams.pop(request_id, None)
            if self._runner is not None:
                self._runner.abort(request_id)
            return
        self._send_error(request_id, message, code)

    def exported(self, request_id: str, export: KVExport, cached: CachedTokens) -> None:
        """Runner callback (on the loop): P/D prefill KV is packed."""
        if self._prefill is not None:
            self._prefill.exported(request_id, export, cached)

    async def stop(self) -> None:
        """Stop taking work, finish or fail in-flight requests, drain NATS."""
        self._accepting = False
        for sub in self._work_subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        deadline = time.monotonic() + self.config.shutdown_grace_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self._send_error(request_id, "engine shutting down", 503)
        for side in (self._decode, self._prefill):
            if side is not None:
                await side.stop()
        if self._runner is not None:
            await asyncio.to_thread(self._runner.stop)
        await self._outbound.join()
        await self._tasks.cancel_all()
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.drain()

    def _engine_now(self) -> Engine:
        assert self._runner is not None and self._runner.engine is not None
        return self._runner.engine

    # ----------------------------------------------------------------- requests

    async def _on_generate(self, msg: Msg) -> None:
        try:
            req = GenerateRequest.decode(msg.data)
        except SchemaError as e:
            log.warning("bad GenerateRequest: %s", e)
            if msg.reply:
                await self._publish_now(msg.reply, ErrorReply(str(e)).encode())
            return
        if not self._accepting:
            self._send_chunk(req.reply_to, req.request_id, 0, error=("engine shutting down", 503))
            return
        if req.request_id in self._streams:
            self._send_chunk(req.reply_to, req.request_id, 0, error=("duplicate id", 400))
            return
        s = req.sampling
        try:
            sampling = SamplingParams(
                s.max_new_tokens,
                s.temperature,
                s.top_p,
                s.seed,
                tuple(s.stop_token_ids),
                s.ignore_eos,
            )
        except ValueError as e:
            self._send_chunk(req.reply_to, req.request_id, 0, error=(str(e), 400))
            return
        assert self._runner is not None
        self._streams[req.request_id] = _Stream(req.reply_to)
        try:
            await asyncio.wrap_future(
                self._runner.submit(req.request_id, req.input_ids, sampling, req.cache_salt)
            )
        except InvalidRequestError as e:
            self._send_error(req.request_id, str(e), 400)

    async def _on_abort(self, msg: Msg) -> None:
        try:
            req = AbortRequest.decode(msg.data)
        except SchemaError as e:
            log.warning("bad AbortRequest: %s", e)
            return
        if self._runner is not None and req.request_id in self._streams:
            self._runner.abort(req.request_id)

    def tokens(self, updates: list[TokenUpdate]) -> None:
        """Runner callback (on the loop): forward new tokens to each request's stream."""
        for u in updates:
            stream = self._streams.get(u.request_id)
            if stream is None:
                continue
            reason = None if u.error else u.finish_reason
            chunk = TokenChunk(
                u.request_id,
                stream.seq,
                u.token_ids,
                self.config.engine_id,
                u.prompt_tokens,
                u.cached_device,
                u.cached_host,
                u.finished,
                reason,
                u.error[0] if u.error else None,
                u.error[1] if u.error else 0,
            )
            transfer = self._decode.transfers.get(u.request_id) if self._decode else None
            if transfer is not None and u.received is not None and stream.seq == 0:
                prefix_len, tokens_in, bytes_in = u.received
                chunk = dataclasses.replace(
                    chunk,
                    decode_prefix_len=prefix_len,
                    transferred_tokens=tokens_in,
                    transferred_bytes=bytes_in,
                    prefill_engine_id=transfer.prefill_engine_id,
                    prefill_cached_device=transfer.prefill_cached.device,
                    prefill_cached_host=transfer.prefill_cached.host,
                )
            stream.seq += 1
            self._outbound.put_nowait((stream.reply_to, chunk.encode()))
            if u.finished:
                del self._streams[u.request_id]
                if self._decode is not None:
                    self._decode.finished(u.request_id)

    def _send_chunk(self, reply_to: str, request_id: str, seq: int, error: tuple[str, int]) -> None:
        chunk = TokenChunk(
            request_id,
            seq,
            [],
            self.config.engine_id,
            finished=True,
            error=error[0],
            error_code=error[1],
        )
        self._outbound.put_nowait((reply_to, chunk.encode()))

    def _send_error(self, request_id: str, message: str, code: int) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._send_chunk(stream.reply_to, request_id, stream.seq, (message, code))
            if self._runner is not None:
                self._runner.abort(request_id)

    # ----------------------------------------------------------------- control

    async def _on_flush(self, msg: Msg) -> None:
        assert self._runner is not None
        ok = await asyncio.wrap_future(self._runner.call(lambda e: e.flush_cache()))
        text = "" if ok else "requests are running; flush refused"
        if msg.reply:
            reply = FlushReply(self.config.engine_id, bool(ok), text)
            await self._publish_now(msg.reply, reply.encode())

    async def _on_stats(self, msg: Msg) -> None:
        assert self._runner is not None
        stats = await asyncio.wrap_future(self._runner.call(lambda e: e.cache_stats()))
        if msg.reply:
            ints = {k: int(v) for k, v in stats.items()}
            reply = StatsReply(self.config.engine_id, self.config.bucket, self.epoch, ints)
            await self._publish_now(msg.reply, reply.encode())

    async def _on_snapshot(self, msg: Msg) -> None:
        try:
            SnapshotRequest.decode(msg.data)
        except SchemaError as e:
            log.warning("bad SnapshotRequest: %s", e)
            return
        await self._publish_snapshot()

    async def _publish_snapshot(self) -> None:
        assert self._runner is not None
        events = await asyncio.wrap_future(self._runner.call(lambda e: e.cache.snapshot_events()))
        self._enqueue_events(events, snapshot=True)

    def kv_events(self, events: list[tuple[str, str, list[str]]]) -> None:
        """Runner callback (on the loop): publish tree changes to the index."""
        self._enqueue_events(events, snapshot=False)

    def _enqueue_events(self, events: list[tuple[str, str, list[str]]], snapshot: bool) -> None:
        batch = KVEventBatch(
            self.config.engine_id,
            self.config.bucket,
            self.epoch,
            self._event_seq,
            self.namespace,
            [KVEvent(kind, tier, hashes) for kind, tier, hashes in events],
            snapshot,
        )
        self._event_seq += 1
        self._outbound.put_nowait((subj.KV_EVENTS, batch.encode()))

    # ----------------------------------------------------------------- background

    async def _publish_now(self, subject: str, data: bytes) -> None:
        assert self._nc is not None
        await self._nc.publish(subject, data)

    async def _publisher(self) -> None:
        """The one place that publishes streams and events, in the order they were made."""
        assert self._nc is not None
        while True:
            subject, data = await self._outbound.get()
            try:
                await self._nc.publish(subject, data)
            except Exception:
                log.exception("publish to %s failed", subject)
            finally:
                self._outbound.task_done()

    async def _heartbeats(self) -> None:
        assert self._nc is not None and self._runner is not None
        cfg = self.config
        while True:
            load = self._runner.load
            hb = Heartbeat(
                cfg.engine_id,
                cfg.bucket,
                self.epoch,
                self.engine_config.model,
                self.namespace,
                self.engine_config.cache.page_size,
                self._meta["context_len"],
                self._meta["vocab_size"],
                self._eos,
                load.running,
                load.waiting,
                load.inflight_tokens,
                cfg.heartbeat_interval_s,
                cfg.role,
            )
            with contextlib.suppress(Exception):
                await self._nc.publish(subj.HEARTBEAT, hb.encode())
            await asyncio.sleep(cfg.heartbeat_interval_s)
