"""The index service's configuration and counters."""

from __future__ import annotations

from dataclasses import dataclass

from bus_schemas import redis_keys
from bus_schemas.connection import Credentials
from bus_schemas.sentinel import DEFAULT_MASTER, Address, sentinel_redis_url


@dataclass(frozen=True, slots=True)
class IndexConfig:
    nats_url: str = "nats://127.0.0.1:4222"
    redis_url: str = "redis://127.0.0.1:6379/0"
    sweep_interval_s: float = 1.0  # expiry sweep and Redis health check period
    snapshot_retry_s: float = 2.0  # repeat an unanswered SnapshotRequest after this long
    store_ttl_s: int = redis_keys.STORE_TTL_S  # how long a page reported in a store counts
    redis_timeout_s: float = 2.0  # per Redis call
    drain_timeout_s: float = 5.0  # NATS drain at shutdown
    max_engines: int = 512  # engines indexed at once; messages of more are dropped
    nats_credentials: Credentials | None = None  # user `index` (None: no authentication)
    redis_credentials: Credentials | None = None
    # CA files (PEM): connect over TLS only, verifying the server against them (None: plain)
    nats_tls_ca_file: str | None = None
    redis_tls_ca_file: str | None = None
    # Sentinel (bus_schemas/sentinel.py): find the primary through these; `redis_url` then
    # gives only scheme, credentials and db
    redis_sentinels: tuple[Address, ...] = ()
    redis_sentinel_master: str = DEFAULT_MASTER
    redis_sentinel_credentials: Credentials | None = None

    def __post_init__(self) -> None:
        for name in ("sweep_interval_s", "snapshot_retry_s", "redis_timeout_s", "drain_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_engines < 1:
            raise ValueError(f"max_engines must be >= 1, got {self.max_engines}")
        if self.redis_sentinels:
            sentinel_redis_url(self.redis_url, self.redis_sentinels)  # ValueError: contradicts


@dataclass(slots=True)
class IndexStats:
    """Counters, logged at shutdown and read by tests."""

    batches_applied: int = 0
    snapshots_applied: int = 0
    batches_stale_epoch: int = 0  # rejected: epoch older than the engine's current one
    batches_dropped: int = 0  # arrived while a snapshot was awaited
    snapshot_requests: int = 0
    heartbeats: int = 0
    heartbeats_stale_epoch: int = 0
    invalid_messages: int = 0
    forged_messages: int = 0  # an engine id other than its subject's: dropped
    redis_errors: int = 0
    engines_expired: int = 0
    engines_refused: int = 0  # messages of a new engine beyond max_engines
    resyncs_after_redis: int = 0
    marked_synced: int = 0  # times the index wrote `INDEX_SYNCED` (a primary fully resynced)
