"""The index service: KV events and heartbeats from NATS -> Redis (`bus_schemas.redis_keys`).

Parts: `checks` (bus input beyond the schema), `lanes.EngineLanes` (one writer per engine),
`records.EngineRecords` (fence and apply batches and heartbeats to Redis),
`maintenance.Maintenance` (expiry, Redis health and resync, repeated snapshot requests);
`IndexService` takes messages off NATS onto the lanes and owns the start and stop of all.

One `IndexService` owns a NATS connection, a Redis client, an in-memory `Fence` per engine
and one maintenance task. The index is the only writer of the keys it keeps, so the fences
in memory are authoritative while it runs; they are stored with each batch in the engine's
meta, so a restarted index picks up where it stopped.

- `KVEventBatch` (subject `kv_events(engine_id)`): fenced by epoch and seq (`fencing.decide_batch`),
  then applied in one script call. A gap drops the engine's entries and publishes a
  `SnapshotRequest` on `engine_snapshot(engine_id)`.
- `Heartbeat` (subject `heartbeat(engine_id)`): refreshes `hc:engine:{id}:alive` with a TTL of three
  heartbeat intervals; a newer epoch drops the old incarnation's entries at once.
- Maintenance, every `sweep_interval_s`: expire engines whose alive key is gone; notice a
  Redis that came back or restarted, and then resync every known engine; repeat snapshot
  requests that were not answered.

Concurrency: one lane per engine (`EngineLanes`). A NATS handler only validates a message
and queues its work on the engine's lane; each lane applies its engine's messages in arrival
order, one at a time, under the engine's lock, so batches of different engines never wait
behind each other's Redis round trips, while one engine's batches stay ordered (fencing
needs that). Maintenance takes each engine's lock around that engine's Redis writes.

Bounded (DESIGN.md 7b: whoever reaches the bus can announce engines): at most `max_engines`
engines have a lane, a record and keys (`hc:engine:{id}:*`, three per engine); messages of a
new engine beyond that are dropped and counted until an engine expires (its alive key lasts
three heartbeat intervals, and `Heartbeat` bounds the interval). Warnings that bus input can
trigger are logged once per cause per interval (`LogThrottle`).

Invalid messages are counted and logged. A message whose engine id is not the one its subject
speaks for (`subjects.sender_of`: NATS permissions let only that engine publish there) is
forged: counted, dropped, and logged once per interval. While Redis fails, failures are
counted and logged
and batches are dropped; once it answers again, every known engine's entries are cleared and
each engine is asked for a snapshot, since the index no longer knows what Redis holds.

With Sentinel (`--redis-sentinel`) the client follows the primary the sentinels name. A
failover shows as a new run id, handled like a restarted Redis (the promoted replica may lack
the last writes); when no engine awaits its snapshot any more, maintenance writes the run id
under `INDEX_SYNCED` so routers trust that primary again (`bus_schemas/sentinel.py`).
"""

from __future__ import annotations

import logging

import nats
import nats.errors
import redis.asyncio as aioredis
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from redis.exceptions import RedisError

from bus_schemas import subjects
from bus_schemas.codec import SchemaError
from bus_schemas.connection import connect_nats
from bus_schemas.messages import Heartbeat, KVEventBatch
from bus_schemas.throttle import LogThrottle
from services.index.checks import alive_ttl_ms, check_batch, check_heartbeat
from services.index.config import IndexConfig, IndexStats
from services.index.lanes import EngineLanes
from services.index.maintenance import Maintenance, RedisHealth
from services.index.records import EngineRecords
from services.index.store import IndexStore, connect, connect_sentinel

log = logging.getLogger("hicache.index")

__all__ = ["EngineLanes", "IndexConfig", "IndexService", "IndexStats"]


class IndexService:
    """Keeps Redis current from KV events and heartbeats. `start()`, then `stop()`."""

    def __init__(self, config: IndexConfig) -> None:
        self.config = config
        self.stats = IndexStats()
        self._lanes = EngineLanes("index-lane")  # one writer per engine (records + keys)
        self._health = RedisHealth(self.stats)
        self._nc: NATS | None = None
        self._store: IndexStore | None = None
        self._records: EngineRecords | None = None
        self._maintenance: Maintenance | None = None
        self._stopping = False
        self._throttle = LogThrottle(log)

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Connect, subscribe, start maintenance. Raises if NATS cannot be reached."""
        cfg = self.config
        self._store = IndexStore(self._redis_client())
        self._records = EngineRecords(cfg, self.stats, self._store, self._publish)
        self._maintenance = Maintenance(
            cfg, self.stats, self._store, self._records, self._lanes, self._health
        )
        await self._maintenance.check_redis()
        self._nc = await connect_nats(  # waits for NATS with backoff; cancel to give up
            cfg.nats_url,
            name="hicache-index",
            log=log,
            credentials=cfg.nats_credentials,
            tls_ca_file=cfg.nats_tls_ca_file,
            drain_timeout=int(max(1, cfg.drain_timeout_s)),
            error_cb=self._on_nats_error,
            disconnected_cb=self._on_nats_disconnected,
            reconnected_cb=self._on_nats_reconnected,
        )
        await self._nc.subscribe(subjects.KV_EVENTS_ALL, cb=self._on_kv_events)
        await self._nc.subscribe(subjects.HEARTBEAT_ALL, cb=self._on_heartbeat)
        await self._nc.flush()
        await self._maintenance.request_pending_snapshots()  # a resync at the first check
        self._maintenance.start()
        where = cfg.redis_url
        if cfg.redis_sentinels:
            where = f"primary {cfg.redis_sentinel_master!r} of sentinels {cfg.redis_sentinels}"
        log.info("index ready (nats %s, redis %s)", cfg.nats_url, where)

    def _redis_client(self) -> aioredis.Redis:
        """The Redis client: of the primary Sentinel names, or of `redis_url`'s server."""
        cfg = self.config
        if cfg.redis_sentinels:
            return connect_sentinel(
                cfg.redis_url,
                cfg.redis_sentinels,
                cfg.redis_sentinel_master,
                cfg.redis_timeout_s,
                cfg.redis_credentials,
                cfg.redis_sentinel_credentials,
                cfg.redis_tls_ca_file,
            )
        return connect(
            cfg.redis_url, cfg.redis_timeout_s, cfg.redis_credentials, cfg.redis_tls_ca_file
        )

    async def stop(self) -> None:
        """Stop maintenance, drain NATS, finish the work already queued, close Redis."""
        self._stopping = True
        if self._maintenance is not None:
            await self._maintenance.stop()
        if self._nc is not None:
            if not self._nc.is_closed:
                try:
                    await self._nc.drain()  # unsubscribes, waits for the handlers, closes
                except (nats.errors.Error, TimeoutError) as e:
                    log.warning("NATS drain failed: %s", e)
                    await self._nc.close()
            await self._lanes.join(self.config.drain_timeout_s)  # what the handlers queued
            self._nc = None
        if self._store is not None:
            await self._store.client.aclose()
            self._store = None
        log.info("index stopped: %s", self.stats)

    async def _publish(self, subject: str, data: bytes) -> None:
        if self._nc is None:  # the first Redis check runs before NATS is connected
            raise nats.errors.ConnectionClosedError()
        await self._nc.publish(subject, data)

    def _records_or_raise(self) -> EngineRecords:
        if self._records is None or self._store is None:
            raise RuntimeError("IndexService is not started")
        return self._records

    # ----------------------------------------------------------------- NATS handlers

    async def _on_kv_events(self, msg: Msg) -> None:
        try:
            batch = KVEventBatch.decode(msg.data)
            epoch = check_batch(batch)
        except SchemaError as e:
            self._invalid("kv_events", msg, e)
            return
        if self._forged(msg, batch.engine_id):
            return
        if self._admit(batch.engine_id):
            self._lanes.submit(batch.engine_id, lambda: self._apply_batch(batch, epoch))

    async def _apply_batch(self, batch: KVEventBatch, epoch: int) -> None:
        """On the engine's lane."""
        records = self._records_or_raise()
        if not self._health.ok:  # maintenance resyncs every engine once Redis is back
            self.stats.batches_dropped += 1
            records.out_of_sync(batch.engine_id, epoch, batch.bucket, batch.namespace)
            return
        try:
            await records.apply_batch(batch, epoch)
            if batch.snapshot and self._maintenance is not None:
                await self._maintenance.mark_if_synced()  # the last one awaited, maybe
        except RedisError as e:
            self._health.failed(e)
            records.out_of_sync(batch.engine_id, epoch, batch.bucket, batch.namespace)

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            hb = Heartbeat.decode(msg.data)
            epoch = check_heartbeat(hb)
        except SchemaError as e:
            self._invalid("heartbeat", msg, e)
            return
        if self._forged(msg, hb.engine_id):
            return
        if self._admit(hb.engine_id):
            self._lanes.submit(hb.engine_id, lambda: self._apply_heartbeat(hb, epoch))

    def _admit(self, engine_id: str) -> bool:
        """Whether the index takes a message of `engine_id`: a known engine always, a new
        one while fewer than `max_engines` are known (lanes: made at once, records later)."""
        if self._lanes.has(engine_id) or len(self._lanes) < self.config.max_engines:
            return True
        self.stats.engines_refused += 1
        self._throttle.warning(
            "engine_cap",
            "engine %s ignored: %d engines are indexed (--max-engines)",
            engine_id,
            len(self._lanes),
        )
        return False

    async def _apply_heartbeat(self, hb: Heartbeat, epoch: int) -> None:
        """On the engine's lane."""
        records = self._records_or_raise()
        if self._health.ok:
            try:
                await records.apply_heartbeat(hb, epoch)
                return
            except RedisError as e:
                self._health.failed(e)
        record = records.out_of_sync(hb.engine_id, epoch, hb.bucket, hb.namespace)
        record.ttl_ms = alive_ttl_ms(hb)

    # ----------------------------------------------------------------- errors

    def _invalid(self, kind: str, msg: Msg, error: SchemaError) -> None:
        self.stats.invalid_messages += 1
        self._throttle.warning(kind, "invalid message on %s: %.300s", msg.subject, error)

    def _forged(self, msg: Msg, engine_id: str) -> bool:
        """Whether `msg` speaks for an engine other than its subject's (then counted)."""
        if subjects.sender_of(msg.subject) == engine_id:
            return False
        self.stats.forged_messages += 1
        self._throttle.warning(
            "forged",
            "dropped a message for engine %.64r on %.100s (%d forged so far)",
            engine_id,
            msg.subject,
            self.stats.forged_messages,
        )
        return True

    async def _on_nats_error(self, error: Exception) -> None:
        log.error("nats error: %s", error)

    async def _on_nats_disconnected(self) -> None:
        if not self._stopping:
            log.warning("nats disconnected")

    async def _on_nats_reconnected(self) -> None:
        log.warning("nats reconnected: events may have been lost (gaps trigger snapshots)")
