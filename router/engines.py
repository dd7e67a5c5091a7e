"""The live-engine table, kept from heartbeats; the one owner of engine liveness and load.

An engine is live when its last heartbeat is younger than `heartbeat_misses x interval_s`
(loop clock) and it is not sitting out a failure.

Failures (`mark_failed`: a request timed out, the engine went silent or sent garbage) are
grouped into incidents: every failure until the engine's next heartbeat is one incident (a
5 s NATS pause fails many requests at once, and they are all one incident). After an
incident the engine sits out until its first heartbeat received after the failure: the
heartbeat proves the engine and the bus work again, so a pause costs the pause plus at most
one heartbeat interval, not `failed_quarantine_s`. An engine that keeps failing while it
heartbeats (hung on requests, not on the bus) earns a strike per incident; at
`failed_strikes` incidents, each less than `failed_quarantine_s` after the one before, it
sits out the whole `failed_quarantine_s`, heartbeats or not. An engine whose step loop dies
exits (DESIGN.md 7a), so such an engine is rare and a strike counter is enough. A heartbeat
with a new epoch (the engine restarted) ends a quarantine and clears the strikes at once.

Every engine has a role from its heartbeats: "colocated" (serves `GenerateRequest`s), or
"prefill" / "decode" (the two halves of a P/D request, DESIGN.md section 6). A bucket serves
by P/D when it has a live engine of each of those two roles (`pd_ready`), else by its
colocated engines.

The table holds at most `max_engines` engines (DESIGN.md 7b: whoever reaches the bus can
announce engines): a heartbeat of a new engine beyond it takes the place of the engine gone
longest, or, when every engine is live, is dropped (counted as `bus_errors{kind=
"engine_cap"}`, logged once per interval). Everything built from the table (routing,
`/v1/models`, `/health`, the per-engine series of `/metrics`) is bounded with it.

Load is the in-flight tokens (prompt + max_tokens) of the engine: the larger of what this
router has running there and what the engine's last heartbeat reported (which also counts
other routers' requests, but lags).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from bus_schemas import Heartbeat, SchemaError, subjects
from bus_schemas.throttle import LogThrottle
from router.config import RouterConfig
from router.metrics import RouterMetrics

log = logging.getLogger(__name__)

FORGET_AFTER_S = 300.0  # an engine silent this long leaves the table

COLOCATED, PREFILL, DECODE = "colocated", "prefill", "decode"
ROLES = frozenset({COLOCATED, PREFILL, DECODE})


@dataclass(frozen=True, slots=True)
class EngineView:
    """What routing needs to know about one live engine, as of the call."""

    engine_id: str
    bucket: str
    model: str
    namespace: str
    page_size: int
    context_len: int
    vocab_size: int
    load: int  # in-flight tokens
    role: str  # one of ROLES
    card_digest: str  # its ModelCard's (router.models): requests are tokenized by the card
    store_id: str = ""  # its external store (engines with the same id share it)


def pd_ready(engines: Iterable[EngineView]) -> bool:
    """Whether `engines` hold a live prefill and a live decode engine (P/D serving)."""
    roles = {e.role for e in engines}
    return PREFILL in roles and DECODE in roles


def can_serve(engines: Iterable[EngineView]) -> bool:
    """Whether `engines` (one bucket) can serve a generation request at all."""
    engines = list(engines)
    return pd_ready(engines) or any(e.role == COLOCATED for e in engines)


@dataclass(slots=True)
class _Entry:
    heartbeat: Heartbeat
    last_seen: float  # loop time of the last heartbeat
    failed_until: float = 0.0  # loop time until which the engine sits out
    failed: bool = False  # an incident is open: failed since its last heartbeat
    strikes: int = 0  # incidents in a row, each within failed_quarantine_s of the last
    last_failure: float = float("-inf")  # loop time of the last failure
    local_tokens: int = 0  # in-flight tokens of this router's requests there
    was_live: bool = True
    prompt_tokens: int = 0  # of this router's requests served there (cache hit rate)
    cached_tokens: int = 0


class EngineTable:
    def __init__(
        self, config: RouterConfig, metrics: RouterMetrics, clock: Callable[[], float]
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self._entries: dict[str, _Entry] = {}
        self._throttle = LogThrottle(log)
        metrics.registry.register(EngineCollector(self))

    # ------------------------------------------------------------ updates

    def on_heartbeat_data(self, data: bytes, sender: str | None = None) -> Heartbeat | None:
        """Decode and apply one heartbeat message, and return it; malformed ones are
        counted and dropped (None), and so are forged ones: an engine id other than
        `sender`, the id its subject speaks for (`subjects.sender_of`; NATS permissions let
        only that engine publish there)."""
        try:
            hb = Heartbeat.decode(data)
        except SchemaError as e:
            self.metrics.bus_errors.labels("bad_heartbeat").inc()
            log.debug("dropped a heartbeat: %s", e)
            return None
        bad = hb.interval_s <= 0 or hb.page_size <= 0 or hb.role not in ROLES
        if bad or not subjects.valid_token(hb.engine_id):
            self.metrics.bus_errors.labels("bad_heartbeat").inc()
            return None
        if sender is not None and hb.engine_id != sender:
            self.metrics.bus_errors.labels("forged_heartbeat").inc()
            self._throttle.warning(
                "forged_heartbeat",
                "dropped a heartbeat for %.64r on %.64r's subject",
                hb.engine_id,
                sender,
            )
            return None
        return hb if self.observe(hb) else None

    def observe(self, hb: Heartbeat) -> bool:
        """Apply `hb`; False when its engine is new and the table is full."""
        now = self.clock()
        entry = self._entries.get(hb.engine_id)
        if entry is None:
            if len(self._entries) >= self.config.max_engines and not self._make_room(now):
                self.metrics.bus_errors.labels("engine_cap").inc()
                self._throttle.warning(
                    "engine_cap",
                    "heartbeat of engine %s dropped: %d engines are live (--max-engines)",
                    hb.engine_id,
                    len(self._entries),
                )
                return False
            self._entries[hb.engine_id] = _Entry(hb, now, was_live=False)
            return True
        if entry.heartbeat.epoch != hb.epoch:
            entry.failed_until, entry.failed, entry.strikes = 0.0, False, 0  # restarted
        elif entry.failed:
            self._readmit(hb.engine_id, entry, now)
        entry.heartbeat = hb
        entry.last_seen = now
        return True

    def _make_room(self, now: float) -> bool:
        """Forget the engine gone longest (not live, nothing of ours in flight there)."""
        gone = [
            (e.last_seen, engine_id)
            for engine_id, e in self._entries.items()
            if not self._live(e, now) and e.local_tokens == 0
        ]
        if not gone:
            return False
        del self._entries[min(gone)[1]]
        return True

    def knows(self, engine_id: str) -> bool:
        return engine_id in self._entries

    def epoch_of(self, engine_id: str) -> str:
        """The epoch of the engine's last heartbeat ("" for an unknown engine)."""
        entry = self._entries.get(engine_id)
        return "" if entry is None else entry.heartbeat.epoch

    def mark_failed(self, engine_id: str, reason: str, epoch: str = "") -> None:
        """Take `engine_id` out of routing until its next heartbeat (or, at
        `failed_strikes` incidents in a row, for `failed_quarantine_s`). A failure of a
        request sent to an earlier `epoch` is not held against the restarted engine."""
        entry = self._entries.get(engine_id)
        if entry is None:
            return
        if epoch and epoch != entry.heartbeat.epoch:
            log.info("engine %s: a failure of its previous epoch ignored: %s", engine_id, reason)
            return
        now, quarantine = self.clock(), self.config.failed_quarantine_s
        if not entry.failed:  # a new incident
            if now - entry.last_failure > quarantine:
                entry.strikes = 0
            entry.strikes += 1
            entry.failed = True
            log.warning("engine %s marked failed (strike %d): %s", engine_id, entry.strikes, reason)
        entry.last_failure = now
        entry.failed_until = now + quarantine

    def _readmit(self, engine_id: str, entry: _Entry, now: float) -> None:
        """A heartbeat after a failure: back in routing, unless out of strikes."""
        if entry.strikes >= self.config.failed_strikes and now < entry.failed_until:
            return
        entry.failed, entry.failed_until = False, 0.0
        log.info("engine %s heartbeats after failing: back in routing", engine_id)

    def account(self, engine_id: str, prompt_tokens: int, cached_tokens: int) -> None:
        """A request served by `engine_id`: counts toward its cache hit rate."""
        entry = self._entries.get(engine_id)
        if entry is not None:
            entry.prompt_tokens += prompt_tokens
            entry.cached_tokens += cached_tokens

    @contextmanager
    def lease(self, engine_id: str, tokens: int) -> Iterator[None]:
        """Count `tokens` as in flight on `engine_id` for the duration of the block."""
        entry = self._entries.get(engine_id)
        if entry is not None:
            entry.local_tokens += tokens
        try:
            yield
        finally:
            if entry is not None:
                entry.local_tokens -= tokens

    # ------------------------------------------------------------ queries

    def is_alive(self, engine_id: str) -> bool:
        entry = self._entries.get(engine_id)
        return entry is not None and self._live(entry, self.clock())

    def live(self, bucket: str | None = None, role: str | None = None) -> list[EngineView]:
        """Live engines (of `bucket` and `role` when given), sorted by id."""
        now = self.clock()
        out = [
            self._view(e)
            for e in self._entries.values()
            if self._live(e, now)
            and (bucket is None or e.heartbeat.bucket == bucket)
            and (role is None or e.heartbeat.role == role)
        ]
        return sorted(out, key=lambda v: v.engine_id)

    def live_heartbeats(self) -> list[tuple[Heartbeat, float]]:
        """(last heartbeat, cache hit rate seen by this router) of every live engine."""
        now = self.clock()
        return [
            (e.heartbeat, e.cached_tokens / e.prompt_tokens if e.prompt_tokens else 0.0)
            for e in self._entries.values()
            if self._live(e, now)
        ]

    def sweep(self) -> None:
        """Log liveness changes, update the gauge, forget long-gone engines."""
        now = self.clock()
        for engine_id, entry in list(self._entries.items()):
            live = self._live(entry, now)
            if live != entry.was_live:
                log.info("engine %s is %s", engine_id, "live" if live else "gone")
                entry.was_live = live
            if now - entry.last_seen > FORGET_AFTER_S and entry.local_tokens == 0:
                del self._entries[engine_id]
        self.metrics.live_engines.set(sum(e.was_live for e in self._entries.values()))

    async def run_sweeper(self, period_s: float = 0.5) -> None:
        while True:
            self.sweep()
            await asyncio.sleep(period_s)

    # ------------------------------------------------------------ internals

    def _live(self, entry: _Entry, now: float) -> bool:
        deadline = entry.last_seen + self.config.heartbeat_misses * entry.heartbeat.interval_s
        return now <= deadline and now >= entry.failed_until

    @staticmethod
    def _view(entry: _Entry) -> EngineView:
        hb = entry.heartbeat
        return EngineView(
            engine_id=hb.engine_id,
            bucket=hb.bucket,
            model=hb.model,
            namespace=hb.namespace,
            page_size=hb.page_size,
            context_len=hb.context_len,
            vocab_size=hb.vocab_size,
            load=max(entry.local_tokens, hb.inflight_tokens),
            role=hb.role,
            card_digest=hb.card_digest,
            store_id=hb.store_id,
        )


class EngineCollector(Collector):
    """Per-engine metrics from the live engines' last heartbeats, built at scrape time, so
    an engine that left the table leaves no stale series. Names follow SGLang where the
    concept is the same (`sglang:num_running_reqs`, ...), labels `model_name`, `engine_id`
    and `bucket` (sum by bucket for per-bucket figures)."""

    GAUGES = (
        ("sglang:num_running_reqs", "running requests", "running"),
        ("sglang:num_queue_reqs", "queued requests", "waiting"),
        ("sglang:token_usage", "device KV pages in use (cache included) / pages", "token_usage"),
        ("hicache_engine_host_token_usage", "host KV pages in use / pages", "host_token_usage"),
        (
            "sglang:gen_throughput",
            "output tokens/s the engine streamed over its last heartbeat interval",
            "gen_throughput",
        ),
    )
    COUNTERS = (
        ("hicache_engine_cached_tokens", "prompt tokens reused from cache", "cached_tokens"),
        ("hicache_engine_generation_tokens", "output tokens streamed", "generation_tokens"),
        ("hicache_engine_cache_loads", "host -> device loads", "num_loads"),
        ("hicache_engine_cache_backups", "device -> host backups", "num_backups"),
        (
            "hicache_engine_evicted_device_pages",
            "device KV pages evicted from the radix cache",
            "evicted_device_pages",
        ),
        (
            "hicache_engine_evicted_host_pages",
            "host KV pages evicted from the radix cache",
            "evicted_host_pages",
        ),
        (
            "hicache_engine_storage_read_pages",
            "KV pages read from external storage into the cache",
            "storage_pages_read",
        ),
        (
            "hicache_engine_storage_written_pages",
            "KV pages external storage took from the host tier",
            "storage_pages_written",
        ),
        (
            "hicache_engine_storage_write_failures",
            "writes to external storage that stopped early (full or read-only store)",
            "storage_write_failures",
        ),
        (
            "hicache_engine_storage_quarantined",
            "objects in external storage that failed verification (set aside, never read)",
            "storage_quarantined",
        ),
    )

    def __init__(self, table: EngineTable) -> None:
        self.table = table

    def describe(self) -> list[Metric]:
        return []  # the registry must not call collect() at registration

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "engine_id", "bucket"]
        live = self.table.live_heartbeats()
        for name, doc, field in self.GAUGES:
            g = GaugeMetricFamily(name, doc, labels=labels)
            for hb, _ in live:
                g.add_metric([hb.model, hb.engine_id, hb.bucket], float(getattr(hb, field)))
            yield g
        for name, doc, field in self.COUNTERS:
            c = CounterMetricFamily(name, doc, labels=labels)
            for hb, _ in live:
                c.add_metric([hb.model, hb.engine_id, hb.bucket], float(getattr(hb, field)))
            yield c
        rate = GaugeMetricFamily(
            "sglang:cache_hit_rate",
            "cached / prompt tokens of this router's requests served by the engine",
            labels=labels,
        )
        for hb, hit_rate in live:
            rate.add_metric([hb.model, hb.engine_id, hb.bucket], hit_rate)
        yield rate
        yield from _spec_gauges(live, labels)


def _spec_gauges(live: list[tuple[Heartbeat, float]], labels: list[str]) -> Iterator[Metric]:
    """Speculative decoding per engine since it started (0 without speculation), from its
    heartbeat's counters: tokens per verify round (accepted + 1) and accepted / proposed."""
    length = GaugeMetricFamily(
        "sglang:spec_accept_length", "tokens emitted per speculative verify round", labels=labels
    )
    rate = GaugeMetricFamily(
        "sglang:spec_accept_rate", "draft tokens accepted / draft tokens proposed", labels=labels
    )
    for hb, _ in live:
        key = [hb.model, hb.engine_id, hb.bucket]
        rounds, proposed = hb.spec_verify_rounds, hb.spec_proposed_tokens
        length.add_metric(key, hb.spec_emitted_tokens / rounds if rounds else 0.0)
        rate.add_metric(key, hb.spec_accepted_tokens / proposed if proposed else 0.0)
    yield length
    yield rate
