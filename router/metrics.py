"""Prometheus metrics of one router app, in a registry of its own (apps in one process, as in
tests, never share counters).

Two families: `hicache_router_*` (the router's own view), and the names an SGLang Grafana
dashboard reads (`sglang:*`, label `model_name`, as SGLang's metrics collector names them).
Per-engine `sglang:*` gauges (running and queued requests, KV usage, cache counters) come
from the engines' heartbeats through `router.engines.EngineCollector`, at scrape time, for
the engines live at that moment. /health and /metrics polls are not counted as requests.
"""

from __future__ import annotations

from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics import MetricWrapperBase

PREFIX = "hicache_router"
SGLANG = "sglang"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0)
LOOKUP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
PREDICTION_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)  # tokens


M = TypeVar("M", bound=MetricWrapperBase)


class RouterMetrics:
    """Every metric the router exports. Label values are small closed sets."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
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
        self.bucket_requests = Counter(
            f"{PREFIX}_bucket_requests",
            "generation requests by the engine bucket they were sent to",
            ["bucket"],
            registry=r,
        )
        self.routing = Counter(
            f"{PREFIX}_routing_decisions",
            "engine choices by reason (cache, load, redis_down, redis_timeout, index_resync, retry)",
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
            f"{PREFIX}_store_errors",
            "Redis prefix lookups and probes that failed (Redis down or a bad reply)",
            registry=r,
        )
        self.store_timeouts = Counter(
            f"{PREFIX}_store_timeouts",
            "Redis prefix lookups over their time budget (Redis up but slow)",
            registry=r,
        )
        self.redis_up = Gauge(
            f"{PREFIX}_redis_up", "1 while Redis answers the router's probes, else 0", registry=r
        )
        self.prefix_lookup = Histogram(
            f"{PREFIX}_prefix_lookup_seconds",
            "time of one Redis prefix lookup, as the router waited for it",
            buckets=LOOKUP_BUCKETS,
            registry=r,
        )
        self.prefix_predictions = Counter(
            f"{PREFIX}_prefix_predictions",
            "served requests whose cached prefix the index predicted, by how the engine's "
            "delivered prefix compared: exact, over (the index promised more), under",
            ["result"],
            registry=r,
        )
        self.prefix_prediction_error = Histogram(
            f"{PREFIX}_prefix_prediction_error_tokens",
            "|prefix the index predicted - prefix the engine delivered|, in tokens",
            buckets=PREDICTION_BUCKETS,
            registry=r,
        )
        self.record_dropped = Counter(
            f"{PREFIX}_record_dropped",
            "--record: records dropped because the writer's queue was full",
            registry=r,
        )
        self.connections_closed = Counter(
            f"{PREFIX}_connections_closed",
            "client connections the router closed early: read_timeout (headers or body too "
            "slow), evicted (idlest reader, at --max-connections), refused (all busy)",
            ["reason"],
            registry=r,
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

        self._sglang(r)

    def _sglang(self, r: CollectorRegistry) -> None:
        """The request-level metrics under SGLang's names (label `model_name`)."""
        model = ["model_name"]
        self.sg_ttft = Histogram(
            f"{SGLANG}:time_to_first_token_seconds",
            "time to first token",
            model,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.sg_e2e = Histogram(
            f"{SGLANG}:e2e_request_latency_seconds",
            "end-to-end request latency",
            model,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.sg_itl = Histogram(
            f"{SGLANG}:inter_token_latency_seconds",
            "time between output tokens, per token (a chunk of n tokens counts n gaps)",
            model,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.sg_tpot = Histogram(
            f"{SGLANG}:time_per_output_token_seconds",
            "per request: (e2e - ttft) / (output tokens - 1)",
            model,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.sg_queue = Histogram(
            f"{SGLANG}:queue_time_seconds",
            "router-side: arrival until the request is sent to an engine (routing, lookup)",
            model,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.sg_prompt_tokens = Counter(
            f"{SGLANG}:prompt_tokens", "prompt tokens", model, registry=r
        )
        self.sg_generation_tokens = Counter(
            f"{SGLANG}:generation_tokens", "generated tokens", model, registry=r
        )
        self.sg_cached_tokens = Counter(
            f"{SGLANG}:cached_tokens", "prompt tokens served from cache", model, registry=r
        )

    def child(self, metric: M, *labels: str) -> M:
        """`metric.labels(*labels)`, bound once: the per-request path reads a dict instead of
        prometheus' locked label lookup (label sets are small closed sets)."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def render(self) -> bytes:
        return generate_latest(self.registry)
