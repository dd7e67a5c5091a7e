"""The live-engine table, kept from heartbeats; the one owner of engine liveness and load.

An engine is live when its last heartbeat is younger than `heartbeat_misses x interval_s`
(loop clock) and the router has not seen it fail a request in the last
`failed_quarantine_s`. A heartbeat with a new epoch (the engine restarted) ends a
quarantine at once.

Every engine has a role from its heartbeats: "colocated" (serves `GenerateRequest`s), or
"prefill" / "decode" (the two halves of a P/D request, DESIGN.md section 6). A bucket serves
by P/D when it has a live engine of each of those two roles (`pd_ready`), else by its
colocated engines.

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

from bus_schemas import Heartbeat, SchemaError, subjects
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
    local_tokens: int = 0  # in-flight tokens of this router's requests there
    was_live: bool = True


class EngineTable:
    def __init__(
        self, config: RouterConfig, metrics: RouterMetrics, clock: Callable[[], float]
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self._entries: dict[str, _Entry] = {}

    # ------------------------------------------------------------ updates

    def on_heartbeat_data(self, data: bytes) -> None:
        """Decode and apply one heartbeat message; malformed ones are counted and dropped."""
        try:
            hb = Heartbeat.decode(data)
        except SchemaError as e:
            self.metrics.bus_errors.labels("bad_heartbeat").inc()
            log.debug("dropped a heartbeat: %s", e)
            return
        bad = hb.interval_s <= 0 or hb.page_size <= 0 or hb.role not in ROLES
        if bad or not subjects.valid_token(hb.engine_id):
            self.metrics.bus_errors.labels("bad_heartbeat").inc()
            return
        self.observe(hb)

    def observe(self, hb: Heartbeat) -> None:
        now = self.clock()
        entry = self._entries.get(hb.engine_id)
        if entry is None:
            self._entries[hb.engine_id] = _Entry(hb, now, was_live=False)
            return
        if entry.heartbeat.epoch != hb.epoch:
            entry.failed_until = 0.0  # restarted: forget what failed before
        entry.heartbeat = hb
        entry.last_seen = now

    def mark_failed(self, engine_id: str, reason: str) -> None:
        """Take `engine_id` out of routing for the quarantine period."""
        entry = self._entries.get(engine_id)
        if entry is not None:
            entry.failed_until = self.clock() + self.config.failed_quarantine_s
            log.warning("engine %s marked failed: %s", engine_id, reason)

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
        )
