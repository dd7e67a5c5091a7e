"""The route table (`add_routes`), and the generation endpoints: `/v1/completions`,
`/v1/chat/completions`, `/generate`. A request is read, its model picked, its body parsed
into a `GenerationSpec` and its prompt tokenized here; its answer goes out through
`router.delivery`, its bookkeeping through `router.accounting`. The other endpoints are in
`router.probes` and `router.admin`, the middlewares in `router.middlewares`. Request state
lives in the app (see app.py for the keys)."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import orjson
from aiohttp import web

from bus_schemas.token_ids import TokenIds
from router import keys
from router.accounting import TokenTimes, after_response, record_exchange
from router.admin import flush_cache, stats
from router.auth import shared_salt, tenant_salt
from router.choices import Choices
from router.delivery import respond_stream, respond_whole
from router.engines import EngineView, can_serve
from router.errors import ApiError, bad_request
from router.generation import Generation
from router.models import ServedModel
from router.outcome import Timings
from router.probes import bus_settled, health, models, prometheus, ready, unavailable
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
from router.request_record import Exchange

Parser = Callable[[Mapping[str, Any], ServedModel, int, TokenIds | None], GenerationSpec]


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
    times = TokenTimes()

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
        await bus_settled(app)
        model = _served_model(app, body)
        encoded = await _encode(app, endpoint, body, model)
        spec = _tenancy(request, _seeded(parse(body, model, config.max_stop_strings, encoded)))
        await bus_settled(app)  # again: the bus may have been lost while tokenizing
        choices = _choices(app, spec, model, timings)
    except ApiError as e:
        if body is None:
            body = await _raw_body(request)
        record_exchange(app, exchange(e.status, e.message))
        raise
    timings.parse_s = time.perf_counter() - timings.arrived
    metrics.inflight.inc()
    try:
        if spec.stream:
            resp = await respond_stream(request, choices, times)
        else:
            resp = await respond_whole(request, choices, times)
    except ApiError as e:
        record_exchange(app, exchange(e.status, e.message))
        raise
    except Exception:
        record_exchange(app, exchange(500, "internal error"))
        raise
    finally:
        metrics.inflight.dec()
    # aiohttp writes the response when we return; the bookkeeping runs after it, and so does
    # freeing the decoded body (the callback holds it: a 32K-id list is 32K decrefs)
    asyncio.get_running_loop().call_soon(
        after_response, app, choices, times, request.path, resp.status, time_s, body
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


def _served_model(app: web.Application, body: Mapping[str, Any]) -> ServedModel:
    """The model the request names (or the one served, when it names none), by the model
    card most of its live engines speak."""
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise ApiError(400, "'model' must be a string", param="model", code="invalid_type")
    live = app[keys.TABLE].live() if app[keys.NATS].is_connected else []
    if not can_serve(live):
        raise unavailable(app, app[keys.CONFIG].bucket)
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
        raise unavailable(app, bucket)
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
