"""The index's periodic work (`Maintenance`) and its view of Redis's health (`RedisHealth`).

Every `sweep_interval_s`: notice a Redis that failed, came back, restarted or was replaced
by its replica in a Sentinel failover (a new run id: then clear every engine's entries and
ask each for a snapshot, since the index no longer knows what Redis holds); expire engines
whose alive key is gone; repeat snapshot requests that were not answered. Each engine's
Redis writes happen under its lane's lock.

Once no engine awaits its snapshot after such a resync, the index writes the server's run id
under `INDEX_SYNCED` (`bus_schemas/sentinel.py`): a router that finds Redis through Sentinel
routes by load until the marker names the server it reads from. At first contact the index
resyncs unless the marker already names this server (an index restarted beside the same
Redis picks up where it stopped; one that meets a promoted replica does not trust it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis.exceptions import RedisError

from bus_schemas.sentinel import same_server
from services.index.config import IndexConfig, IndexStats
from services.index.fencing import Fence
from services.index.lanes import EngineLanes
from services.index.records import EngineRecords
from services.index.store import IndexStore

log = logging.getLogger("hicache.index")


class RedisHealth:
    """Whether Redis answers, and the run id of the Redis instance last seen. While it
    fails, batches are dropped and engines put out of sync; maintenance resyncs them."""

    def __init__(self, stats: IndexStats) -> None:
        self.stats = stats
        self.ok = True
        self.run_id: str | None = None
        self.synced = False  # `INDEX_SYNCED` names `run_id`: every engine resynced there

    def failed(self, error: RedisError) -> None:
        """Count a failed Redis call; log the first of a run of failures as an error."""
        self.stats.redis_errors += 1
        if self.ok:
            log.error("redis failed: %s (every engine resyncs once it is back)", error)
        else:
            log.debug("redis still failing: %s", error)
        self.ok = False


class Maintenance:
    """The index's one maintenance task, owned here: `start`, then `stop` (cancels and
    awaits it)."""

    def __init__(
        self,
        config: IndexConfig,
        stats: IndexStats,
        store: IndexStore,
        records: EngineRecords,
        lanes: EngineLanes,
        health: RedisHealth,
    ) -> None:
        self.config = config
        self.stats = stats
        self.store = store
        self.records = records
        self.lanes = lanes
        self.health = health
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="index-maintenance")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            await self.check_redis()
            if not self.health.ok:
                continue
            try:
                await self._expire_dead()
                await self._retry_snapshot_requests()
            except RedisError as e:
                self.health.failed(e)

    async def check_redis(self) -> None:
        """Notice Redis failing, coming back or restarting; resync every engine after either."""
        health = self.health
        try:
            run_id = await self.store.run_id()
        except RedisError as e:
            health.failed(e)
            return
        try:
            if health.ok and run_id == health.run_id:
                await self.mark_if_synced()
                return
            first = health.run_id is None and health.ok
            if first and same_server(await self.store.synced_marker(), run_id):
                health.run_id, health.synced = run_id, True  # picks up where it stopped
                return
            health.synced = False
            resynced = await self._resync_all(count=not first)
            health.ok, health.run_id = True, run_id
            await self.mark_if_synced()
        except RedisError as e:
            health.failed(e)
            return
        if resynced or not first:
            log.warning(
                "redis is new to the index (run id %s): resyncing %d engines", run_id, resynced
            )

    async def mark_if_synced(self) -> None:
        """Write `INDEX_SYNCED` once no engine awaits its snapshot (engines that never answer
        expire with their alive key, so this comes)."""
        health = self.health
        if health.synced or health.run_id is None:
            return
        if any(r.fence.awaiting_snapshot for r in self.records.engines.values()):
            return
        await self.store.mark_synced(health.run_id)
        health.synced = True
        self.stats.marked_synced += 1
        log.info("index resynced on redis run id %s: routing by prefix may resume", health.run_id)

    async def _resync_all(self, count: bool = True) -> int:
        """Drop the entries of every engine, known to this index or listed in Redis, and ask
        each for a snapshot; the number of engines."""
        store, engines = self.store, self.records.engines
        for eid in sorted(set(engines) | set(await store.engine_ids())):
            async with self.lanes.lock(eid):
                record = engines.get(eid) or await self.records.load(eid)
                if record is None:  # listed without meta: nothing to fence, only entries
                    await store.expire(eid)
                    continue
                record.fence = Fence(record.fence.epoch, None, True)
                await store.apply(eid, record.meta(), clear=True, alive_ttl_ms=record.ttl_ms)
        for eid, record in list(engines.items()):
            await self.records.request_snapshot(eid, record, "index lost redis state")
        if count or engines:
            self.stats.resyncs_after_redis += 1
        return len(engines)

    async def _expire_dead(self) -> None:
        store = self.store
        for eid in await store.dead_engines():
            async with self.lanes.lock(eid):
                dropped = await store.expire(eid)
                if dropped is None:
                    continue  # a heartbeat came in between
                self.records.engines.pop(eid, None)
            self.lanes.forget(eid)
            self.stats.engines_expired += 1
            log.info("engine %s expired: %d pages dropped", eid, dropped)

    async def request_pending_snapshots(self) -> None:
        """Ask every engine that awaits a snapshot for it now (once NATS is connected: a
        resync at the index's first Redis check could not send its requests)."""
        engines = self.records.engines
        for eid in list(engines):
            async with self.lanes.lock(eid):
                record = engines.get(eid)
                if record is not None and record.fence.awaiting_snapshot:
                    await self.records.request_snapshot(eid, record, "index lost redis state")

    async def _retry_snapshot_requests(self) -> None:
        """Under each engine's lock: a lane job that found a gap has sent its own request
        by the time the lock is free, so it is not doubled by a "repeated" one."""
        engines = self.records.engines
        for eid in list(engines):
            async with self.lanes.lock(eid):
                record = engines.get(eid)
                if record is None or not record.fence.awaiting_snapshot:
                    continue
                asked = record.snapshot_requested_at
                if asked is None or time.monotonic() - asked >= self.config.snapshot_retry_s:
                    await self.records.request_snapshot(eid, record, "snapshot request repeated")
