"""HTTP handlers and middlewares. Request state lives in the app (see app.py for the keys)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from contextlib import aclosing
from typing import Any

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
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
from bus_schemas.token_ids import TokenIds
from router import keys
from router.auth import ANONYMOUS, shared_salt, tenant_salt
from router.choices import Choices
from router.engines import EngineView, can_serve
from router.errors import ApiError, bad_request, json_response
from router.generation import Generation, no_engine_error
from router.models import ServedModel
from router.outcome import Timings
from router.protocol import (
    CHARS_PER_TOKEN,
    MAX_SEED,
    GenerationSpec,
    check_limits,
    parse_chat,
    parse_completion,
    parse_generate,
    prompt_text,
    read_json,
)
from router.readiness import bucket_readiness
from router.request_record import Exchange, request_record
from router.responses import DONE, SSE_HEADERS, OpenAIShape, generate_body, sse
from router.server import GUARD, read_body

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Parser = Callable[[Mapping[str, Any], ServedModel, int, TokenIds | None], GenerationSpec]
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})  # probes: no key, not counted
ENGINE_HEADER = "X-Hicache-Engine"  # the engine that generated (P/D: the decode engine)
TIMING_HEADER = "Server-Timing"  # the router's own time per stage (`Timings.server_timing`)
PREFILL_HEADER = "X-Hicache-Prefill-Engine"  # P/D only: the engine that computed the prompt
REDIS_DOWN = "redis is down: cache-aware routing is off, routing by load"
CLIENT_CLOSED = 499  # nginx's "client closed request": the client left before the answer


# ------------------------------------------------------------------ middlewares


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as an OpenAI-style JSON body; every response but /health's and
    /metrics' (polls) is counted. A client that left mid-request (an aborted upload) is
    a client error, 499 as nginx counts it, with one debug line and no traceback."""
    try:
        resp = await handler(request)
    except ApiError as e:
        resp = e.response()
    except web.HTTPException as e:
        resp = _http_error(e)
    except (ConnectionResetError, RequestPayloadError) as e:
        log.debug("client left during %s %s: %r", request.method, request.path, e)
        resp = ApiError(CLIENT_CLOSED, "client closed the request", code="client_closed").response()
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        resp = ApiError(500, "internal error", code="internal_error").response()
    if request.path not in OPEN_PATHS:
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else "unmatched"
        metrics = request.app[keys.METRICS]
        metrics.child(metrics.requests, endpoint, str(resp.status)).inc()
    return resp


@web.middleware
async def body_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Read the body within --read-timeout (408 and the connection closed when it is too
    slow), then mark the connection as serving (never evicted, `router.server`)."""
    config, guard = request.app[keys.CONFIG], request.app.get(GUARD)
    if request.body_exists:
        try:
            await read_body(request, config.read_timeout_s)
        except TimeoutError:
            request.app[keys.METRICS].connections_closed.labels("read_timeout").inc()
            raise ApiError(
                408,
                f"the request body did not arrive within {config.read_timeout_s:g} s",
                code="request_timeout",
            ) from None
        except web.HTTPRequestEntityTooLarge as e:
            raise ApiError(
                413, f"request body too large: {e.text}", code="body_too_large"
            ) from None
    if guard is None:
        return await handler(request)
    guard.serving(request.protocol)
    try:
        return await handler(request)
    finally:
        guard.done(request.protocol)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The request's key, checked against what its path needs (router/auth.py): 401 for a
    missing or wrong key, 403 for a valid key that is not the admin key on an admin path."""
    ring = request.app[keys.KEYRING]
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    identity = ring.identify(token.strip() if scheme.lower() == "bearer" else None)
    need = ring.required(request.path)
    if need != "none" and identity is None:
        raise ApiError(401, "missing or incorrect API key", code="invalid_api_key")
    if need == "admin" and identity is not None and not identity.admin:
        raise ApiError(403, "this endpoint needs the admin API key", code="permission_denied")
    request[keys.IDENTITY] = identity or ANONYMOUS
    return await handler(request)


def _tenancy(request: web.Request, spec: GenerationSpec) -> GenerationSpec:
    """The spec with its cache salt derived from the tenant (router/auth.py) when the router
    has tenants: a tenant's own salt, or the shared namespace it names and may use."""
    config = request.app[keys.CONFIG]
    name = spec.cache_namespace
    if not config.tenant_keys:
        if name is not None:
            raise bad_request(
                "'cache_namespace' needs tenants (the router's --tenant-keys)",
                "cache_namespace",
                "cache_namespace_unavailable",
            )
        return spec
    tenant = request[keys.IDENTITY].tenant
    if name is None:
        salt = tenant_salt(tenant.tenant if tenant is not None else "", spec.cache_salt)
        return dataclasses.replace(spec, cache_salt=salt)
    allowed = config.shared_cache_namespaces + (tenant.shared if tenant is not None else ())
    if name not in allowed:
        raise ApiError(
            403,
            "this key may not use that cache namespace",
            param="cache_namespace",
            code="permission_denied",
        )
    return dataclasses.replace(spec, cache_salt=shared_salt(name, spec.cache_salt))


def _http_error(e: web.HTTPException) -> web.Response:
    codes = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
    err = ApiError(e.status, e.reason if e.status != 413 else e.text or e.reason)
    err.code = codes.get(e.status, "http_error")
    resp = err.response()
    if "Allow" in e.headers:
        resp.headers["Allow"] = e.headers["Allow"]
    return resp


# ------------------------------------------------------------------ generation


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completions", parse_completion)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat", parse_chat)


async def generate(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "generate", parse_generate)


async def _serve(request: web.Request, endpoint: str, parse: Parser) -> web.StreamResponse:
    app = request.app
    config, metrics = app[keys.CONFIG], app[keys.METRICS]
    timings, time_s = Timings(time.perf_counter()), time.time()
    body: Any = None
    spec: GenerationSpec | None = None
    choices: Choices | None = None
    times = _TokenTimes()

    def exchange(status: int, error: str | None) -> Exchange:  # the request so far, answered
        return Exchange(
            time_s=time_s,
            timings=timings,
            endpoint=request.path,
            status=status,
            body=body,
            spec=spec,
            choices=choices,
            itl_s=times.gaps,
            error=error,
        )

    try:
        body = await read_json(request)
        model = _served_model(app, body)
        encoded = await _encode(app, endpoint, body, model)
        spec = _tenancy(request, _seeded(parse(body, model, config.max_stop_strings, encoded)))
        choices = _choices(app, spec, model, timings)
    except ApiError as e:
        if body is None:
            body = await _raw_body(request)
        _record(app, exchange(e.status, e.message))
        raise
    timings.parse_s = time.perf_counter() - timings.arrived
    metrics.inflight.inc()
    try:
        if spec.stream:
            resp = await _stream(request, choices, times)
        else:
            resp = await _whole(request, choices, times)
    except ApiError as e:
        _record(app, exchange(e.status, e.message))
        raise
    except Exception:
        _record(app, exchange(500, "internal error"))
        raise
    finally:
        metrics.inflight.dec()
    # aiohttp writes the response when we return; the bookkeeping runs after it, and so does
    # freeing the decoded body (the callback holds it: a 32K-id list is 32K decrefs)
    asyncio.get_running_loop().call_soon(
        _after_response, app, choices, times, request.path, resp.status, time_s, body
    )
    return resp


async def _encode(
    app: web.Application, endpoint: str, body: Mapping[str, Any], model: ServedModel
) -> TokenIds | None:
    """A text prompt's ids, checked by length first, then tokenized (a chat request's
    messages rendered first) in a worker process, never on this loop (DESIGN.md 7b)."""
    config = app[keys.CONFIG]
    max_chars = min(config.max_prompt_chars, CHARS_PER_TOKEN * model.card.context_len)
    prompt = prompt_text(endpoint, body, max_chars, config.refuse_special_tokens)
    if prompt is None:
        return None
    return await app[keys.PROMPTS].encode(model, prompt, max_chars)


def _seeded(spec: GenerationSpec) -> GenerationSpec:
    """A sampled request without a seed gets one, so that what it drew can be replayed
    (`--record` keeps it): the engine draws seeded tokens alike for any seed."""
    if spec.temperature > 0 and spec.seed is None:
        return dataclasses.replace(spec, seed=secrets.randbelow(MAX_SEED))
    return spec


async def _raw_body(request: web.Request) -> Any:
    """For the record of a refused request: the body as JSON if it is JSON, else None."""
    try:
        return orjson.loads(await request.read())
    except Exception:  # not JSON, too large, unreadable: the error says which
        return None


def _after_response(
    app: web.Application,
    choices: Choices,
    times: _TokenTimes,
    endpoint: str,
    status: int,
    time_s: float,
    body: dict[str, Any],
) -> None:
    """Metrics and the record of a served request, once its response is on its way."""
    _account(app, choices, times)
    gen = choices.first
    exchange = Exchange(
        time_s=time_s,
        timings=gen.timings,
        endpoint=endpoint,
        status=status,
        body=body,
        spec=gen.spec,
        choices=choices,
        itl_s=times.gaps,
        error=None,
    )
    _record(app, exchange)


def _record(app: web.Application, exchange: Exchange) -> None:
    """Queue the request's record (docs/recording.md) when recording."""
    recorder = app.get(keys.RECORDER)
    if recorder is not None:
        recorder.write(request_record(exchange))


def _served_model(app: web.Application, body: Mapping[str, Any]) -> ServedModel:
    """The model the request names (or the one served, when it names none), by the model
    card most of its live engines speak."""
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise ApiError(400, "'model' must be a string", param="model", code="invalid_type")
    live = app[keys.TABLE].live() if app[keys.NATS].is_connected else []
    if not can_serve(live):
        raise _unavailable(app, app[keys.CONFIG].bucket)
    served = sorted({e.model for e in live})
    engines = [e for e in live if name in (None, "", e.model)]
    if not engines:
        raise ApiError(
            404,
            f"model {name!r} is not served here (served: {_names(served)})",
            param="model",
            code="model_not_found",
        )
    if not name and len(served) > 1:
        raise ApiError(
            400, f"'model' is required: this router serves {_names(served)}", param="model"
        )
    cards = app[keys.MODELS]
    for digest, _ in Counter(e.card_digest for e in engines).most_common():
        model = cards.get(digest)
        if model is not None:
            return model
    raise ApiError(
        503,
        f"the model card of {engines[0].model!r} has not arrived yet; try again shortly",
        code="model_loading",
        retry_after_s=1,
    )


def _names(models: list[str], shown: int = 10) -> str:
    """At most `shown` model names for an error message (engines name their models)."""
    more = f" and {len(models) - shown} more" if len(models) > shown else ""
    return f"{models[:shown]}{more}"


def _choices(
    app: web.Application, spec: GenerationSpec, model: ServedModel, timings: Timings
) -> Choices:
    """Route-independent checks (live engines of the model's card, limits), then the
    request's generations (one per choice)."""
    table, router, cards = app[keys.TABLE], app[keys.ROUTER], app[keys.MODELS]
    speaking = cards.speaking(model)  # engines' card digests that parse requests alike

    def serving(bucket: str) -> list[EngineView]:
        return [e for e in table.live(bucket) if e.card_digest in speaking]

    bucket = router.select_bucket(
        len(spec.input_ids), spec.max_tokens or 0, lambda b: can_serve(serving(b))
    )
    engines = serving(bucket)
    if not can_serve(engines):
        raise _unavailable(app, bucket)
    context_len = min(e.context_len for e in engines)
    config = app[keys.CONFIG]
    max_len = next(b.max_len for b in config.buckets if b.name == bucket)
    max_new_tokens = check_limits(
        spec, model.card.vocab_size, context_len, max_len, config.default_max_tokens
    )

    def make(choice: int, prefer: str | None) -> Generation:
        return Generation(
            hub=app[keys.REPLIES],
            table=table,
            router=router,
            config=app[keys.CONFIG],
            metrics=app[keys.METRICS],
            model=model,
            spec=spec,
            max_new_tokens=max_new_tokens,
            bucket=bucket,
            timings=timings if choice == 0 else Timings(timings.arrived),
            choice=choice,
            prefer=prefer,
            card_digests=speaking,
        )

    return Choices(make, spec.n)


def _shape(choices: Choices) -> OpenAIShape:
    gen = choices.first
    return OpenAIShape(
        gen.spec.endpoint == "chat",
        gen.outcome.request_id,
        _model_name(gen),
        int(time.time()),
        gen.model.tokenizer,
        gen.spec.include_usage,
        _hide_cache(choices.first),
    )


async def _whole(request: web.Request, choices: Choices, times: _TokenTimes) -> web.Response:
    async with aclosing(choices.run()) as deltas:
        async for index, delta in deltas:
            if index == 0:
                times.tick(len(delta.token_ids))
            if request.transport is None or request.transport.is_closing():
                break  # the client left: closing the iterator aborts the engines
    spec = choices.first.spec
    if spec.endpoint == "generate":
        body = generate_body(
            choices.first.outcome,
            logprobs=spec.logprobs is not None,
            hide_cache=_hide_cache(choices.first),
        )
    else:
        outs = [gen.outcome for gen in choices.gens]
        body = _shape(choices).whole(outs, spec.logprobs is not None)
    return json_response(body, headers=_engine_headers(choices.first))


async def _stream(request: web.Request, choices: Choices, times: _TokenTimes) -> web.StreamResponse:
    """SSE. Headers go out with the first engine chunk, so an engine that fails before it
    can still be retried or answered with a plain error status."""
    resp = web.StreamResponse(headers=SSE_HEADERS)
    spec = choices.first.spec
    shape: OpenAIShape | None = None
    released = ""  # /generate: the text so far (one choice)
    opened: set[int] = set()  # chat choices whose role chunk went out
    sent_logprobs: dict[int, int] = {}  # per choice: logprobs already sent
    async with aclosing(choices.run()) as deltas:
        try:
            async for index, delta in deltas:
                if index == 0:
                    times.tick(len(delta.token_ids))
                out = choices.gens[index].outcome
                if not resp.prepared:
                    resp.headers.update(_engine_headers(choices.first))
                    await resp.prepare(request)
                    if spec.endpoint != "generate":
                        shape = _shape(choices)
                if shape is not None and shape.chat and index not in opened:
                    opened.add(index)
                    await resp.write(sse(shape.chunk(index, "", [], first=True)))
                released += delta.text
                final = out.finish_reason is not None
                if not (delta.text or delta.token_ids or final):
                    continue
                if shape is None:
                    event = generate_body(
                        out, released, spec.logprobs is not None, _hide_cache(choices.first)
                    )
                else:
                    lps = None
                    if spec.logprobs is not None:
                        lps = out.logprobs[sent_logprobs.get(index, 0) :]
                        sent_logprobs[index] = len(out.logprobs)
                    reason = out.finish_reason
                    event = shape.chunk(index, delta.text, delta.token_ids, reason, lps)
                await resp.write(sse(event))
            if shape is not None and shape.include_usage:
                await resp.write(sse(shape.usage_chunk([g.outcome for g in choices.gens])))
        except ApiError as e:
            if not resp.prepared:
                raise
            await resp.write(sse(e.body()))
        except ConnectionResetError:
            return resp  # the client left; closing the iterator aborts the engines
    await resp.write(DONE)
    await resp.write_eof()
    return resp


def _hide_cache(gen: Generation) -> bool:
    return gen.config.hide_cache_stats


def _engine_headers(gen: Generation) -> dict[str, str]:
    """The engine(s) that served, and the router's time so far (a stream's headers leave
    with its first chunk: its `engine` stage is not over yet). None with --hide-cache-stats:
    the engine a cache-aware router chose, and the time it took, tell of a prefix hit."""
    if _hide_cache(gen):
        return {}
    out = gen.outcome
    headers = {ENGINE_HEADER: out.engine_id}
    if out.disaggregation is not None:
        headers[PREFILL_HEADER] = out.disaggregation.prefill_engine
    headers[TIMING_HEADER] = gen.timings.server_timing(time.perf_counter())
    return headers


class _TokenTimes:
    """When output tokens reached the router: the inter-token gaps, per token (a delta of
    n tokens after a gap g counts n gaps of g / n, as SGLang counts a batch)."""

    __slots__ = ("gaps", "last")

    def __init__(self) -> None:
        self.last: float | None = None
        self.gaps: list[float] = []

    def tick(self, num_tokens: int) -> None:
        if not num_tokens:
            return
        now = time.perf_counter()
        if self.last is not None:
            self.gaps.extend([(now - self.last) / num_tokens] * num_tokens)
        self.last = now


def _account(app: web.Application, choices: Choices, times: _TokenTimes) -> None:
    """Counts the prompt once and every choice's output; times are choice 0's."""
    gen = choices.first
    metrics, spec, out = app[keys.METRICS], gen.spec, gen.outcome
    child = metrics.child
    num_output = sum(len(g.outcome.output_ids) for g in choices.gens)
    metrics.prompt_tokens.inc(out.prompt_tokens)
    metrics.completion_tokens.inc(num_output)
    child(metrics.cached_tokens, "device").inc(out.cached_device)
    child(metrics.cached_tokens, "host").inc(out.cached_host)
    child(metrics.cached_tokens, "storage").inc(out.cached_storage)
    app[keys.TABLE].account(out.engine_id, out.prompt_tokens, out.cached_tokens)
    if out.disaggregation is not None:  # the prefill engine's own hit rate
        pd = out.disaggregation
        app[keys.TABLE].account(pd.prefill_engine, out.prompt_tokens, pd.prefill_cached_tokens)
    if out.predicted_cached_tokens is not None and out.finish_reason is not None:
        result = app[keys.AUDIT].observe(
            out.engine_id, out.predicted_cached_tokens, out.cached_tokens
        )
        child(metrics.prefix_predictions, result).inc()
        metrics.prefix_prediction_error.observe(
            abs(out.predicted_cached_tokens - out.cached_tokens)
        )
    model = _model_name(gen)
    child(metrics.sg_prompt_tokens, model).inc(out.prompt_tokens)
    child(metrics.sg_generation_tokens, model).inc(num_output)
    child(metrics.sg_cached_tokens, model).inc(out.cached_tokens)
    e2e_s = time.perf_counter() - gen.timings.arrived
    child(metrics.sg_e2e, model).observe(e2e_s)
    if out.queue_s is not None:
        child(metrics.sg_queue, model).observe(out.queue_s)
    if out.ttft_s is not None:
        child(metrics.ttft, spec.endpoint).observe(out.ttft_s)
        child(metrics.sg_ttft, model).observe(out.ttft_s)
        if len(out.output_ids) > 1:
            tpot = (e2e_s - out.ttft_s) / (len(out.output_ids) - 1)
            child(metrics.sg_tpot, model).observe(tpot)
    itl = child(metrics.sg_itl, model)
    for gap in times.gaps:
        itl.observe(gap)


def _model_name(gen: Generation) -> str:
    """The served model of the request: as asked, else the generating engine's."""
    return gen.spec.model if gen.spec.model is not None else gen.outcome.model


# ------------------------------------------------------------------ the rest


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
    redis_up = request.app[keys.ROUTER].index.up
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


BUS_DOWN = "message bus (NATS) unavailable"


def _unavailable(app: web.Application, bucket: str) -> ApiError:
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


async def flush_cache(request: web.Request) -> web.Response:
    """Flush every live engine's cache. 200 when all did; 409 when one refused; 503 when
    none is live or one did not answer. The body lists each engine's result."""
    engines = [e.engine_id for e in request.app[keys.TABLE].live()]
    if not engines:
        raise _unavailable(request.app, "any")
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


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/generate", generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", prometheus)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_get("/stats", stats)
