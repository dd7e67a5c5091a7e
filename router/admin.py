"""Operations on every live engine: `/flush_cache` and `/stats`, asked over NATS."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from nats.errors import Error as NatsError

from bus_schemas import (
    ErrorReply,
    FlushReply,
    FlushRequest,
    SchemaError,
    StatsReply,
    StatsRequest,
    subjects,
)
from router import keys
from router.errors import ApiError, json_response
from router.probes import unavailable


async def flush_cache(request: web.Request) -> web.Response:
    """Flush every live engine's cache. 200 when all did; 409 when one refused; 503 when
    none is live or one did not answer. The body lists each engine's result."""
    engines = [e.engine_id for e in request.app[keys.TABLE].live()]
    if not engines:
        raise unavailable(request.app, "any")
    replies = await asyncio.gather(*(_flush_one(request.app, e) for e in engines))
    results = {e: r for e, r in zip(engines, replies, strict=True)}
    if all(r["success"] for r in results.values()):
        return json_response({"success": True, "results": results})
    if any(r["answered"] for r in results.values() if not r["success"]):
        err = ApiError(409, "an engine refused to flush", code="flush_refused")
    else:
        err = ApiError(503, "an engine did not answer the flush", code="flush_unanswered")
    return err.response({"results": results})


async def _flush_one(app: web.Application, engine_id: str) -> dict[str, Any]:
    data = await _ask(app, subjects.engine_flush(engine_id), FlushRequest().encode())
    if isinstance(data, str):
        return {"success": False, "answered": False, "message": data}
    try:
        reply = FlushReply.decode(data)
        return {"success": reply.success, "answered": True, "message": reply.message}
    except SchemaError as e:
        return {"success": False, "answered": True, "message": _error_text(data, e)}


async def stats(request: web.Request) -> web.Response:
    """Every live engine's cache statistics (extension), and their sums per bucket."""
    engines = [e.engine_id for e in request.app[keys.TABLE].live()]
    replies = await asyncio.gather(
        *(_ask(request.app, subjects.engine_stats(e), StatsRequest().encode()) for e in engines)
    )
    out: dict[str, Any] = {}
    for engine_id, data in zip(engines, replies, strict=True):
        if isinstance(data, str):
            out[engine_id] = {"error": data}
            continue
        try:
            reply = StatsReply.decode(data)
            out[engine_id] = {"bucket": reply.bucket, "epoch": reply.epoch, "stats": reply.stats}
        except SchemaError as e:
            out[engine_id] = {"error": _error_text(data, e)}
    buckets: dict[str, dict[str, Any]] = {}
    for engine_id, entry in out.items():
        if "stats" not in entry:
            continue
        b = buckets.setdefault(entry["bucket"], {"engines": [], "stats": {}})
        b["engines"].append(engine_id)
        for key, value in entry["stats"].items():
            b["stats"][key] = b["stats"].get(key, 0) + value
    router = {"prefix_prediction": request.app[keys.AUDIT].summary()}
    return json_response({"engines": out, "buckets": buckets, "router": router})


async def _ask(app: web.Application, subject: str, payload: bytes) -> bytes | str:
    """The reply's bytes, or a string saying why there is none."""
    try:
        msg = await app[keys.NATS].request(
            subject, payload, timeout=app[keys.CONFIG].flush_timeout_s
        )
    except NatsError as e:
        app[keys.METRICS].bus_errors.labels("no_reply").inc()
        return f"no reply: {type(e).__name__}"
    return bytes(msg.data)


def _error_text(data: bytes, e: SchemaError) -> str:
    try:
        return ErrorReply.decode(data).message
    except SchemaError:
        return f"malformed reply: {e}"
