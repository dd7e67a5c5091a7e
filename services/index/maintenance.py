"""The index's periodic work (`Maintenance`) and its view of Redis's health (`RedisHealth`).

Every `sweep_interval_s`: notice a Redis that failed, came back or restarted (then clear
every known engine's entries and ask each for a snapshot, since the index no longer knows
what Redis holds); expire engines whose alive key is gone; repeat snapshot requests that
were not answered. Each engine's Redis writes happen under its lane's lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis.exceptions import RedisError

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
        if health.ok and run_id == health.run_id:
            return
        if health.run_id is None and health.ok:
            health.run_id = run_id  # first contact
            return
        try:
            await self._resync_all()
        except RedisError as e:
            health.failed(e)
            return
        health.ok, health.run_id = True, run_id
        engines = self.records.engines
        log.warning("redis is back (run id %s): resynced %d engines", run_id, len(engines))

    async def _resync_all(self) -> None:
        """Drop every known engine's entries and ask each for a snapshot."""
        store, engines = self.store, self.records.engines
        for eid in list(engines):
            async with self.lanes.lock(eid):
                record = engines.get(eid)
                if record is None:
                    continue
                record.fence = Fence(record.fence.epoch, None, True)
                await store.apply(eid, record.meta(), clear=True, alive_ttl_ms=record.ttl_ms)
        for eid, record in list(engines.items()):
            await self.records.request_snapshot(eid, record, "index lost redis state")
        self.stats.resyncs_after_redis += 1

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
