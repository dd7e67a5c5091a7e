"""The index's record of each engine, and the Redis writes that apply its KV event batches
and heartbeats (`EngineRecords`). Every method that changes an engine's record or keys runs
on the engine's lane or under its lock (`EngineLanes`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import nats.errors

from bus_schemas import subjects
from bus_schemas.messages import Heartbeat, KVEventBatch, SnapshotRequest
from services.index.checks import DEFAULT_HEARTBEAT_S, TTL_HEARTBEATS, alive_ttl_ms
from services.index.config import IndexConfig, IndexStats
from services.index.fencing import Action, Fence, decide_batch, epoch_order
from services.index.store import EngineMeta, IndexStore, event_ops, stored_pages

log = logging.getLogger("hicache.index")

Publish = Callable[[str, bytes], Awaitable[None]]  # (subject, data) on the index's NATS


@dataclass(slots=True)
class EngineRecord:
    """The index's view of one engine."""

    fence: Fence
    bucket: str
    namespace: str
    ttl_ms: int = int(TTL_HEARTBEATS * DEFAULT_HEARTBEAT_S * 1000)
    snapshot_requested_at: float | None = None  # time.monotonic() of the last request

    def meta(self) -> EngineMeta:
        seq = -1 if self.fence.last_seq is None else self.fence.last_seq
        return EngineMeta(self.fence.epoch, seq, self.bucket, self.namespace)


class EngineRecords:
    """Engine id -> `EngineRecord`, kept in step with Redis: a batch is fenced and applied,
    a heartbeat refreshes the engine's liveness (a newer epoch clears what the index held),
    a record lost to an index restart is read back from Redis meta, and an engine out of
    sync is asked for a snapshot. Raises `RedisError` from a failed Redis call (the caller
    counts it and puts the engine out of sync)."""

    def __init__(
        self, config: IndexConfig, stats: IndexStats, store: IndexStore, publish: Publish
    ) -> None:
        self.config = config
        self.stats = stats
        self.store = store
        self.publish = publish
        self.engines: dict[str, EngineRecord] = {}

    async def apply_batch(self, batch: KVEventBatch, epoch: int) -> None:
        eid = batch.engine_id
        record = self.engines.get(eid) or await self.load(eid)
        decision = decide_batch(record.fence if record else None, epoch, batch.seq, batch.snapshot)
        if decision.action is Action.REJECT:
            self.stats.batches_stale_epoch += 1
            log.warning("engine %s: batch seq %d rejected: %s", eid, batch.seq, decision.reason)
            return
        if decision.action is Action.WAIT:
            self.stats.batches_dropped += 1
            return
        if record is None:
            record = EngineRecord(decision.fence, batch.bucket, batch.namespace)
        record.fence, record.bucket, record.namespace = (
            decision.fence,
            batch.bucket,
            batch.namespace,
        )
        self.engines[eid] = record
        if decision.action is Action.RESYNC:
            log.warning("engine %s: %s; requesting a snapshot", eid, decision.reason)
            await self.store.apply(eid, record.meta(), clear=True)
            await self.request_snapshot(eid, record, decision.reason)
            return
        ops = event_ops(batch.events)
        store = self.store
        await store.apply(eid, record.meta(), ops, clear=decision.clear, alive_ttl_ms=record.ttl_ms)
        stored = stored_pages(batch.events)
        if stored and batch.store_id:
            await store.store(batch.store_id, stored, self.config.store_ttl_s)
        record.snapshot_requested_at = None
        if batch.snapshot:
            self.stats.snapshots_applied += 1
            log.info("engine %s: snapshot seq %d applied (%d ops)", eid, batch.seq, len(ops))
        else:
            self.stats.batches_applied += 1

    async def apply_heartbeat(self, hb: Heartbeat, epoch: int) -> None:
        eid = hb.engine_id
        record = self.engines.get(eid) or await self.load(eid)
        order = epoch_order(record.fence if record else None, epoch)
        if order < 0:
            self.stats.heartbeats_stale_epoch += 1
            return
        store = self.store
        if record is None or order > 0:
            # a new incarnation: whatever the index holds for the engine is stale
            record = EngineRecord(Fence(epoch), hb.bucket, hb.namespace)
            await store.apply(eid, record.meta(), clear=True)
            log.info("engine %s: epoch %d", eid, epoch)
            self.engines[eid] = record
        record.ttl_ms = alive_ttl_ms(hb)
        record.bucket, record.namespace = hb.bucket, hb.namespace
        await store.heartbeat(eid, record.meta(), record.ttl_ms)
        self.stats.heartbeats += 1

    async def load(self, engine_id: str) -> EngineRecord | None:
        """The record kept in Redis meta by an earlier index run, or None."""
        meta = await self.store.load_meta(engine_id)
        if meta is None:
            return None
        last_seq = meta.seq if meta.seq >= 0 else None
        record = EngineRecord(Fence(meta.epoch, last_seq), meta.bucket, meta.namespace)
        self.engines[engine_id] = record
        return record

    async def request_snapshot(self, engine_id: str, record: EngineRecord, reason: str) -> None:
        record.snapshot_requested_at = time.monotonic()
        self.stats.snapshot_requests += 1
        request = SnapshotRequest(engine_id, reason)
        try:
            await self.publish(subjects.engine_snapshot(engine_id), request.encode())
        except nats.errors.Error as e:  # closing or reconnecting: maintenance repeats it
            log.warning("engine %s: snapshot request not sent: %s", engine_id, e)

    def out_of_sync(self, engine_id: str, epoch: int, bucket: str, namespace: str) -> EngineRecord:
        """A Redis write for the engine failed: it waits for a snapshot (requested on recovery)."""
        record = self.engines.get(engine_id)
        if record is None:
            record = EngineRecord(Fence(epoch, None, True), bucket, namespace)
            self.engines[engine_id] = record
        else:
            record.fence = Fence(record.fence.epoch, None, True)
        return record
