"""What an engine takes from the bus besides P/D traffic: generate requests, aborts and
stream checks (`Intake`), and the control questions flush, stats, model card and snapshot;
and the KV events it publishes for the index (`KVEvents`)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from nats.aio.msg import Msg

from bus_schemas import (
    AbortRequest,
    ErrorReply,
    FlushReply,
    GenerateRequest,
    KVEvent,
    KVEventBatch,
    SchemaError,
    SnapshotRequest,
    StatsReply,
    StreamCheck,
    StreamState,
)
from bus_schemas import subjects as subj
from gpu_worker.cache.kv_events import KVEventRecord
from gpu_worker.engine.engine import InvalidRequestError
from gpu_worker.scheduler.request import RequestError
from services.engine.bus import EngineBus
from services.engine.pd_prefill import PrefillSide
from services.engine.runner import EngineCrashedError, EngineRunner
from services.engine.sampling import sampling_params
from services.engine.streams import Streams

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ServiceState:
    """Whether the engine takes new requests, and why not once it crashed (the service
    changes it; `Intake` and `Liveness` read it)."""

    accepting: bool = False
    crashed_reason: str | None = None


class KVEvents:
    """The engine's KV event batches for the index: each with the engine's epoch and the
    next sequence number of that epoch, queued on the bus's ordered publisher."""

    def __init__(
        self,
        engine_id: str,
        bucket: str,
        epoch: str,
        namespace: str,
        store_id: str,
        bus: EngineBus,
        runner: EngineRunner,
    ) -> None:
        self.engine_id = engine_id
        self.bucket = bucket
        self.epoch = epoch
        self.namespace = namespace
        self.store_id = store_id
        self.bus = bus
        self.runner = runner
        self._event_seq = 0

    async def publish_snapshot(self) -> None:
        """Queue a snapshot batch: every page the engine's tree holds now."""
        events = await asyncio.wrap_future(
            self.runner.query(lambda e: e.cache.tree.snapshot_events())
        )
        self.enqueue(events, snapshot=True)

    def enqueue(self, events: list[KVEventRecord], snapshot: bool) -> None:
        batch = KVEventBatch(
            self.engine_id,
            self.bucket,
            self.epoch,
            self._event_seq,
            self.namespace,
            bus_events(events),
            snapshot,
            self.store_id,
        )
        self._event_seq += 1
        self.bus.enqueue(subj.kv_events(self.engine_id), batch.encode())


def bus_events(records: list[KVEventRecord]) -> list[KVEvent]:
    """The tree's records as bus events, CP owner rotation included (`KVEvent`)."""
    return [KVEvent(e.kind, e.tier, e.page_hashes, e.owner_rotation, e.cp_size) for e in records]


class Intake:
    """The NATS handlers of a colocated engine's work and of every engine's control
    subjects. A request is taken only while `state.accepting`; its stream opens in
    `streams` before the runner gets it, and any refusal goes back as an error chunk."""

    def __init__(
        self,
        engine_id: str,
        bucket: str,
        epoch: str,
        state: ServiceState,
        runner: EngineRunner,
        bus: EngineBus,
        streams: Streams,
        events: KVEvents,
        prefill: PrefillSide | None,
        card_bytes: bytes,
    ) -> None:
        self.engine_id = engine_id
        self.bucket = bucket
        self.epoch = epoch
        self.state = state
        self.runner = runner
        self.bus = bus
        self.streams = streams
        self.events = events
        self.prefill = prefill
        self.card_bytes = card_bytes

    async def on_generate(self, msg: Msg) -> None:
        try:
            req = GenerateRequest.decode(msg.data)
        except SchemaError as e:
            log.warning("bad GenerateRequest: %s", e)
            if msg.reply:
                await self.bus.publish(msg.reply, ErrorReply(str(e)).encode())
            return
        if not self.state.accepting:  # stopping, or crashed before this request came
            error = RequestError(self.state.crashed_reason or "engine shutting down", 503)
            self.streams.refuse(req.reply_to, req.request_id, 0, error=error)
            return
        if req.request_id in self.streams:
            error = RequestError("duplicate id", 400)
            self.streams.refuse(req.reply_to, req.request_id, 0, error=error)
            return
        try:
            sampling = sampling_params(req.sampling)
        except ValueError as e:
            self.streams.refuse(req.reply_to, req.request_id, 0, error=RequestError(str(e), 400))
            return
        self.streams.open(req.request_id, req.reply_to)
        fail = self.streams.send_error
        try:
            await asyncio.wrap_future(
                self.runner.submit(req.request_id, req.input_ids, sampling, req.cache_salt)
            )
        except InvalidRequestError as e:
            fail(req.request_id, str(e), 400)
        except EngineCrashedError as e:  # 500 when it held the request, else retriable
            fail(req.request_id, str(e), 500 if e.held else 503, crashed=e.held)
        except Exception as e:  # the runner isolated it to this request's command
            fail(req.request_id, f"engine error: {e}", 500)

    async def on_abort(self, msg: Msg) -> None:
        try:
            req = AbortRequest.decode(msg.data)
        except SchemaError as e:
            log.warning("bad AbortRequest: %s", e)
            return
        if req.request_id in self.streams:
            self.runner.abort(req.request_id)

    async def on_stream_check(self, msg: Msg) -> None:
        """A router asks whether its stream survived a reconnect: the answer follows every
        chunk already queued on the same subject, so the router can count what it lost."""
        try:
            check = StreamCheck.decode(msg.data)
        except SchemaError as e:
            log.warning("bad StreamCheck: %s", e)
            return
        stream = self.streams.get(check.request_id)
        held = stream is not None and stream.reply_to == check.reply_to
        if not held and self.prefill is not None:  # P/D prefill: its KV went out already
            held = self.prefill.delivered(check.request_id, check.reply_to)
        seq = stream.seq if stream is not None and held else 0
        state = StreamState(check.request_id, self.engine_id, held, seq)
        self.bus.enqueue(check.reply_to, state.encode())

    async def on_flush(self, msg: Msg) -> None:
        ok = await asyncio.wrap_future(self.runner.flush())
        text = "" if ok else "requests are running; flush refused"
        if msg.reply:
            reply = FlushReply(self.engine_id, bool(ok), text)
            await self.bus.publish(msg.reply, reply.encode())

    async def on_stats(self, msg: Msg) -> None:
        stats = await asyncio.wrap_future(self.runner.query(lambda e: e.cache_stats()))
        if msg.reply:
            ints = {k: int(v) for k, v in stats.items()}
            reply = StatsReply(self.engine_id, self.bucket, self.epoch, ints)
            await self.bus.publish(msg.reply, reply.encode())

    async def on_model_card(self, msg: Msg) -> None:
        if msg.reply:
            await self.bus.publish(msg.reply, self.card_bytes)

    async def on_snapshot(self, msg: Msg) -> None:
        try:
            SnapshotRequest.decode(msg.data)
        except SchemaError as e:
            log.warning("bad SnapshotRequest: %s", e)
            return
        await self.events.publish_snapshot()
