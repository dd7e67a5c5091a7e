"""Cache-aware engine choice.

Per request: the page hashes of the prompt (namespace and page size from the bucket's
heartbeats; the pages it shares with a recent prompt are not hashed again, `PageChains`),
ONE `EVALSHA` of `PREFIX_LOOKUP_LUA` (a binary search per engine over the page chain, which
every engine holds prefix-closed), then for every live candidate

    score = page_size x (device_weight x device pages + host_weight x host-only pages)
            - load_weight x in-flight tokens

and the highest score wins (ties: less load, then round robin). A P/D request picks its
decode and its prefill engine this way from the same lookup (`choose_pd`), each by its own
cache: two routing decisions. Redis trouble never fails a request: on an error or a lookup
slower than `redis_timeout_s` the choice is by load alone, and the failure is counted apart
as `redis_down` or `redis_timeout` (see `PrefixIndex`). With Sentinel, a Redis the index has
not resynced (a replica promoted by a failover may list pages an engine dropped since) is
not trusted either: the choice is by load, counted as `index_resync`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bus_schemas import redis_keys
from bus_schemas.sentinel import INDEX_SYNCED, same_server
from bus_schemas.token_ids import TokenIds
from router import buckets
from router.config import RouterConfig
from router.engines import EngineView
from router.metrics import RouterMetrics
from router.page_chains import PageChains
from router.resp import NoScriptError, RedisError, RespClient, discard

log = logging.getLogger(__name__)

LOOKUP_SHA = hashlib.sha1(redis_keys.PREFIX_LOOKUP_LUA.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """How much of a prompt's page chain one engine holds, from the start."""

    pages: int  # leading pages held in any tier
    device_pages: int  # leading pages held on the device (a prefix of `pages`)
    storage_pages: int = 0  # leading pages past `pages` that the engine's external store holds


@dataclass(frozen=True, slots=True)
class RouteChoice:
    engine: EngineView
    reason: str  # "cache" | "load" | "redis_down" | "redis_timeout" | "index_resync" | "retry"
    hit: PrefixHit  # what Redis said the engine holds (zero when unknown)
    known: bool = True  # whether `hit` is the index's answer (False: no lookup was made)
    lookup_s: float = 0.0  # the Redis round trip the choice waited for (`Lookup.wait_s`)

    def predicted_tokens(self, num_prompt_tokens: int) -> int | None:
        """The prompt tokens the index says the engine can reuse (whole pages, never the
        last token, which is always computed); None when the index was not asked."""
        if not self.known:
            return None
        ps = self.engine.page_size
        cacheable = max(0, num_prompt_tokens - 1) // ps * ps
        return min((self.hit.pages + self.hit.storage_pages) * ps, cacheable)


@dataclass(frozen=True, slots=True)
class Lookup:
    """The answer of one prefix lookup: hits per engine, or why there are none."""

    hits: dict[str, PrefixHit] | None  # None: Redis could not answer in time
    failure: str = ""  # "redis_down" | "redis_timeout" | "index_resync" when `hits` is None
    made: bool = True  # False: one candidate, so the index was not asked
    wait_s: float = 0.0  # from the lookup's send to its answer (the caller's `meanwhile` in it)


RESYNC_PROBE_S = 0.2  # probe period while Redis answers but the index has not resynced it
BUDGET_STRETCH = 10  # a lookup waits at most this many budgets, however busy the loop


@contextlib.asynccontextmanager
async def _budget(budget_s: float) -> AsyncIterator[None]:
    """`asyncio.timeout(budget_s)`, except that the time the event loop runs late does not
    count. A busy router runs every callback late, the one that reads Redis' reply too, so
    a deadline check that runs `late` seconds after it was due moves the deadline `late`
    on, and cancels only when it runs on time (up to `BUDGET_STRETCH` budgets in all). An
    idle router cancels a slow Redis at `budget_s`; a busy one does not blame Redis for
    its own queue."""
    loop = asyncio.get_running_loop()
    due = loop.time() + budget_s
    limit = loop.time() + BUDGET_STRETCH * budget_s
    async with asyncio.timeout(None) as timeout:
        handle: asyncio.TimerHandle | None = None

        def check(due: float) -> None:
            nonlocal handle
            now = loop.time()
            late = now - due
            if late > 0.001 and now + late < limit:
                handle = loop.call_at(now + late, check, now + late)
            else:
                timeout.reschedule(now)

        handle = loop.call_at(due, check, due)
        try:
            yield
        finally:
            handle.cancel()


class PrefixIndex:
    """Prefix lookups against the Redis index, with a time budget, an outage breaker and a
    background health probe.

    Redis is "up" until a lookup or a probe fails to connect, then "down" until a probe
    (a PING every `redis_probe_s`, whether or not requests come) answers again: recovery is
    seen even with no traffic, and `/health` and the `redis_up` gauge follow it. A lookup
    over its budget is a timeout, not an outage: it is counted apart (`redis_timeout`), and
    it opens the breaker (route by load for `redis_retry_s`) only when at least
    `redis_breaker_ratio` of the last `redis_breaker_window` lookups timed out: a stopped
    Redis times out every lookup, a busy one a few, and those few say nothing about the next.

    With Sentinel (`config.redis_sentinels`) the server behind the connection can change at
    any reconnect, to a promoted replica whose entries may be stale. A connection's answers
    count only once a probe found, on that very connection (`RespClient.generation`), the
    index's marker naming the server (`INDEX_SYNCED` equal to `INFO server`'s run id);
    until then every lookup is `index_resync` and the choice is by load.
    """

    def __init__(
        self,
        redis: RespClient,
        config: RouterConfig,
        metrics: RouterMetrics,
        clock: Callable[[], float],
    ) -> None:
        self.redis = redis
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self.up = True  # optimistic until the first probe or lookup says otherwise
        self._skip_until = 0.0
        self._outcomes: deque[bool] = deque(maxlen=config.redis_breaker_window)  # True: timeout
        self._in_outage = False
        self._probe: asyncio.Task[None] | None = None
        self.require_synced = bool(config.redis_sentinels)
        self._synced_generation: int | None = None  # the connection found resynced
        metrics.redis_up.set(1)

    @property
    def synced(self) -> bool:
        """Whether lookups may be trusted: no Sentinel, or the index resynced the server."""
        return not self.require_synced or self._synced_generation == self.redis.generation

    async def start(self) -> None:
        """Probe Redis once, register the lookup script, start the background probe."""
        await self.probe()
        await self.load_script()
        self._probe = asyncio.create_task(self._run_probe(), name="redis-probe")

    async def stop(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
            self._probe = None

    async def load_script(self) -> None:
        """Register the lookup script (best effort: lookups reload it on NOSCRIPT)."""
        try:
            async with asyncio.timeout(1.0):
                await self.redis.script_load(redis_keys.PREFIX_LOOKUP_LUA)
        except (RedisError, OSError, TimeoutError) as e:
            log.warning("could not load the prefix lookup script into Redis: %s", e)

    async def probe(self) -> bool:
        """One PING; updates `up` and the gauge. True when Redis answered."""
        try:
            async with asyncio.timeout(self.config.redis_probe_timeout_s):
                await self.redis.ping()
                if self.require_synced:
                    await self._check_synced()
        except (RedisError, OSError, TimeoutError) as e:
            self._set_down(e)
            return False
        if not self.up:
            log.info("Redis answers again: routing by cache resumes")
            self.up, self._in_outage, self._skip_until = True, False, 0.0
            self._outcomes.clear()
            self.metrics.redis_up.set(1)
        return True

    async def _check_synced(self) -> None:
        """Trust the current connection when the index's marker names its server."""
        generation = self.redis.generation
        info, marker = await asyncio.gather(
            self.redis.execute("INFO", "server"), self.redis.execute("GET", INDEX_SYNCED)
        )
        run_id = _info_field(info, "run_id")
        was = self.synced
        ok = same_server(marker, run_id) and self.redis.generation == generation
        self._synced_generation = generation if ok else None
        if ok and not was:
            log.info("the index resynced Redis (run id %s): routing by prefix resumes", run_id)
        elif was and not ok:
            log.warning("Redis is not the one the index resynced: routing by load meanwhile")

    async def _run_probe(self) -> None:
        while True:
            period = self.config.redis_probe_s
            if self.up and not self.synced:  # waiting for the index's resync: look often
                period = min(period, RESYNC_PROBE_S)
            await asyncio.sleep(period)
            await self.probe()

    async def lookup(
        self,
        hashes: Sequence[str] | str,
        store_ids: Sequence[str] = (),
        meanwhile: Callable[[], object] = lambda: None,
    ) -> Lookup:
        """Hits per engine holding the first page of `hashes` (hex, one per item or
        concatenated), and per store of `store_ids` holding it (keyed `STORE_MARK` + id);
        `hits` None when Redis is unavailable (the caller routes by load).

        `meanwhile()` runs once, after the lookup is on its way to Redis and before its
        reply is awaited: work of the caller's that does not need the answer runs during
        the round trip, and the reply is usually there when it is done (no idle wait)."""
        skipped = self._skipped(hashes)
        if skipped is not None:
            meanwhile()
            return skipped
        argv = redis_keys.lookup_argv(hashes, store_ids)
        started = time.perf_counter()
        reply = self.redis.send("EVALSHA", LOOKUP_SHA, "0", *argv)
        try:
            meanwhile()
        except BaseException:
            discard(reply)
            raise
        try:
            found = await self._answer(reply, argv)
        finally:
            wait_s = time.perf_counter() - started
            self.metrics.prefix_lookup.observe(wait_s)
        return dataclasses.replace(found, wait_s=wait_s)

    async def _answer(self, reply: Awaitable[Any], argv: list[str]) -> Lookup:
        """The lookup from Redis' reply, within the budget."""
        try:
            async with _budget(self.config.redis_timeout_s):
                flat = await self._evalsha(reply, argv)
        except TimeoutError:
            return self._on_timeout()
        except (RedisError, OSError) as e:
            self._set_down(e)
            return Lookup(None, "redis_down")
        self._outcomes.append(False)
        if not self.synced:  # answered by a connection opened since the last probe
            return Lookup(None, "index_resync")
        try:
            hits = {
                str(flat[i]): PrefixHit(int(flat[i + 1]), int(flat[i + 2]))
                for i in range(0, len(flat) - 2, 3)
            }
        except (TypeError, ValueError, IndexError) as e:
            self.metrics.store_errors.inc()
            log.warning("malformed prefix lookup reply: %r", e)
            return Lookup(None, "redis_down")
        return Lookup(hits)

    def _skipped(self, hashes: Sequence[str] | str) -> Lookup | None:
        """The answer without asking Redis: nothing to look up, or Redis down or skipped."""
        if not hashes:
            return Lookup({})
        if not self.up:
            return Lookup(None, "redis_down")
        if self.clock() < self._skip_until:
            return Lookup(None, "redis_timeout")
        if not self.synced:
            return Lookup(None, "index_resync")
        return None

    async def _evalsha(self, reply: Awaitable[Any], argv: list[str]) -> list[Any]:
        try:
            flat = await reply
        except NoScriptError:
            await self.redis.script_load(redis_keys.PREFIX_LOOKUP_LUA)
            flat = await self.redis.evalsha(LOOKUP_SHA, 0, *argv)
        return flat if isinstance(flat, list) else [flat]

    def _on_timeout(self) -> Lookup:
        self.metrics.store_timeouts.inc()
        cfg, outcomes = self.config, self._outcomes
        outcomes.append(True)
        timeouts = sum(outcomes)
        if len(outcomes) == cfg.redis_breaker_window and timeouts >= (
            cfg.redis_breaker_ratio * cfg.redis_breaker_window
        ):
            outcomes.clear()
            self._skip_until = self.clock() + cfg.redis_retry_s
            log.warning(
                "%d of the last %d Redis prefix lookups took over %.0f ms: routing by load "
                "for %.1f s",
                timeouts,
                cfg.redis_breaker_window,
                1000 * cfg.redis_timeout_s,
                cfg.redis_retry_s,
            )
        return Lookup(None, "redis_timeout")

    def _set_down(self, e: BaseException) -> None:
        self.metrics.store_errors.inc()
        self.metrics.redis_up.set(0)
        self.up = False
        self._synced_generation = None
        if not self._in_outage:
            self._in_outage = True
            log.warning("Redis prefix lookup failed (%r): routing by load until it answers", e)


class Router:
    """Chooses an engine for one request among the live candidates of its bucket."""

    def __init__(self, index: PrefixIndex, config: RouterConfig, metrics: RouterMetrics) -> None:
        self.index = index
        self.config = config
        self.metrics = metrics
        self.chains = PageChains(config.page_chain_cache_bytes)
        self._turn = itertools.count()

    def select_bucket(
        self, prompt_len: int, max_tokens: int, can_serve: Callable[[str], bool]
    ) -> str:
        """The smallest bucket whose `max_len` fits `prompt_len + max_tokens` and that can
        serve (`router.buckets.select`)."""
        bucket = buckets.select(self.config.buckets, prompt_len + max_tokens, can_serve)
        self.metrics.child(self.metrics.bucket_requests, bucket).inc()
        return bucket

    async def choose(
        self,
        candidates: Sequence[EngineView],
        input_ids: TokenIds,
        cache_salt: str,
        retry: bool = False,
        meanwhile: Callable[[], object] = lambda: None,
    ) -> RouteChoice:
        """The best of `candidates` (non-empty, one bucket) for this prompt. `meanwhile()`
        runs once before the choice is made: during the Redis round trip when there is one
        (the request's message, which does not depend on the engine, is encoded then)."""
        if not candidates:
            raise ValueError("no candidates")
        found = Lookup({}, made=False)
        if len(candidates) > 1:
            found = await self._lookup(candidates, input_ids, cache_salt, meanwhile)
        else:
            meanwhile()
        return self._pick(candidates, found, candidates[0].namespace, retry)

    async def choose_pd(
        self,
        decodes: Sequence[EngineView],
        prefills: Sequence[EngineView],
        input_ids: TokenIds,
        cache_salt: str,
        retry: bool = False,
    ) -> tuple[RouteChoice, RouteChoice]:
        """The best decode and the best prefill engine (both non-empty) for this prompt, by
        the same score, from ONE lookup (decode engines publish their cache too)."""
        if not decodes or not prefills:
            raise ValueError("no candidates")
        found = Lookup({}, made=False)
        if len(decodes) > 1 or len(prefills) > 1:
            found = await self._lookup([*decodes, *prefills], input_ids, cache_salt)
        namespace = decodes[0].namespace
        return (
            self._pick(decodes, found, namespace, retry),
            self._pick(prefills, found, namespace, retry),
        )

    async def _lookup(
        self,
        candidates: Sequence[EngineView],
        input_ids: TokenIds,
        cache_salt: str,
        meanwhile: Callable[[], object] = lambda: None,
    ) -> Lookup:
        """Hits per engine and per store of the candidates, for pages hashed as the first
        candidate hashes them."""
        first = candidates[0]
        hashes = self.chains.hex_hashes(input_ids, first.page_size, first.namespace, cache_salt)
        stores = sorted({e.store_id for e in candidates if e.store_id})
        return await self.index.lookup(hashes, stores, meanwhile)

    def _pick(
        self,
        candidates: Sequence[EngineView],
        found: Lookup,
        namespace: str,
        retry: bool,
    ) -> RouteChoice:
        """The highest score (ties: less load, then round robin); counts the decision.
        Hits count only for engines of `namespace` (the one the page hashes were made in)."""
        turn, hits = next(self._turn), found.hits
        best_key: tuple[float, int, int] | None = None
        best: EngineView = candidates[0]
        for i, engine in enumerate(candidates):
            hit = _hit(hits, engine) if engine.namespace == namespace else None
            key = (self._score(engine, hit), -engine.load, -((i - turn) % len(candidates)))
            if best_key is None or key > best_key:
                best_key, best = key, engine
        hit = _hit(hits, best) or PrefixHit(0, 0)
        if retry:
            reason = "retry"
        elif hits is None:
            reason = found.failure or "redis_down"
        else:
            reason = "cache" if hit.pages > 0 else "load"
        self.metrics.child(self.metrics.routing, reason).inc()
        return RouteChoice(best, reason, hit, found.made and hits is not None, found.wait_s)

    def _score(self, engine: EngineView, hit: PrefixHit | None) -> float:
        cached = 0.0
        if hit is not None:
            host_pages = hit.pages - hit.device_pages
            cfg = self.config
            cached = engine.page_size * (
                cfg.device_weight * hit.device_pages
                + cfg.host_weight * host_pages
                + cfg.storage_weight * hit.storage_pages
            )
        return cached - self.config.load_weight * engine.load


def _info_field(info: object, name: str) -> str:
    """One `field:value` line of an `INFO` reply ("" when absent)."""
    text = info.decode() if isinstance(info, bytes) else str(info)
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key == name:
            return value.strip()
    return ""


def _hit(hits: dict[str, PrefixHit] | None, engine: EngineView) -> PrefixHit | None:
    """What `engine` holds of the prompt, its store's pages past that included."""
    if not hits:
        return None
    own = hits.get(engine.engine_id)
    stored = hits.get(redis_keys.STORE_MARK + engine.store_id) if engine.store_id else None
    if stored is None:
        return own
    own = own or PrefixHit(0, 0)
    return PrefixHit(own.pages, own.device_pages, max(0, stored.pages - own.pages))
