"""What the mesh can serve: `/v1/models`, `/health` (liveness), `/ready` (readiness),
`/metrics` (Prometheus); and `unavailable`, the 503 of a request nothing can serve."""

from __future__ import annotations

import asyncio
import os

from aiohttp import web

from router import keys
from router.engines import EngineView, can_serve
from router.errors import ApiError, json_response
from router.generation import no_engine_error
from router.readiness import bucket_readiness

REDIS_DOWN = "redis is down: cache-aware routing is off, routing by load"
INDEX_RESYNC = (
    "the Redis primary is not the one the index resynced (a failover): routing by load until "
    "the index has rebuilt it from the engines"
)
BUS_DOWN = "message bus (NATS) unavailable"
BUS_FAILOVER_WAIT_S = 0.5  # a NATS cluster's failover takes milliseconds: wait that out


async def models(request: web.Request) -> web.Response:
    seen: dict[str, int] = {}
    for e in _ready(request.app, request.app[keys.TABLE].live()):
        seen[e.model] = max(seen.get(e.model, 0), e.context_len)
    data = [
        {"id": m, "object": "model", "created": 0, "owned_by": "hicache-mesh", "max_model_len": n}
        for m, n in sorted(seen.items())
    ]
    return json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    """200 when NATS is up and some bucket can serve: a live colocated engine, or a live
    prefill and decode engine pair, whose model card the router holds. The status is
    "degraded" (still 200: requests are served) with `reasons` when a dependency is down
    that only costs cache reuse (Redis)."""
    nc = request.app[keys.NATS]
    live = request.app[keys.TABLE].live()
    ready = _ready(request.app, live)
    buckets: dict[str, list[EngineView]] = {}
    for e in ready:
        buckets.setdefault(e.bucket, []).append(e)
    serving = any(can_serve(engines) for engines in buckets.values())
    index = request.app[keys.ROUTER].index
    redis_up = index.up
    state = {
        "nats_connected": nc.is_connected,
        "redis_connected": redis_up,
        "live_engines": [e.engine_id for e in live],
        "ready_engines": [e.engine_id for e in ready],  # live, and their model card is here
        "models": sorted({e.model for e in ready}),
        "roles": {e.engine_id: e.role for e in live},
        "pid": os.getpid(),  # a launcher checks that the router answering is the one it started
    }
    if nc.is_connected and serving:
        reasons = [] if redis_up else [REDIS_DOWN]
        reasons += [INDEX_RESYNC] if redis_up and not index.synced else []
        status = "degraded" if reasons else "ok"
        return json_response({"status": status, "reasons": reasons} | state)
    if not nc.is_connected:
        why = BUS_DOWN
    elif can_serve(live):
        why = "waiting for the engines' model cards"
    else:
        why = "no live engine can serve"
    return ApiError(503, why, code="unhealthy", retry_after_s=1).response(state)


async def ready(request: web.Request) -> web.Response:
    """200 when every configured bucket can serve (`router.readiness`), else 503 naming what
    is missing (`missing`, and per bucket its ready engines by role): the readiness probe of
    compose, Kubernetes and `hicache-mesh up`. `/health` stays the liveness answer."""
    app = request.app
    connected = app[keys.NATS].is_connected
    live = app[keys.TABLE].live()
    names = [b.name for b in app[keys.CONFIG].buckets]
    states = bucket_readiness(names, live, _ready(app, live))
    missing = ([] if connected else [BUS_DOWN]) + [s.missing for s in states if s.missing]
    body = {
        "buckets": {s.name: s.as_dict() for s in states},
        "missing": missing,
        "pid": os.getpid(),
    }
    if not missing:
        return json_response({"status": "ready"} | body)
    err = ApiError(503, "not ready: " + "; ".join(missing), code="not_ready", retry_after_s=1)
    return err.response({"status": "not_ready"} | body)


def _ready(app: web.Application, engines: list[EngineView]) -> list[EngineView]:
    """The engines whose model card the router holds (it can parse requests for them)."""
    cards = app[keys.MODELS]
    return [e for e in engines if cards.get(e.card_digest) is not None]


async def bus_settled(app: web.Application) -> None:
    """Return at once with NATS connected; while it is reconnecting (its server was lost: a
    cluster's client moves to the next server in milliseconds), once it is back or after
    `BUS_FAILOVER_WAIT_S`, whichever is first: a request that arrives during a failover is
    served, not refused (a lone server's restart still answers 503 after the wait)."""
    nc = app[keys.NATS]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BUS_FAILOVER_WAIT_S
    while nc.is_reconnecting and loop.time() < deadline:
        await asyncio.sleep(0.005)


def unavailable(app: web.Application, bucket: str) -> ApiError:
    """Why nothing can serve: with NATS down the engines' heartbeats cannot reach us, so
    name NATS, not the engines (they may be fine)."""
    if not app[keys.NATS].is_connected:
        return ApiError(
            503, f"{BUS_DOWN}; try again shortly", code="bus_unavailable", retry_after_s=1
        )
    return no_engine_error(bucket)


async def prometheus(request: web.Request) -> web.Response:
    m = request.app[keys.METRICS]
    request.app[keys.TABLE].sweep()
    return web.Response(body=m.render(), headers={"Content-Type": m.content_type})
