"""The index service: KV events and heartbeats from NATS -> Redis (`bus_schemas.redis_keys`).

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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from redis.exceptions import RedisError

from bus_schemas import redis_keys, subjects
from bus_schemas.codec import SchemaError
from bus_schemas.connection import (
    Credentials,
    add_tls_args,
    connect_nats,
    read_credentials,
    tls_ca_file,
)
from bus_schemas.messages import Heartbeat, KVEventBatch, SnapshotRequest
from bus_schemas.throttle import LogThrottle
from services.index.fencing import Action, Fence, decide_batch, epoch_order, parse_epoch
from services.index.store import (
    EngineMeta,
    IndexStore,
    connect,
    event_ops,
    stored_pages,
    valid_page_hash,
)
from services.tasks import OwnedTasks

log = logging.getLogger("hicache.index")

TTL_HEARTBEATS = 3  # an engine is alive for this many heartbeat intervals after its last one
DEFAULT_HEARTBEAT_S = 1.0  # assumed until an engine's first heartbeat says otherwise


@dataclass(frozen=True, slots=True)
class IndexConfig:
    nats_url: str = "nats://127.0.0.1:4222"
    redis_url: str = "redis://127.0.0.1:6379/0"
    sweep_interval_s: float = 1.0  # expiry sweep and Redis health check period
    snapshot_retry_s: float = 2.0  # repeat an unanswered SnapshotRequest after this long
    store_ttl_s: int = redis_keys.STORE_TTL_S  # how long a page reported in a store counts
    redis_timeout_s: float = 2.0  # per Redis call
    drain_timeout_s: float = 5.0  # NATS drain at shutdown
    max_engines: int = 512  # engines indexed at once; messages of more are dropped
    nats_credentials: Credentials | None = None  # user `index` (None: no authentication)
    redis_credentials: Credentials | None = None
    # CA files (PEM): connect over TLS only, verifying the server against them (None: plain)
    nats_tls_ca_file: str | None = None
    redis_tls_ca_file: str | None = None

    def __post_init__(self) -> None:
        for name in ("sweep_interval_s", "snapshot_retry_s", "redis_timeout_s", "drain_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_engines < 1:
            raise ValueError(f"max_engines must be >= 1, got {self.max_engines}")


@dataclass(slots=True)
class IndexStats:
    """Counters, logged at shutdown and read by tests."""

    batches_applied: int = 0
    snapshots_applied: int = 0
    batches_stale_epoch: int = 0  # rejected: epoch older than the engine's current one
    batches_dropped: int = 0  # arrived while a snapshot was awaited
    snapshot_requests: int = 0
    heartbeats: int = 0
    heartbeats_stale_epoch: int = 0
    invalid_messages: int = 0
    forged_messages: int = 0  # an engine id other than its subject's: dropped
    redis_errors: int = 0
    engines_expired: int = 0
    engines_refused: int = 0  # messages of a new engine beyond max_engines
    resyncs_after_redis: int = 0


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


def check_batch(batch: KVEventBatch) -> int:
    """Checks beyond the schema; returns the epoch as an integer. Raises SchemaError."""
    _check_engine_id(batch.engine_id)
    if batch.seq < 0:
        raise SchemaError(f"kv_events: seq must be >= 0, got {batch.seq}")
    if batch.store_id and not subjects.valid_token(batch.store_id):
        raise SchemaError(f"kv_events: invalid store id {batch.store_id[:64]!r}")
    for event in batch.events:
        for page_hash in event.page_hashes:
            if not valid_page_hash(page_hash):
                raise SchemaError(f"kv_events: invalid page hash {page_hash[:64]!r}")
    return _epoch(batch.epoch)


def check_heartbeat(hb: Heartbeat) -> int:
    """Checks beyond the schema; returns the epoch as an integer. Raises SchemaError."""
    _check_engine_id(hb.engine_id)
    if not 0 < hb.interval_s < 86400:
        raise SchemaError(f"heartbeat: interval_s must be in (0, 86400), got {hb.interval_s}")
    return _epoch(hb.epoch)


def _ttl_ms(hb: Heartbeat) -> int:
    return max(1, round(TTL_HEARTBEATS * hb.interval_s * 1000))


def _check_engine_id(engine_id: str) -> None:
    if not subjects.valid_token(engine_id):
        raise SchemaError(f"invalid engine id {engine_id[:64]!r}")


def _epoch(epoch: str) -> int:
    try:
        return parse_epoch(epoch)
    except ValueError as e:
        raise SchemaError(str(e)) from None


Job = Callable[[], Awaitable[None]]


@dataclass(slots=True)
class _Lane:
    jobs: asyncio.Queue[Job] = field(default_factory=asyncio.Queue)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # the engine's one writer


class EngineLanes:
    """One ordered job queue per engine, each drained by its own task: jobs of one engine
    run one at a time in submission order, jobs of different engines run concurrently.
    A lane's task ends when its queue is empty (an engine that went quiet costs nothing);
    its lock stays, for maintenance (`lock(engine_id)`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lanes: dict[str, _Lane] = {}
        self._draining: set[str] = set()
        self._tasks = OwnedTasks()

    def submit(self, engine_id: str, job: Job) -> None:
        lane = self._lane(engine_id)
        lane.jobs.put_nowait(job)
        if engine_id not in self._draining:
            self._draining.add(engine_id)
            self._tasks.spawn(self._drain(engine_id, lane), f"{self.name}-{engine_id}")

    def lock(self, engine_id: str) -> asyncio.Lock:
        return self._lane(engine_id).lock

    def has(self, engine_id: str) -> bool:
        return engine_id in self._lanes

    def __len__(self) -> int:
        return len(self._lanes)

    def forget(self, engine_id: str) -> None:
        """Drop an idle engine's lane (after it expired)."""
        lane = self._lanes.get(engine_id)
        if lane is not None and engine_id not in self._draining and not lane.lock.locked():
            del self._lanes[engine_id]

    async def join(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) for every queued job, then end the lane tasks."""
        try:
            async with asyncio.timeout(timeout_s):
                for lane in list(self._lanes.values()):
                    await lane.jobs.join()
        except TimeoutError:
            log.warning("%s: queued work not finished within %.1f s", self.name, timeout_s)
        await self._tasks.cancel_all()

    def _lane(self, engine_id: str) -> _Lane:
        lane = self._lanes.get(engine_id)
        if lane is None:
            lane = self._lanes[engine_id] = _Lane()
        return lane

    async def _drain(self, engine_id: str, lane: _Lane) -> None:
        try:
            while not lane.jobs.empty():
                job = lane.jobs.get_nowait()
                try:
                    async with lane.lock:
                        await job()
                except Exception:  # one bad job must not stop the engine's lane
                    log.exception("%s: job for engine %s failed", self.name, engine_id)
                finally:
                    lane.jobs.task_done()
        finally:
            self._draining.discard(engine_id)


class IndexService:
    """Keeps Redis current from KV events and heartbeats. `start()`, then `stop()`."""

    def __init__(self, config: IndexConfig) -> None:
        self.config = config
        self.stats = IndexStats()
        self._engines: dict[str, EngineRecord] = {}
        self._lanes = EngineLanes("index-lane")  # one writer per engine (records + keys)
        self._nc: NATS | None = None
        self._store: IndexStore | None = None
        self._maintenance: asyncio.Task[None] | None = None
        self._redis_ok = True
        self._redis_run_id: str | None = None
        self._stopping = False
        self._throttle = LogThrottle(log)

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Connect, subscribe, start maintenance. Raises if NATS cannot be reached."""
        cfg = self.config
        self._store = IndexStore(
            connect(
                cfg.redis_url, cfg.redis_timeout_s, cfg.redis_credentials, cfg.redis_tls_ca_file
            )
        )
        await self._check_redis()
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
        self._maintenance = asyncio.create_task(self._maintenance_loop(), name="index-maintenance")
        log.info("index ready (nats %s, redis %s)", cfg.nats_url, cfg.redis_url)

    async def stop(self) -> None:
        """Stop maintenance, drain NATS, finish the work already queued, close Redis."""
        self._stopping = True
        if self._maintenance is not None:
            self._maintenance.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._maintenance
            self._maintenance = None
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
        if not self._redis_ok:  # maintenance resyncs every engine once Redis is back
            self.stats.batches_dropped += 1
            self._out_of_sync(batch.engine_id, epoch, batch.bucket, batch.namespace)
            return
        try:
            await self._handle_batch(batch, epoch)
        except RedisError as e:
            self._redis_failed(e)
            self._out_of_sync(batch.engine_id, epoch, batch.bucket, batch.namespace)

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
        if self._redis_ok:
            try:
                await self._handle_heartbeat(hb, epoch)
                return
            except RedisError as e:
                self._redis_failed(e)
        record = self._out_of_sync(hb.engine_id, epoch, hb.bucket, hb.namespace)
        record.ttl_ms = _ttl_ms(hb)

    async def _handle_batch(self, batch: KVEventBatch, epoch: int) -> None:
        eid = batch.engine_id
        record = self._engines.get(eid) or await self._load(eid)
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
        self._engines[eid] = record
        if decision.action is Action.RESYNC:
            log.warning("engine %s: %s; requesting a snapshot", eid, decision.reason)
            await self._store_or_raise().apply(eid, record.meta(), clear=True)
            await self._request_snapshot(eid, record, decision.reason)
            return
        ops = event_ops(batch.events)
        store = self._store_or_raise()
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

    async def _handle_heartbeat(self, hb: Heartbeat, epoch: int) -> None:
        eid = hb.engine_id
        record = self._engines.get(eid) or await self._load(eid)
        order = epoch_order(record.fence if record else None, epoch)
        if order < 0:
            self.stats.heartbeats_stale_epoch += 1
            return
        store = self._store_or_raise()
        if record is None or order > 0:
            # a new incarnation: whatever the index holds for the engine is stale
            record = EngineRecord(Fence(epoch), hb.bucket, hb.namespace)
            await store.apply(eid, record.meta(), clear=True)
            log.info("engine %s: epoch %d", eid, epoch)
            self._engines[eid] = record
        record.ttl_ms = _ttl_ms(hb)
        record.bucket, record.namespace = hb.bucket, hb.namespace
        await store.heartbeat(eid, record.meta(), record.ttl_ms)
        self.stats.heartbeats += 1

    async def _load(self, engine_id: str) -> EngineRecord | None:
        """The record kept in Redis meta by an earlier index run, or None."""
        meta = await self._store_or_raise().load_meta(engine_id)
        if meta is None:
            return None
        last_seq = meta.seq if meta.seq >= 0 else None
        record = EngineRecord(Fence(meta.epoch, last_seq), meta.bucket, meta.namespace)
        self._engines[engine_id] = record
        return record

    async def _request_snapshot(self, engine_id: str, record: EngineRecord, reason: str) -> None:
        assert self._nc is not None
        record.snapshot_requested_at = time.monotonic()
        self.stats.snapshot_requests += 1
        request = SnapshotRequest(engine_id, reason)
        try:
            await self._nc.publish(subjects.engine_snapshot(engine_id), request.encode())
        except nats.errors.Error as e:  # closing or reconnecting: maintenance repeats it
            log.warning("engine %s: snapshot request not sent: %s", engine_id, e)

    # ----------------------------------------------------------------- maintenance

    async def _maintenance_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            await self._check_redis()
            if not self._redis_ok:
                continue
            try:
                await self._expire_dead()
                await self._retry_snapshot_requests()
            except RedisError as e:
                self._redis_failed(e)

    async def _check_redis(self) -> None:
        """Notice Redis failing, coming back or restarting; resync every engine after either."""
        store = self._store_or_raise()
        try:
            run_id = await store.run_id()
        except RedisError as e:
            self._redis_failed(e)
            return
        if self._redis_ok and run_id == self._redis_run_id:
            return
        if self._redis_run_id is None and self._redis_ok:
            self._redis_run_id = run_id  # first contact
            return
        try:
            await self._resync_all()
        except RedisError as e:
            self._redis_failed(e)
            return
        self._redis_ok, self._redis_run_id = True, run_id
        log.warning("redis is back (run id %s): resynced %d engines", run_id, len(self._engines))

    async def _resync_all(self) -> None:
        """Drop every known engine's entries and ask each for a snapshot."""
        store = self._store_or_raise()
        for eid in list(self._engines):
            async with self._lanes.lock(eid):
                record = self._engines.get(eid)
                if record is None:
                    continue
                record.fence = Fence(record.fence.epoch, None, True)
                await store.apply(eid, record.meta(), clear=True, alive_ttl_ms=record.ttl_ms)
        for eid, record in list(self._engines.items()):
            await self._request_snapshot(eid, record, "index lost redis state")
        self.stats.resyncs_after_redis += 1

    async def _expire_dead(self) -> None:
        store = self._store_or_raise()
        for eid in await store.dead_engines():
            async with self._lanes.lock(eid):
                dropped = await store.expire(eid)
                if dropped is None:
                    continue  # a heartbeat came in between
                self._engines.pop(eid, None)
            self._lanes.forget(eid)
            self.stats.engines_expired += 1
            log.info("engine %s expired: %d pages dropped", eid, dropped)

    async def _retry_snapshot_requests(self) -> None:
        """Under each engine's lock: a lane job that found a gap has sent its own request
        by the time the lock is free, so it is not doubled by a "repeated" one."""
        for eid in list(self._engines):
            async with self._lanes.lock(eid):
                record = self._engines.get(eid)
                if record is None or not record.fence.awaiting_snapshot:
                    continue
                asked = record.snapshot_requested_at
                if asked is None or time.monotonic() - asked >= self.config.snapshot_retry_s:
                    await self._request_snapshot(eid, record, "snapshot request repeated")

    # ----------------------------------------------------------------- errors

    def _store_or_raise(self) -> IndexStore:
        if self._store is None:
            raise RuntimeError("IndexService is not started")
        return self._store

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

    def _redis_failed(self, error: RedisError) -> None:
        self.stats.redis_errors += 1
        if self._redis_ok:
            log.error("redis failed: %s (every engine resyncs once it is back)", error)
        else:
            log.debug("redis still failing: %s", error)
        self._redis_ok = False

    def _out_of_sync(self, engine_id: str, epoch: int, bucket: str, namespace: str) -> EngineRecord:
        """A Redis write for the engine failed: it waits for a snapshot (requested on recovery)."""
        record = self._engines.get(engine_id)
        if record is None:
            record = EngineRecord(Fence(epoch, None, True), bucket, namespace)
            self._engines[engine_id] = record
        else:
            record.fence = Fence(record.fence.epoch, None, True)
        return record

    async def _on_nats_error(self, error: Exception) -> None:
        log.error("nats error: %s", error)

    async def _on_nats_disconnected(self) -> None:
        if not self._stopping:
            log.warning("nats disconnected")

    async def _on_nats_reconnected(self) -> None:
        log.warning("nats reconnected: events may have been lost (gaps trigger snapshots)")


# --------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m services.index",
        description="The index service: KV events and heartbeats from NATS -> Redis.",
    )
    defaults = IndexConfig()
    parser.add_argument("--nats-url", default=defaults.nats_url)
    parser.add_argument("--redis-url", default=defaults.redis_url)
    parser.add_argument(
        "--nats-credentials",
        default=None,
        metavar="FILE",
        help="NATS `user:password` (a 0600 file; `hicache-mesh credentials` makes them)",
    )
    parser.add_argument(
        "--redis-credentials", default=None, metavar="FILE", help="Redis `user:password` (0600)"
    )
    add_tls_args(parser, redis=True)
    parser.add_argument(
        "--sweep-interval",
        type=float,
        default=defaults.sweep_interval_s,
        help="seconds between expiry sweeps and Redis health checks",
    )
    parser.add_argument(
        "--snapshot-retry",
        type=float,
        default=defaults.snapshot_retry_s,
        help="seconds before an unanswered snapshot request is repeated",
    )
    parser.add_argument(
        "--redis-timeout",
        type=float,
        default=defaults.redis_timeout_s,
        help="seconds per Redis call before it counts as failed",
    )
    parser.add_argument(
        "--max-engines",
        type=int,
        default=defaults.max_engines,
        help="engines indexed at once; messages of a new engine beyond it are dropped",
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    return parser


def config_from_args(args: argparse.Namespace) -> IndexConfig:
    return IndexConfig(
        nats_url=args.nats_url,
        redis_url=args.redis_url,
        sweep_interval_s=args.sweep_interval,
        snapshot_retry_s=args.snapshot_retry,
        redis_timeout_s=args.redis_timeout,
        max_engines=args.max_engines,
        nats_credentials=_credentials(args.nats_credentials),
        redis_credentials=_credentials(args.redis_credentials),
        nats_tls_ca_file=tls_ca_file(args.nats_tls_ca_file),
        redis_tls_ca_file=tls_ca_file(args.redis_tls_ca_file),
    )


def _credentials(path: str | None) -> Credentials | None:
    return None if path is None else read_credentials(path)


async def run(args: argparse.Namespace) -> None:
    """Run the index until SIGINT or SIGTERM, then shut it down gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    service = IndexService(config_from_args(args))
    try:
        starting = asyncio.create_task(service.start(), name="index-start")
        stopped = asyncio.create_task(stop.wait(), name="index-stop-wait")
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        starting.cancel()  # SIGTERM while NATS is still unreachable: give up waiting
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        await stopped
    finally:
        await service.stop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(run(args))
    except (OSError, nats.errors.Error) as e:
        log.error("index failed: %s", e)
        return 1
    return 0
