"""Every message on the bus. Bump a class's VERSION when its fields change."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from bus_schemas.codec import Message

TIERS = ("device", "host")


@dataclass(frozen=True, slots=True)
class Sampling(Message):
    TYPE: ClassVar[str] = "sampling"

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class GenerateRequest(Message):
    """Router -> engine: generate for `input_ids`, stream `TokenChunk`s to `reply_to`."""

    TYPE: ClassVar[str] = "generate"

    request_id: str
    input_ids: list[int]
    sampling: Sampling
    reply_to: str  # subject the engine publishes TokenChunks on
    cache_salt: str = ""


@dataclass(frozen=True, slots=True)
class TokenChunk(Message):
    """Engine -> router: new tokens of one request, in order (`seq` counts from 0).

    The last chunk has `finished` set, with `finish_reason` ("stop", "length") or `error`.
    Cached-token counts are valid from the first chunk on.
    """

    TYPE: ClassVar[str] = "token_chunk"

    request_id: str
    seq: int
    token_ids: list[int]
    engine_id: str
    prompt_tokens: int = 0
    cached_device: int = 0
    cached_host: int = 0
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    error_code: int = 0  # an HTTP-like status for errors: 400 bad input, 503 engine stopping


@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """Engine -> everyone, every `interval_s`: alive, and how loaded."""

    TYPE: ClassVar[str] = "heartbeat"

    engine_id: str
    bucket: str
    epoch: str
    model: str
    namespace: str
    page_size: int
    context_len: int
    vocab_size: int
    eos_token_ids: list[int]
    running: int
    waiting: int
    inflight_tokens: int
    interval_s: float
    role: str = "colocated"


@dataclass(frozen=True, slots=True)
class KVEvent(Message):
    """Pages that became (`stored`) or stopped being (`removed`) held in one tier."""

    TYPE: ClassVar[str] = "kv_event"

    kind: str  # "stored" | "removed"
    tier: str  # "device" | "host"
    page_hashes: list[str]

    def __post_init__(self) -> None:
        if self.kind not in ("stored", "removed"):
            raise ValueError(f"kind must be 'stored' or 'removed', got {self.kind!r}")
        if self.tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {self.tier!r}")


@dataclass(frozen=True, slots=True)
class KVEventBatch(Message):
    """Engine -> index: events in order. `seq` increases by one per batch of one epoch.

    A `snapshot` batch replaces everything the index holds for the engine: it lists every
    page the engine holds, per tier, as `stored` events.
    """

    TYPE: ClassVar[str] = "kv_events"

    engine_id: str
    bucket: str
    epoch: str  # changes at every engine start
    seq: int
    namespace: str
    events: list[KVEvent]
    snapshot: bool = False


@dataclass(frozen=True, slots=True)
class SnapshotRequest(Message):
    """Index -> engine: your events had a gap; publish a snapshot batch."""

    TYPE: ClassVar[str] = "snapshot_request"

    engine_id: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class AbortRequest(Message):
    """Router -> engine: stop generating for `request_id` (client gone, stop string hit)."""

    TYPE: ClassVar[str] = "abort"

    request_id: str


@dataclass(frozen=True, slots=True)
class FlushRequest(Message):
    TYPE: ClassVar[str] = "flush"


@dataclass(frozen=True, slots=True)
class FlushReply(Message):
    TYPE: ClassVar[str] = "flush_reply"

    engine_id: str
    success: bool
    message: str = ""


@dataclass(frozen=True, slots=True)
class StatsRequest(Message):
    TYPE: ClassVar[str] = "stats"


@dataclass(frozen=True, slots=True)
class StatsReply(Message):
    TYPE: ClassVar[str] = "stats_reply"

    engine_id: str
    bucket: str
    epoch: str
    stats: dict[str, int]


@dataclass(frozen=True, slots=True)
class ErrorReply(Message):
    """Any request/reply subject's answer when the request itself was invalid."""

    TYPE: ClassVar[str] = "error"

    message: str
    code: int = 400
