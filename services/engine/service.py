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

The parts, each with one job: `bus.EngineBus` (the NATS connection and the ordered
publisher), `streams.Streams` (each held request's reply stream), `intake.Intake` (generate,
abort, stream checks, flush, stats, card, snapshot), `intake.KVEvents` (batches for the
index), `liveness.Liveness` (heartbeats and progress), `pd_decode.DecodeSide` and
`pd_prefill.PrefillSide` (the P/D roles). `EngineService` wires them to the runner and owns
their start and stop.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from nats.aio.subscription import Subscription

from bus_schemas import subjects as subj
from bus_schemas.connection import Credentials
from bus_schemas.messages import MAX_HEARTBEAT_INTERVAL_S, MIN_HEARTBEAT_INTERVAL_S
from gpu_worker.cache.kv_events import KVEventRecord
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.engine.nodes import NodeLayout
from gpu_worker.scheduler.request import CachedTokens, KVExport
from gpu_worker.storage import StorageBackend
from services.engine.bus import STOP_STEP_TIMEOUT_S, EngineBus, bounded
from services.engine.card import build_card
from services.engine.intake import Intake, KVEvents, ServiceState
from services.engine.liveness import EngineIdentity, Liveness
from services.engine.pd import PDConfig
from services.engine.pd_decode import DecodeSide
from services.engine.pd_prefill import PrefillSide
from services.engine.runner import EngineRunner
from services.engine.streams import Streams, token_chunk
from services.engine.updates import TokenUpdate

log = logging.getLogger(__name__)

ROLES = ("colocated", "prefill", "decode")


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
    nodes: NodeLayout = field(
        default_factory=NodeLayout
    )  # the hosts the engine's ranks span (this is node 0)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not subj.valid_token(self.engine_id) or not subj.valid_token(self.bucket):
            raise ValueError("--engine-id and --bucket may hold only letters, digits, '-', '_'")
        lo, hi = MIN_HEARTBEAT_INTERVAL_S, MAX_HEARTBEAT_INTERVAL_S
        if not lo <= self.heartbeat_interval_s <= hi:
            raise ValueError(f"--heartbeat-interval must be in [{lo}, {hi}] seconds")


class EngineService:
    """One engine on the bus: starts the runner and the parts that serve it, is the
    runner's `Outbox` (tokens, exported KV, KV events, a crash), and stops them in order."""

    def __init__(self, config: EngineServiceConfig, engine_config: EngineConfig) -> None:
        self.config = config
        self.engine_config = engine_config
        self.epoch = str(time.time_ns())
        self.namespace = ""  # the engine's (with its weights digest), once started
        self.state = ServiceState()
        self.crashed_event = asyncio.Event()
        self.bus = EngineBus(
            config.nats_url,
            config.engine_id,
            config.nats_credentials,
            config.nats_tls_ca_file,
            self._on_reconnected,
        )
        self.streams = Streams(config.engine_id, self.bus.enqueue, self._abort)
        self._runner: EngineRunner | None = None
        self._work_subs: list[Subscription] = []
        self._decode: DecodeSide | None = None
        self._prefill: PrefillSide | None = None
        self._events: KVEvents | None = None
        self._liveness: Liveness | None = None

    @property
    def crashed_reason(self) -> str | None:
        """Why the engine's step loop died (None while it runs): the process exits non-zero."""
        return self.state.crashed_reason

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        cfg, eid = self.config, self.config.engine_id
        runner = self._runner = EngineRunner(
            self.engine_config,
            loop,
            self,
            debug_crash_on_token=cfg.debug_crash_on_prompt_token,
            nodes=cfg.nodes,
        )
        await asyncio.wrap_future(runner.start())
        engine = self._engine_now()
        self.namespace = engine.namespace
        self.card = build_card(engine, cfg.served_model_name, cfg.chat_template_file)
        storage = engine.cache.storage
        store_id = "" if storage is None else _store_id(storage.io.backend, storage.scope)
        self._make_pd_side(runner)
        events = self._events = KVEvents(
            eid, cfg.bucket, self.epoch, self.namespace, store_id, self.bus, runner
        )
        intake = Intake(
            eid,
            cfg.bucket,
            self.epoch,
            self.state,
            runner,
            self.bus,
            self.streams,
            events,
            self._prefill,
            self.card.encode(),
        )
        identity = self._identity(engine, store_id)
        self._liveness = Liveness(
            identity,
            runner,
            engine,
            self.bus,
            self.streams,
            self._prefill,
            lambda: self.state.crashed_reason is None,
        )
        await self.bus.connect()
        self._work_subs = await self._subscribe_work(intake)
        bus = self.bus
        await bus.subscribe(subj.engine_abort(eid), intake.on_abort)
        await bus.subscribe(subj.engine_stream_check(eid), intake.on_stream_check)
        await bus.subscribe(subj.engine_flush(eid), intake.on_flush)
        await bus.subscribe(subj.FLUSH_ALL, intake.on_flush)
        await bus.subscribe(subj.engine_stats(eid), intake.on_stats)
        await bus.subscribe(subj.engine_snapshot(eid), intake.on_snapshot)
        await bus.subscribe(subj.engine_model_card(eid), intake.on_model_card)
        self.state.accepting = True
        bus.start_publisher()
        self._liveness.start()
        await events.publish_snapshot()  # epoch starts with what the engine holds (nothing)
        log.info("engine %s up (bucket %s, epoch %s)", eid, cfg.bucket, self.epoch)

    def _identity(self, engine: Engine, store_id: str) -> EngineIdentity:
        cfg, mc = self.config, engine.model_config
        return EngineIdentity(
            cfg.engine_id,
            cfg.bucket,
            cfg.role,
            self.epoch,
            self.card.served_model_name,
            self.namespace,
            self.engine_config.cache.page_size,
            engine.context_len,
            mc.vocab_size,
            list(mc.eos_token_ids),
            cfg.heartbeat_interval_s,
            self.card.digest,
            store_id,
        )

    def _make_pd_side(self, runner: EngineRunner) -> None:
        """The P/D side of a prefill or decode engine (none for a colocated one)."""
        eid, streams, bus = self.config.engine_id, self.streams, self.bus
        if self.config.role == "decode":
            self._decode = DecodeSide(eid, runner, bus.publish, streams.open, streams.fail)
        elif self.config.role == "prefill":
            self._prefill = PrefillSide(
                eid,
                runner,
                bus.publish,
                self.config.pd,
                streams.open,
                streams.fail,
                streams.close,
                self.engine_config.parallel.tp_size,
                max_payload=bus.max_payload,
            )

    async def _subscribe_work(self, intake: Intake) -> list[Subscription]:
        eid, bus = self.config.engine_id, self.bus
        if self._decode is not None:
            return [
                await bus.subscribe(subj.engine_decode_admit(eid), self._decode.on_admit),
                await bus.subscribe(subj.engine_kv(eid), self._decode.on_frame),
            ]
        if self._prefill is not None:
            return [
                await bus.subscribe(subj.engine_prefill(eid), self._prefill.on_prefill),
                await bus.subscribe(subj.engine_kv_ack(eid), self._prefill.on_ack),
            ]
        bucket = self.config.bucket
        return [
            await bus.subscribe(subj.engine_generate(eid), intake.on_generate),
            await bus.subscribe(
                subj.bucket_generate(bucket), intake.on_generate, subj.bucket_queue(bucket)
            ),
        ]

    def _on_reconnected(self) -> None:
        if self._prefill is not None:
            self._prefill.reconnected()

    def _abort(self, request_id: str) -> None:
        if self._runner is not None:
            self._runner.abort(request_id)

    async def stop(self) -> None:
        """Stop taking work, finish or fail in-flight requests, drain NATS.

        Running requests get `shutdown_grace_s`; every bus step after that has its own
        short timeout, so this returns even when NATS is unreachable."""
        self.state.accepting = False
        await bounded(
            asyncio.gather(*(sub.unsubscribe() for sub in self._work_subs)), "unsubscribe"
        )
        deadline = time.monotonic() + self.config.shutdown_grace_s
        while self.streams and time.monotonic() < deadline and self.crashed_reason is None:
            await asyncio.sleep(0.05)
        for request_id in self.streams:
            self.streams.send_error(request_id, "engine shutting down", 503)
        await self._stop_pd()
        if self._runner is not None:
            await asyncio.to_thread(self._runner.stop, STOP_STEP_TIMEOUT_S)
        await self._close_bus()

    async def _stop_pd(self) -> None:
        for side in (self._decode, self._prefill):
            if side is not None:
                await bounded(side.stop(), "P/D shutdown")

    async def _close_bus(self) -> None:
        """Publish what is queued, end the background tasks, then drain NATS; each step
        bounded in time."""
        await self.bus.flush_queue()
        if self._liveness is not None:
            await self._liveness.stop()
        await self.bus.close()

    def crashed(self, reason: str, suspect: bool) -> None:
        """Runner callback (on the loop): the step loop died. Stop heartbeating now, fail
        every request held, and let the process exit. When a request may have caused it
        (`suspect`) each gets an `engine_crashed` 500, never retried elsewhere; otherwise
        (a rank killed from outside) a 503 the router retries on another engine."""
        if self.state.crashed_reason is not None:
            return
        log.error("engine %s crashed, failing all requests: %s", self.config.engine_id, reason)
        self.state.crashed_reason = reason
        self.state.accepting = False
        if self._liveness is not None:
            self._liveness.crashed()
        for request_id in self.streams:
            self.streams.send_error(request_id, reason, 500 if suspect else 503, crashed=suspect)
        self.crashed_event.set()

    async def abandon(self) -> None:
        """After a crash: deliver the error chunks (bounded in time) and close the bus."""
        await self._stop_pd()
        await self._close_bus()

    def _engine_now(self) -> Engine:
        assert self._runner is not None and self._runner.engine is not None
        return self._runner.engine

    # ----------------------------------------------------------------- runner callbacks

    def tokens(self, updates: list[TokenUpdate]) -> None:
        """Runner callback (on the loop): forward new tokens to each request's stream."""
        for u in updates:
            stream = self.streams.get(u.request_id)
            if stream is None:
                continue
            transfer = self._decode.transfers.get(u.request_id) if self._decode else None
            chunk = token_chunk(u, stream.seq, self.config.engine_id, transfer)
            self.streams.send(u.request_id, chunk)
            if u.finished:
                if self._decode is not None:
                    self._decode.finished(u.request_id)
                if self._prefill is not None:  # it failed or was aborted: no KV to send
                    self._prefill.finished(u.request_id)

    def exported(self, request_id: str, export: KVExport, cached: CachedTokens) -> None:
        """Runner callback (on the loop): P/D prefill KV is packed."""
        if self._prefill is not None:
            self._prefill.exported(request_id, export, cached)

    def kv_events(self, events: list[KVEventRecord]) -> None:
        """Runner callback (on the loop): publish tree changes to the index."""
        if self._events is not None:
            self._events.enqueue(events, snapshot=False)


def _store_id(backend: StorageBackend, scope: str) -> str:
    """What heartbeats and storage KV events name the engine's store by: the store itself and
    the scope of its objects this engine can read (engines with equal ids share pages)."""
    return hashlib.blake2b(f"{backend.store_id}|{scope}".encode(), digest_size=8).hexdigest()
