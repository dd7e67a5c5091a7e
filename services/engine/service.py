"""The engine service: one engine behind its NATS subjects.

It takes `GenerateRequest`s on its own subject (the router's cache-aware choice) and on its
bucket's subject (queue group: any engine of the bucket), streams `TokenChunk`s back,
answers flush/stats, publishes heartbeats and KV events (with an epoch that changes at
every start and a per-epoch batch sequence), and answers the index's snapshot requests.

Shutdown: stop taking work, let running requests finish for a grace period, fail the rest
with a clear error, then drain NATS. Every step of it has a deadline, so SIGTERM stops the
engine within `shutdown_grace_s` plus a few seconds even while NATS is unreachable.

Crash: when the engine's step loop dies (`crashed`), the service stops heartbeating at
once, fails every request it holds with an error chunk marked `engine_crashed` (the router
retries none of them: one may have caused it) or, when a rank was killed from outside,
with a 503 (retried elsewhere if no token went out), and sets `crashed_reason`: the
process then exits non-zero, and its supervisor starts a fresh engine (new epoch).

NATS: the first connect is retried with backoff until it succeeds (a supervisor may start
engines before nats-server), as are reconnects; each failed attempt logs one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    Progress,
    SchemaError,
    SnapshotRequest,
    StatsReply,
    StreamCheck,
    StreamState,
    TokenChunk,
)
from bus_schemas import subjects as subj
from bus_schemas.connection import Backoff, Credentials, connect_nats
from bus_schemas.messages import MAX_HEARTBEAT_INTERVAL_S, MIN_HEARTBEAT_INTERVAL_S
from gpu_worker.engine.engine import Engine, EngineConfig, InvalidRequestError
from gpu_worker.scheduler.request import CachedTokens, KVExport, RequestError
from gpu_worker.storage import StorageBackend
from services.engine.card import build_card
from services.engine.pd import DecodeSide, PDConfig, PrefillSide
from services.engine.runner import EngineCrashedError, EngineRunner
from services.engine.sampling import sampling_params
from services.engine.updates import TokenUpdate
from services.tasks import OwnedTasks

log = logging.getLogger(__name__)

ROLES = ("colocated", "prefill", "decode")
NATS_BACKOFF_S = (0.1, 5.0)  # first and longest wait between NATS connect attempts
STOP_STEP_TIMEOUT_S = 2.0  # the longest one bus step of shutdown may take (flush, close)


@dataclass(frozen=True, slots=True)
class EngineServiceConfig:
    engine_id: str
    nats_url: str
    nats_credentials: Credentials | None = field(default=None, repr=False)  # user engine.{id}
    nats_tls_ca_file: str | None = None  # CA (PEM): TLS only, the server verified against it
    bucket: str = "default"
    role: str = "colocated"
    heartbeat_interval_s: float = 1.0
    shutdown_grace_s: float = 10.0
    pd: PDConfig = field(default_factory=PDConfig)
    served_model_name: str = ""  # default: the engine's --model value
    chat_template_file: Path | None = None  # --chat-template: instead of the model's own
    debug_crash_on_prompt_token: int | None = None  # test hook: the step loop dies on it

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not subj.valid_token(self.engine_id) or not subj.valid_token(self.bucket):
            raise ValueError("--engine-id and --bucket may hold only letters, digits, '-', '_'")
        lo, hi = MIN_HEARTBEAT_INTERVAL_S, MAX_HEARTBEAT_INTERVAL_S
        if not lo <= self.heartbeat_interval_s <= hi:
            raise ValueError(f"--heartbeat-interval must be in [{lo}, {hi}] seconds")


@dataclass(slots=True)
class _Stream:
    reply_to: str
    seq: int = 0
    # at the last progress round (`EngineService._progress`): chunks sent, KV received
    seen_seq: int = 0
    seen_received_len: int = 0


class EngineService:
    def __init__(self, config: EngineServiceConfig, engine_config: EngineConfig) -> None:
        self.config = config
        self.engine_config = engine_config
        self.epoch = str(time.time_ns())
        self.namespace = ""  # the engine's (with its weights digest), once started
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
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._bus_reconnects = 0  # heartbeats carry it: routers then check their streams
        self._failed_attempts = 0  # NATS attempts failed since the last (re)connect
        self.crashed_reason: str | None = None
        self.crashed_event = asyncio.Event()

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._runner = EngineRunner(
            self.engine_config,
            loop,
            self,
            debug_crash_on_token=self.config.debug_crash_on_prompt_token,
        )
        await asyncio.wrap_future(self._runner.start())
        engine = self._engine_now()
        self.namespace = engine.namespace
        mc = engine.model_config
        self._meta = {"context_len": engine.context_len, "vocab_size": mc.vocab_size}
        self._eos = list(mc.eos_token_ids)
        self.card = build_card(
            engine,
            self.config.served_model_name,
            self.config.chat_template_file,
        )
        self._card_bytes = self.card.encode()
        self._card_digest = self.card.digest  # heartbeats carry it
        storage = engine.cache.storage
        self._store_id = "" if storage is None else _store_id(storage.io.backend, storage.scope)
        self._nc = await self._connect()
        nc, eid = self._nc, self.config.engine_id
        self._work_subs = await self._subscribe_work(nc, eid)
        await nc.subscribe(subj.engine_abort(eid), cb=self._on_abort)
        await nc.subscribe(subj.engine_stream_check(eid), cb=self._on_stream_check)
        await nc.subscribe(subj.engine_flush(eid), cb=self._on_flush)
        await nc.subscribe(subj.FLUSH_ALL, cb=self._on_flush)
        await nc.subscribe(subj.engine_stats(eid), cb=self._on_stats)
        await nc.subscribe(subj.engine_snapshot(eid), cb=self._on_snapshot)
        await nc.subscribe(subj.engine_model_card(eid), cb=self._on_model_card)
        self._accepting = True
        self._tasks.spawn(self._publisher(), "publisher")
        self._heartbeat_task = self._tasks.spawn(self._heartbeats(), "heartbeats")
        self._tasks.spawn(self._progress(), "progress")
        await self._publish_snapshot()  # epoch starts with what the engine holds (nothing)
        log.info("engine %s up (bucket %s, epoch %s)", eid, self.config.bucket, self.epoch)

    async def _connect(self) -> NATS:
        """Connect to NATS, retrying (first connect and reconnects alike) with a doubling
        wait up to `NATS_BACKOFF_S[1]`; the wait starts over once connected."""
        nc = await connect_nats(
            self.config.nats_url,
            name=f"engine-{self.config.engine_id}",
            log=log,
            credentials=self.config.nats_credentials,
            tls_ca_file=self.config.nats_tls_ca_file,
            backoff=Backoff(*NATS_BACKOFF_S),
            error_cb=self._on_nats_error,
            disconnected_cb=self._on_nats_disconnected,
            reconnected_cb=self._on_nats_reconnected,
            drain_timeout=int(STOP_STEP_TIMEOUT_S),
            flush_timeout=STOP_STEP_TIMEOUT_S,  # a full buffer never blocks a publish forever
        )
        return nc

    async def _on_nats_error(self, e: Exception) -> None:
        """One line per failed attempt (nats.py's default logs a traceback); the wait is
        `connect_nats`' backoff, which starts over once connected."""
        wait = Backoff(*NATS_BACKOFF_S).delay(self._failed_attempts)
        self._failed_attempts += 1
        log.warning("NATS %s: %s (next attempt in %.1f s)", self.config.nats_url, _brief(e), wait)

    async def _on_nats_disconnected(self) -> None:
        if self._nc is not None and not (self._nc.is_closed or self._nc.is_draining):
            log.warning("NATS disconnected; reconnecting")

    async def _on_nats_reconnected(self) -> None:
        log.info("NATS reconnected")
        self._failed_attempts = 0
        self._bus_reconnects += 1
        if self._prefill is not None:
            self._prefill.reconnected()

    async def _subscribe_work(self, nc: NATS, eid: str) -> list[Subscription]:
        role, runner = self.config.role, self._runner
        assert runner is not None
        if role == "decode":
            self._decode = DecodeSide(
                eid,
                runner,
                self._publish_raw,
                self._open_stream,
                self._fail_stream,
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
                self.engine_config.parallel.tp_size,
                max_payload=self._max_payload,
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

    def _max_payload(self) -> int:
        """The largest message the NATS server takes (its INFO, as of the last connect)."""
        assert self._nc is not None
        return self._nc.max_payload

    async def _publish_raw(self, subject: str, data: bytes, reply: str = "") -> None:
        assert self._nc is not None
        await self._nc.publish(subject, data, reply=reply)

    def _open_stream(self, request_id: str, reply_to: str) -> None:
        self._streams[request_id] = _Stream(reply_to)

    def _close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def _fail_stream(self, request_id: str, message: str, code: int, crashed: bool = False) -> None:
        """End a request with an error chunk (or silently, with an empty message)."""
        if not message:
            self._streams.pop(request_id, None)
            if self._runner is not None:
                self._runner.abort(request_id)
            return
        self._send_error(request_id, message, code, crashed)

    def exported(self, request_id: str, export: KVExport, cached: CachedTokens) -> None:
        """Runner callback (on the loop): P/D prefill KV is packed."""
        if self._prefill is not None:
            self._prefill.exported(request_id, export, cached)

    async def stop(self) -> None:
        """Stop taking work, finish or fail in-flight requests, drain NATS.

        Running requests get `shutdown_grace_s`; every bus step after that has its own
        short timeout, so this returns even when NATS is unreachable."""
        self._accepting = False
        await _bounded(
            asyncio.gather(*(sub.unsubscribe() for sub in self._work_subs)), "unsubscribe"
        )
        deadline = time.monotonic() + self.config.shutdown_grace_s
        while self._streams and time.monotonic() < deadline and self.crashed_reason is None:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self._send_error(request_id, "engine shutting down", 503)
        for side in (self._decode, self._prefill):
            if side is not None:
                await _bounded(side.stop(), "P/D shutdown")
        if self._runner is not None:
            await asyncio.to_thread(self._runner.stop, STOP_STEP_TIMEOUT_S)
        await self._close_bus()

    async def _close_bus(self) -> None:
        """Publish what is queued, then drain NATS; each step bounded in time."""
        await _bounded(self._outbound.join(), "publishing the last messages")
        await self._tasks.cancel_all()
        nc = self._nc
        if nc is None or nc.is_closed:
            return
        # drain() can outlast any timeout around it (it flushes again once cancelled), so
        # only a server that answers a bounded flush gets drained; else the socket is closed
        responsive = nc.is_connected and await _bounded(
            nc.flush(timeout=int(STOP_STEP_TIMEOUT_S)), "NATS flush"
        )
        if responsive and await _bounded(nc.drain(), "NATS drain", 3 * STOP_STEP_TIMEOUT_S):
            return
        await _bounded(nc.close(), "NATS close")

    def crashed(self, reason: str, suspect: bool) -> None:
        """Runner callback (on the loop): the step loop died. Stop heartbeating now, fail
        every request held, and let the process exit. When a request may have caused it
        (`suspect`) each gets an `engine_crashed` 500, never retried elsewhere; otherwise
        (a rank killed from outside) a 503 the router retries on another engine."""
        if self.crashed_reason is not None:
            return
        log.error("engine %s crashed, failing all requests: %s", self.config.engine_id, reason)
        self.crashed_reason = reason
        self._accepting = False
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        for request_id in list(self._streams):
            self._send_error(request_id, reason, 500 if suspect else 503, crashed=suspect)
        self.crashed_event.set()

    async def abandon(self) -> None:
        """After a crash: deliver the error chunks (bounded in time) and close the bus."""
        for side in (self._decode, self._prefill):
            if side is not None:
                await _bounded(side.stop(), "P/D shutdown")
        await self._close_bus()

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
        if not self._accepting:  # stopping, or crashed before this request came: retriable
            error = RequestError(self.crashed_reason or "engine shutting down", 503)
            self._send_chunk(req.reply_to, req.request_id, 0, error=error)
            return
        if req.request_id in self._streams:
            error = RequestError("duplicate id", 400)
            self._send_chunk(req.reply_to, req.request_id, 0, error=error)
            return
        try:
            sampling = sampling_params(req.sampling)
        except ValueError as e:
            self._send_chunk(req.reply_to, req.request_id, 0, error=RequestError(str(e), 400))
            return
        assert self._runner is not None
        self._streams[req.request_id] = _Stream(req.reply_to)
        try:
            await asyncio.wrap_future(
                self._runner.submit(req.request_id, req.input_ids, sampling, req.cache_salt)
            )
        except InvalidRequestError as e:
            self._send_error(req.request_id, str(e), 400)
        except EngineCrashedError as e:  # 500 when it held the request, else retriable
            self._send_error(req.request_id, str(e), 500 if e.held else 503, crashed=e.held)
        except Exception as e:  # the runner isolated it to this request's command
            self._send_error(req.request_id, f"engine error: {e}", 500)

    async def _on_abort(self, msg: Msg) -> None:
        try:
            req = AbortRequest.decode(msg.data)
        except SchemaError as e:
            log.warning("bad AbortRequest: %s", e)
            return
        if self._runner is not None and req.request_id in self._streams:
            self._runner.abort(req.request_id)

    async def _on_stream_check(self, msg: Msg) -> None:
        """A router asks whether its stream survived a reconnect: the answer follows every
        chunk already queued on the same subject, so the router can count what it lost."""
        try:
            check = StreamCheck.decode(msg.data)
        except SchemaError as e:
            log.warning("bad StreamCheck: %s", e)
            return
        stream = self._streams.get(check.request_id)
        held = stream is not None and stream.reply_to == check.reply_to
        if not held and self._prefill is not None:  # P/D prefill: its KV went out already
            held = self._prefill.delivered(check.request_id, check.reply_to)
        seq = stream.seq if stream is not None and held else 0
        state = StreamState(check.request_id, self.config.engine_id, held, seq)
        self._outbound.put_nowait((check.reply_to, state.encode()))

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
                prompt_tokens=u.prompt_tokens,
                cached_device=u.cached_device,
                cached_host=u.cached_host,
                finished=u.finished,
                finish_reason=reason,
                error=u.error.message if u.error else None,
                error_code=u.error.code if u.error else 0,
                cached_storage=u.cached_storage,
                logprobs=[lp for lp, _ in u.logprobs],
                top_logprob_ids=[[i for i, _ in top] for _, top in u.logprobs],
                top_logprobs=[[v for _, v in top] for _, top in u.logprobs],
            )
            transfer = self._decode.transfers.get(u.request_id) if self._decode else None
            if transfer is not None and u.received is not None and stream.seq == 0:
                chunk = dataclasses.replace(
                    chunk,
                    decode_prefix_len=u.received.prefix_len,
                    transferred_tokens=u.received.num_tokens,
                    transferred_bytes=u.received.num_bytes,
                    prefill_engine_id=transfer.prefill_engine_id,
                    prefill_cached_device=transfer.prefill_cached.device,
                    prefill_cached_host=transfer.prefill_cached.host,
                    prefill_cached_storage=transfer.prefill_cached.storage,
                )
            stream.seq += 1
            self._outbound.put_nowait((stream.reply_to, chunk.encode()))
            if u.finished:
                del self._streams[u.request_id]
                if self._decode is not None:
                    self._decode.finished(u.request_id)
                if self._prefill is not None:  # it failed or was aborted: no KV to send
                    self._prefill.finished(u.request_id)

    def _send_chunk(
        self,
        reply_to: str,
        request_id: str,
        seq: int,
        error: RequestError,
        crashed: bool = False,
    ) -> None:
        chunk = TokenChunk(
            request_id,
            seq,
            [],
            self.config.engine_id,
            finished=True,
            error=error.message,
            error_code=error.code,
            engine_crashed=crashed,
        )
        self._outbound.put_nowait((reply_to, chunk.encode()))

    def _send_error(self, request_id: str, message: str, code: int, crashed: bool = False) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            error = RequestError(message, code)
            self._send_chunk(stream.reply_to, request_id, stream.seq, error, crashed)
            if self._runner is not None:
                self._runner.abort(request_id)

    # ----------------------------------------------------------------- control

    async def _on_flush(self, msg: Msg) -> None:
        assert self._runner is not None
        ok = await asyncio.wrap_future(self._runner.flush())
        text = "" if ok else "requests are running; flush refused"
        if msg.reply:
            reply = FlushReply(self.config.engine_id, bool(ok), text)
            await self._publish_now(msg.reply, reply.encode())

    async def _on_stats(self, msg: Msg) -> None:
        assert self._runner is not None
        stats = await asyncio.wrap_future(self._runner.query(lambda e: e.cache_stats()))
        if msg.reply:
            ints = {k: int(v) for k, v in stats.items()}
            reply = StatsReply(self.config.engine_id, self.config.bucket, self.epoch, ints)
            await self._publish_now(msg.reply, reply.encode())

    async def _on_model_card(self, msg: Msg) -> None:
        if msg.reply:
            await self._publish_now(msg.reply, self._card_bytes)

    async def _on_snapshot(self, msg: Msg) -> None:
        try:
            SnapshotRequest.decode(msg.data)
        except SchemaError as e:
            log.warning("bad SnapshotRequest: %s", e)
            return
        await self._publish_snapshot()

    async def _publish_snapshot(self) -> None:
        assert self._runner is not None
        events = await asyncio.wrap_future(
            self._runner.query(lambda e: e.cache.tree.snapshot_events())
        )
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
            self._store_id,
        )
        self._event_seq += 1
        self._outbound.put_nowait((subj.kv_events(self.config.engine_id), batch.encode()))

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
            except Exception as e:  # NATS down and its buffer full: this message is lost
                log.warning("publish to %s failed: %s", subject, _brief(e))
            finally:
                self._outbound.task_done()

    def _cache_gauges(self) -> dict[str, Any]:
        """The heartbeat's cache fields, from `engine.cache_stats()`: plain counters the
        runner thread keeps, read here without a lock (a heartbeat may be one step stale)."""
        engine = self._runner.engine if self._runner is not None else None
        if engine is None:
            return {}
        s = engine.cache_stats()
        device_used = s["device_pages"] - s["device_pages_free"]
        host_pages = s["host_pages"]
        return {
            "token_usage": device_used / max(1, s["device_pages"]),
            "host_token_usage": s["host_pages_cached"] / host_pages if host_pages else 0.0,
            "cached_tokens": s["cached_tokens_device"]
            + s["cached_tokens_host"]
            + s["cached_tokens_storage"],
            "storage_pages_read": s["storage_pages_read"],
            "storage_pages_written": s["storage_pages_written"],
            "storage_write_failures": s.get("storage_write_failures", 0),
            "storage_quarantined": s.get("storage_quarantined", 0),
            "num_loads": s["loads"],
            "num_backups": s["backups"],
            "evicted_device_pages": s["evicted_device_pages"],
            "evicted_host_pages": s["evicted_host_pages"],
        }

    async def _heartbeats(self) -> None:
        assert self._nc is not None and self._runner is not None
        cfg = self.config
        since, generated = time.monotonic(), self._runner.generated_tokens
        while self.crashed_reason is None:  # a crashed engine never announces itself
            load = self._runner.load
            now, total = time.monotonic(), self._runner.generated_tokens
            throughput = (total - generated) / max(now - since, 1e-6)
            since, generated = now, total
            hb = Heartbeat(
                cfg.engine_id,
                cfg.bucket,
                self.epoch,
                self.card.served_model_name,
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
                **self._cache_gauges(),
                card_digest=self._card_digest,
                store_id=self._store_id,
                bus_reconnects=self._bus_reconnects,
                generation_tokens=total,
                gen_throughput=throughput,
            )
            with contextlib.suppress(Exception):
                await self._nc.publish(subj.heartbeat(self.config.engine_id), hb.encode())
            await asyncio.sleep(cfg.heartbeat_interval_s)

    async def _progress(self) -> None:
        """Every heartbeat interval, a `Progress` for each request the engine works on but
        has sent no chunk of since the last round, so the router's deadline (and, from a
        P/D prefill engine, the decode engine's KV watchdog) runs only while it does not:
        a long prefill is not a hang. Working means the engine computed (a decoder layer,
        within a step too: `Engine.progress`) for a queued or computing request, and wrote
        more of its KV for a receiving one. A hung step loop sends none while heartbeats
        go on, so the router still times it out."""
        assert self._runner is not None
        runner, engine = self._runner, self._engine_now()
        interval = self.config.heartbeat_interval_s
        last = engine.progress
        while self.crashed_reason is None:
            await asyncio.sleep(interval)
            now = engine.progress
            moved, last = now != last, now
            for request_id, holding in runner.holding().items():
                stream = self._streams.get(request_id)
                if stream is None:
                    continue
                quiet, stream.seen_seq = stream.seq == stream.seen_seq, stream.seq
                working = moved
                if holding.state == "receiving":
                    working = holding.received_len != stream.seen_received_len
                    stream.seen_received_len = holding.received_len
                if quiet and working:
                    self._send_progress(request_id, stream, holding.state)

    def _send_progress(self, request_id: str, stream: _Stream, state: str) -> None:
        data = Progress(request_id, self.config.engine_id, state).encode()
        self._outbound.put_nowait((stream.reply_to, data))
        kv_subject = self._prefill.kv_subject(request_id) if self._prefill is not None else None
        if kv_subject is not None:  # P/D prefill: the decode engine waits for this KV
            self._outbound.put_nowait((kv_subject, data))


def _store_id(backend: StorageBackend, scope: str) -> str:
    """What heartbeats and storage KV events name the engine's store by: the store itself and
    the scope of its objects this engine can read (engines with equal ids share pages)."""
    return hashlib.blake2b(f"{backend.store_id}|{scope}".encode(), digest_size=8).hexdigest()


def _brief(e: BaseException) -> str:
    """An exception in one line (nats.py errors often have an empty str())."""
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


async def _bounded(aw: Any, what: str, timeout_s: float = STOP_STEP_TIMEOUT_S) -> bool:
    """Await `aw` for at most `timeout_s`; False (logged in one line) when it failed."""
    try:
        await asyncio.wait_for(aw, timeout_s)
        return True
    except Exception as e:
        log.warning("%s did not complete: %s", what, _brief(e))
        return False
