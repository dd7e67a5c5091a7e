"""The router's one frozen configuration, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from bus_schemas.connection import Credentials
from bus_schemas.sentinel import DEFAULT_MASTER, Address, sentinel_redis_url
from router.auth import PROBE_AUTH, TENANT_NAME, TenantKey
from router.buckets import DEFAULT, Bucket, order
from router.record import TOKEN_IDS


@dataclass(frozen=True, slots=True)
class RouterConfig:
    nats_url: str = "nats://127.0.0.1:4222"
    redis_url: str = "redis://127.0.0.1:6379/0"
    # the router's NATS and Redis identities (user `router`); None: connect without one
    nats_credentials: Credentials | None = None
    redis_credentials: Credentials | None = None
    # CA files (PEM): connect over TLS only, verifying the server against them (None: plain)
    nats_tls_ca_file: str | None = None
    redis_tls_ca_file: str | None = None
    # Sentinel (bus_schemas/sentinel.py): the primary comes from these, `redis_url` gives only
    # scheme, credentials and db; prefix scores count only once the index marks that
    # primary resynced (`INDEX_SYNCED`)
    redis_sentinels: tuple[Address, ...] = ()
    redis_sentinel_master: str = DEFAULT_MASTER
    redis_sentinel_credentials: Credentials | None = None
    api_key: str | None = None  # when set, every endpoint but /health and /metrics needs it
    # when set, only it opens /flush_cache and /stats (router/auth.py); it opens the rest too
    admin_api_key: str | None = None
    # keys of tenants: each tenant's cache salt is derived from its name (router/auth.py)
    tenant_keys: tuple[TenantKey, ...] = ()
    shared_cache_namespaces: tuple[str, ...] = ()  # `cache_namespace` values any tenant may use
    probe_auth: str = "open"  # "open" | "metrics" | "all": which probes need a key
    hide_cache_stats: bool = False  # responses carry no cached-token figures or timing headers
    record_path: str | None = None  # JSON lines, one per request (docs/recording.md)
    record_redact: bool = False  # records keep only known-safe fields (router/record.py)
    record_token_ids: str = "keep"  # "keep" | "hash" | "drop": prompt and output ids in records
    record_max_bytes: int = 1 << 30  # the file is rotated (FILE.1, ...) beyond this; 0: never
    record_backups: int = 3  # rotated files kept
    record_queue: int = 10_000  # records waiting for the writer; beyond it they are dropped
    # the header's description of the mesh (from `up`: model, dtype, page size, flags), JSON
    record_meta: str = "{}"
    router_argv: tuple[str, ...] = ()  # this router's own flags (the header records them)
    # the engine buckets, smallest first (router/buckets.py); one unbounded by default
    buckets: tuple[Bucket, ...] = (Bucket(DEFAULT),)
    # longest wait for the first chunk and between chunks while the engine also shows no
    # progress on the request (bus_schemas.Progress: a busy engine's long prefill is waited for)
    request_timeout_s: float = 30.0
    liveness_poll_s: float = 0.5  # how often a waiting request checks its engine's heartbeats
    heartbeat_misses: int = 3  # an engine is dead after this many heartbeat intervals
    # an engine that failed sits out until its next heartbeat; one that failed in
    # failed_strikes incidents in a row (each within failed_quarantine_s) sits out this long
    failed_quarantine_s: float = 30.0
    failed_strikes: int = 3
    redis_timeout_s: float = 0.05  # per-request budget of the prefix lookup
    # the breaker opens when this share of the last `redis_breaker_window` lookups timed out
    redis_breaker_window: int = 20
    redis_breaker_ratio: float = 0.8
    redis_retry_s: float = 1.0  # an open breaker routes by load alone this long
    redis_probe_s: float = 1.0  # background PING period (the redis_up gauge, /health)
    redis_probe_timeout_s: float = 1.0
    read_timeout_s: float = 30.0  # a request's headers, then its body, must arrive in this
    max_connections: int = 4096  # open client connections; beyond it the idlest go first
    flush_timeout_s: float = 10.0  # per-engine wait in /flush_cache and /stats
    device_weight: float = 1.0  # score per cached prefix token on the device
    host_weight: float = 0.5  # score per cached prefix token on the host (needs a load-back)
    storage_weight: float = 0.25  # ... in the engine's external store (a read, then a load)
    load_weight: float = 0.5  # score penalty per in-flight token of the engine
    max_body_bytes: int = 32 * 1024 * 1024
    # token bytes and page hashes of recent prompts, so a resent history is not hashed
    # again (router.page_chains); 0 turns it off
    page_chain_cache_bytes: int = 64 * 1024 * 1024
    max_stop_strings: int = 16
    # a text prompt (a chat request's messages together) over this many characters is a 400
    # before anything tokenizes it; a model's own limit is 32 per token of its context
    max_prompt_chars: int = 4 * 1024 * 1024
    # worker processes that render chat templates and tokenize (router.prompt_workers), and
    # each job's time limit there (a template that runs longer is killed: a 400)
    tokenizer_worker_num: int = 2
    tokenize_timeout_s: float = 5.0
    # a text prompt or message holding a special token's string (`<|im_end|>`) is a 400;
    # else it is tokenized as that control token, as Hugging Face's apply_chat_template does
    refuse_special_tokens: bool = False
    # bus-fed state is bounded (DESIGN.md 7b): engines tracked (a heartbeat of a new engine
    # beyond it is dropped, unless a gone engine can make room) and model cards held (the
    # least recently named goes first)
    max_engines: int = 512
    max_model_cards: int = 64
    # completions and chat without max_tokens generate up to what the context leaves after
    # the prompt (OpenAI's rule), at most this many tokens when set (engines reserve pages
    # for every token a request may write, so an uncapped default holds a context's worth)
    default_max_tokens: int | None = None
    shutdown_timeout_s: float = 30.0  # in-flight requests get this long at shutdown
    pd_admit_timeout_s: float = 10.0  # wait for a decode engine's DecodeAdmitReply
    # a decode engine gives up on KV that stops arriving after this long (DecodeAdmit
    # .transfer_timeout_s); None: 0.8 x request_timeout_s, so its error beats our timeout
    pd_transfer_timeout_s: float | None = None

    def __post_init__(self) -> None:
        positive = {
            "request_timeout_s": self.request_timeout_s,
            "liveness_poll_s": self.liveness_poll_s,
            "redis_timeout_s": self.redis_timeout_s,
            "redis_probe_s": self.redis_probe_s,
            "redis_probe_timeout_s": self.redis_probe_timeout_s,
            "read_timeout_s": self.read_timeout_s,
            "flush_timeout_s": self.flush_timeout_s,
            "shutdown_timeout_s": self.shutdown_timeout_s,
            "pd_admit_timeout_s": self.pd_admit_timeout_s,
            "pd_transfer_timeout_s": self.transfer_timeout_s,
            "tokenize_timeout_s": self.tokenize_timeout_s,
        }
        for name, value in positive.items():
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value}")
        non_negative = {
            "failed_quarantine_s": self.failed_quarantine_s,
            "redis_retry_s": self.redis_retry_s,
            "device_weight": self.device_weight,
            "host_weight": self.host_weight,
            "load_weight": self.load_weight,
        }
        for name, value in non_negative.items():
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {value}")
        if self.heartbeat_misses < 1:
            raise ValueError("heartbeat_misses must be >= 1")
        for name in ("failed_strikes", "redis_breaker_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 0 < self.redis_breaker_ratio <= 1:
            raise ValueError("redis_breaker_ratio must be in (0, 1]")
        if self.redis_sentinels:
            sentinel_redis_url(self.redis_url, self.redis_sentinels)  # ValueError: contradicts
        if self.max_connections < 2:
            raise ValueError("max_connections must be >= 2")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
        if self.page_chain_cache_bytes < 0:
            raise ValueError("page_chain_cache_bytes must be >= 0")
        if self.record_queue < 1:
            raise ValueError("record_queue must be >= 1")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be >= 1 when given")
        if self.max_stop_strings < 1:
            raise ValueError("max_stop_strings must be >= 1")
        if self.max_prompt_chars < 1:
            raise ValueError("max_prompt_chars must be >= 1")
        if self.tokenizer_worker_num < 1:
            raise ValueError("tokenizer_worker_num must be >= 1")
        if self.max_engines < 1 or self.max_model_cards < 1:
            raise ValueError("max_engines and max_model_cards must be >= 1")
        if not self.buckets:
            raise ValueError("at least one bucket")
        object.__setattr__(self, "buckets", order(self.buckets))
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty when given")
        if self.admin_api_key is not None and not self.admin_api_key:
            raise ValueError("admin_api_key must not be empty when given")
        if self.admin_api_key is not None and self.admin_api_key == self.api_key:
            raise ValueError("the admin API key must differ from the API key")
        if any(t.key in (self.admin_api_key, self.api_key) for t in self.tenant_keys):
            raise ValueError("a tenant key must differ from the API key and the admin key")
        if self.probe_auth not in PROBE_AUTH:
            raise ValueError(f"probe_auth must be one of {PROBE_AUTH}, got {self.probe_auth!r}")
        for name in self.shared_cache_namespaces:
            if not TENANT_NAME.fullmatch(name):
                raise ValueError(f"shared cache namespaces are 1-64 of [A-Za-z0-9._-]: {name!r}")
        if self.record_token_ids not in TOKEN_IDS:
            raise ValueError(f"record_token_ids must be one of {TOKEN_IDS}")
        if self.record_max_bytes < 0 or 0 < self.record_max_bytes < 64 * 1024:
            raise ValueError("record_max_bytes must be 0 (no cap) or at least 65536")
        if self.record_backups < 1:
            raise ValueError("record_backups must be >= 1")

    @property
    def bucket(self) -> str:
        """The largest bucket (what a request that fits none is refused by)."""
        return self.buckets[-1].name

    @property
    def transfer_timeout_s(self) -> float:
        """What decode engines are told to wait for KV (`pd_transfer_timeout_s` or derived)."""
        if self.pd_transfer_timeout_s is not None:
            return self.pd_transfer_timeout_s
        return 0.8 * self.request_timeout_s
