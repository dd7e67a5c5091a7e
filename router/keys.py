"""Typed app state: one key per resource the app owns (set by `init` and its cleanup_ctx)."""

from __future__ import annotations

from aiohttp import web
from nats.aio.client import Client as NatsClient

from router.audit import PredictionAudit
from router.auth import Identity, KeyRing
from router.config import RouterConfig
from router.engines import EngineTable
from router.metrics import RouterMetrics
from router.models import ModelCards
from router.prompt_workers import PromptWorkers
from router.record import Recorder
from router.reply_hub import ReplyHub
from router.resp import RespClient
from router.routing import Router

CONFIG = web.AppKey("config", RouterConfig)
KEYRING = web.AppKey("keyring", KeyRing)  # the API, admin and tenant keys
IDENTITY = web.RequestKey("identity", Identity)  # what the request's key proved (auth)
METRICS = web.AppKey("metrics", RouterMetrics)
MODELS = web.AppKey("models", ModelCards)  # the served models, from engines' model cards
NATS = web.AppKey("nats", NatsClient)
PROMPTS = web.AppKey("prompts", PromptWorkers)  # tokenize and render off the event loop
REPLIES = web.AppKey("replies", ReplyHub)  # the shared reply inbox
REDIS = web.AppKey("redis", RespClient)
TABLE = web.AppKey("engines", EngineTable)
ROUTER = web.AppKey("router", Router)
RECORDER = web.AppKey("recorder", Recorder)  # only set with --record
AUDIT = web.AppKey("audit", PredictionAudit)  # predicted against delivered prefix hits
