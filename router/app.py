"""The router app: `init(config)` builds it; its cleanup_ctx owns every connection and task.

Startup order (teardown is the reverse): NATS, the engine table (heartbeat subscription and
sweeper task), Redis (the prefix index), the recorder, the prompt workers (processes that
start on first use). At shutdown the runner first stops
accepting and lets in-flight requests finish (bounded by its shutdown timeout), then the
contexts unwind: the recorder closes, Redis closes, the table unsubscribes, NATS drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import nats
import orjson
from aiohttp import web
from nats.aio.msg import Msg

from bus_schemas import subjects
from bus_schemas.connection import connect_nats
from router import keys
from router.audit import PredictionAudit
from router.auth import KeyRing
from router.config import RouterConfig
from router.engines import EngineTable
from router.handlers import add_routes
from router.metrics import RouterMetrics
from router.middlewares import auth_middleware, body_middleware, errors_middleware
from router.models import ModelCards
from router.prompt_workers import PromptWorkers
from router.record import Recorder, header
from router.reply_hub import ReplyHub
from router.resp import RespClient
from router.routing import PrefixIndex, Router
from router.sentinel import SentinelResolver
from router.server import GUARD, ConnectionGuard

log = logging.getLogger(__name__)


def init(config: RouterConfig) -> web.Application:
    """The router application for `config` (connections open when the app starts)."""
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[errors_middleware, auth_middleware, body_middleware],
    )
    app[keys.CONFIG] = config
    app[keys.KEYRING] = KeyRing(
        config.api_key, config.admin_api_key, config.tenant_keys, config.probe_auth
    )
    app[keys.METRICS] = RouterMetrics()
    app[keys.AUDIT] = PredictionAudit()
    app[GUARD] = ConnectionGuard(config.max_connections, app[keys.METRICS])
    app.cleanup_ctx.extend([nats_ctx, engines_ctx, redis_ctx, recorder_ctx, prompts_ctx])
    add_routes(app)
    return app


async def nats_ctx(app: web.Application) -> AsyncIterator[None]:
    stopping = False

    async def on_error(e: Exception) -> None:
        log.warning("NATS error: %r", e)  # one line per failed reconnect attempt

    async def on_disconnect() -> None:
        if not stopping:
            log.warning("NATS disconnected; reconnecting")

    async def on_reconnect() -> None:
        log.info("NATS reconnected")
        if keys.REPLIES in app:  # replies sent while this router was away may be lost
            app[keys.REPLIES].reconnected()

    nc = await connect_nats(
        app[keys.CONFIG].nats_url,
        name="hicache-router",
        log=log,
        credentials=app[keys.CONFIG].nats_credentials,
        tls_ca_file=app[keys.CONFIG].nats_tls_ca_file,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
    )
    app[keys.NATS] = nc
    hub = ReplyHub(nc)
    await hub.start()
    app[keys.REPLIES] = hub
    try:
        yield
    finally:
        stopping = True
        await hub.stop()
        if not nc.is_closed:
            try:
                await nc.drain()
            except (nats.errors.Error, TimeoutError) as e:
                log.warning("NATS drain failed: %r", e)
            await nc.close()


async def engines_ctx(app: web.Application) -> AsyncIterator[None]:
    loop = asyncio.get_running_loop()
    table = EngineTable(app[keys.CONFIG], app[keys.METRICS], loop.time)
    app[keys.TABLE] = table
    config = app[keys.CONFIG]
    cards = ModelCards(
        app[keys.NATS], app[keys.METRICS], loop.time, max_cards=config.max_model_cards
    )
    app[keys.MODELS] = cards

    reconnects: dict[str, tuple[str, int]] = {}  # engine -> (epoch, its bus_reconnects)

    async def on_heartbeat(msg: Msg) -> None:
        hb = table.on_heartbeat_data(msg.data, subjects.sender_of(msg.subject))
        if hb is not None:
            cards.observe(hb.engine_id, hb.card_digest)
            seen = reconnects.get(hb.engine_id)
            if seen is None and len(reconnects) >= 2 * config.max_engines:
                for gone in [e for e in reconnects if not table.knows(e)]:
                    del reconnects[gone]  # forgotten engines (bounded with the table)
            reconnects[hb.engine_id] = (hb.epoch, hb.bus_reconnects)
            if seen is not None and seen != (hb.epoch, hb.bus_reconnects) and seen[0] == hb.epoch:
                app[keys.REPLIES].reconnected(hb.engine_id)  # its streams may have lost replies

    sub = await app[keys.NATS].subscribe(subjects.HEARTBEAT_ALL, cb=on_heartbeat)
    sweeper = asyncio.create_task(table.run_sweeper(), name="engine-table-sweeper")
    try:
        yield
    finally:
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()
        await cards.close()


async def redis_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[keys.CONFIG]
    resolver = None
    if config.redis_sentinels:  # the primary's address at each (re)connect
        resolver = SentinelResolver(
            config.redis_sentinels,
            config.redis_sentinel_master,
            config.redis_sentinel_credentials,
        )
    # no retries: a lookup has a 50 ms budget, and Redis trouble only costs cache reuse
    client = RespClient(
        config.redis_url,
        connect_timeout_s=0.5,
        reply_timeout_s=1.0,
        credentials=config.redis_credentials,
        tls_ca_file=config.redis_tls_ca_file,
        resolve=resolver,
    )
    app[keys.REDIS] = client
    index = PrefixIndex(client, config, app[keys.METRICS], asyncio.get_running_loop().time)
    await index.start()  # a probe task, owned until teardown
    app[keys.ROUTER] = Router(index, config, app[keys.METRICS])
    try:
        yield
    finally:
        await index.stop()
        await client.aclose()
        if resolver is not None:
            await resolver.aclose()


async def recorder_ctx(app: web.Application) -> AsyncIterator[None]:
    path = app[keys.CONFIG].record_path
    if path is None:
        yield
        return
    config = app[keys.CONFIG]
    meta = orjson.loads(config.record_meta)
    first_line = header(meta, config.router_argv, config.record_redact, config.record_token_ids)
    recorder = Recorder(
        path,
        first_line,
        redacted=config.record_redact,
        token_ids=config.record_token_ids,
        max_bytes=config.record_max_bytes,
        backups=config.record_backups,
        page_size=meta.get("page_size") or 16,
        served_models={m for m in (meta.get("model"), meta.get("served_model_name")) if m},
        max_queue=config.record_queue,
        on_drop=app[keys.METRICS].record_dropped.inc,
    )
    app[keys.RECORDER] = recorder
    try:
        yield
    finally:
        await asyncio.to_thread(recorder.close)


async def prompts_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[keys.CONFIG]
    workers = PromptWorkers(config.tokenizer_worker_num, config.tokenize_timeout_s)
    app[keys.PROMPTS] = workers
    try:
        yield
    finally:
        await workers.close()
