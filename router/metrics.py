"""Prometheus metrics of one router app, in a registry of its own (apps in one process, as in
tests, never share counters)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "hicache_router"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class RouterMetrics:
    """Every metric the router exports. Label values are small closed sets."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            f"{PREFIX}_ttft_seconds",
            "time from request arrival to the first generated token",
            ["endpoint"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens served", registry=r)
        self.completion_tokens = Counter(
            f"{PREFIX}_completion_tokens", "tokens generated", registry=r
        )
        self.cached_tokens = Counter(
            f"{PREFIX}_cached_tokens",
            "prompt tokens served from cache, by tier",
            ["tier"],
            registry=r,
        )
        self.routing = Counter(
            f"{PREFIX}_routing_decisions",
            "engine choices by reason (cache, load, redis_down, retry)",
            ["reason"],
            registry=r,
        )
        self.bus_errors = Counter(
            f"{PREFIX}_bus_errors",
            "NATS-side failures: timeouts, lost engines, malformed messages, engine errors",
            ["kind"],
            registry=r,
        )
        self.store_errors = Counter(
            f"{PREFIX}_store_errors", "failed Redis prefix lookups", registry=r
        )
        self.live_engines = Gauge(
            f"{PREFIX}_live_engines", "engines with a recent heartbeat", registry=r
        )
        self.inflight = Gauge(f"{PREFIX}_inflight_requests", "requests being served", registry=r)
        self.pd_requests = Counter(
            f"{PREFIX}_pd_requests", "requests that took the prefill/decode (P/D) path", registry=r
        )
        self.pd_transferred_tokens = Counter(
            f"{PREFIX}_pd_transferred_tokens", "KV tokens sent from prefill to decode", registry=r
        )
        self.pd_transferred_bytes = Counter(
            f"{PREFIX}_pd_transferred_bytes", "KV bytes sent from prefill to decode", registry=r
        )
        self.pd_restore_retries = Counter(
            f"{PREFIX}_pd_restore_retries",
            "P/D requests retried with reuse=False after decode could not restore its prefix",
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
