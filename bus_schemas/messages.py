"""Every message on the bus. Bump a class's VERSION when its fields change."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import ClassVar

from bus_schemas.codec import Message
from bus_schemas.token_ids import TokenIds, as_token_ids

TIERS = ("device", "host", "storage")


@dataclass(frozen=True, slots=True)
class Sampling(Message):
    """A request's sampling (the engine validates the ranges: `SamplingParams`)."""

    TYPE: ClassVar[str] = "sampling"

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] = field(default_factory=dict)  # token id (as a string) -> bias
    logprobs: int | None = None  # None: none; k: the chosen token's and the top k's


@dataclass(frozen=True, slots=True)
class GenerateRequest(Message):
    """Router -> engine: generate for `input_ids`, stream `TokenChunk`s to `reply_to`."""

    TYPE: ClassVar[str] = "generate"
    VERSION: ClassVar[int] = 3  # 2: input_ids as base64 uint32 (TokenIds); 3: more sampling

    request_id: str
    input_ids: TokenIds  # a list[int] given here is converted once
    sampling: Sampling
    reply_to: str  # subject the engine publishes TokenChunks on
    cache_salt: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_ids", as_token_ids(self.input_ids))


@dataclass(frozen=True, slots=True)
class TokenChunk(Message):
    """Engine -> router: new tokens of one request, in order (`seq` counts from 0).

    The last chunk has `finished` set, with `finish_reason` ("stop", "length") or `error`.
    Cached-token counts are valid from the first chunk on.
    """

    TYPE: ClassVar[str] = "token_chunk"
    # 2: P/D fields; 3: engine_crashed; 4: logprobs; 5: storage; 6: prefill's storage hits;
    # 7: speculative decoding's counts
    VERSION: ClassVar[int] = 7

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
    error_code: int = 0  # HTTP-like: 400 bad input, 409 restore lost, 503 unavailable/timeout
    # the engine's step loop died with this request in it (the request may be the cause):
    # the router must not send it to another engine
    engine_crashed: bool = False
    # P/D, set by the decode engine on a request's first chunk (decode_prefix_len -1 otherwise):
    decode_prefix_len: int = -1  # tokens decode reused from its own cache
    transferred_tokens: int = 0  # KV tokens received from prefill (prompt_len - decode_prefix_len)
    transferred_bytes: int = 0
    prefill_engine_id: str = ""
    prefill_cached_device: int = 0
    prefill_cached_host: int = 0
    # when the request asked for logprobs: one per token of `token_ids` (null for a P/D
    # request's first token, sampled by prefill), and for each the top tokens' ids and logprobs
    logprobs: list[float | None] = field(default_factory=list)
    top_logprob_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    cached_storage: int = 0  # prompt tokens read from external storage (L3) for it
    prefill_cached_storage: int = 0  # P/D: ... by the prefill engine (first chunk)
    # speculative decoding, so far (every chunk): verify rounds, draft tokens proposed and
    # accepted (SGLang's meta info spec_verify_ct, spec_draft_token_num, spec_accept_token_num)
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


@dataclass(frozen=True, slots=True)
class DecodeAdmit(Message):
    """Router -> decode engine (request/reply): admit a P/D request.

    The decode engine matches the prompt against its own cache (unless `reuse` is False),
    reserves pages for the restored prefix and the incoming suffix, starts restoring the host
    part, and answers `DecodeAdmitReply`. It then streams `TokenChunk`s to `reply_to` once
    the KV is complete.
    """

    TYPE: ClassVar[str] = "decode_admit"
    VERSION: ClassVar[int] = 3  # 2: input_ids as base64 uint32 (TokenIds); 3: more sampling

    request_id: str
    input_ids: TokenIds  # a list[int] given here is converted once
    sampling: Sampling
    reply_to: str
    cache_salt: str = ""
    reuse: bool = True  # False: decode_prefix_len = 0 (a retry after a failed restore)
    transfer_timeout_s: float = 30.0  # give up (and release) if KV stops arriving

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_ids", as_token_ids(self.input_ids))


@dataclass(frozen=True, slots=True)
class DecodeAdmitReply(Message):
    TYPE: ClassVar[str] = "decode_admit_reply"

    request_id: str
    engine_id: str
    decode_prefix_len: int  # page-aligned; prefill sends KV of positions >= this
    kv_subject: str  # where prefill sends KV frames (bus_schemas.kv_frame)
    cached_device: int = 0
    cached_host: int = 0
    error: str | None = None
    error_code: int = 0


@dataclass(frozen=True, slots=True)
class PrefillRequest(Message):
    """Router -> prefill engine: compute the prompt (reusing prefill's own cache), sample the
    first token, and send KV of positions >= `decode_prefix_len` to `kv_subject`.

    Errors (bad input, transfer failure) come back as a finished `TokenChunk` on `reply_to`.
    """

    TYPE: ClassVar[str] = "prefill"
    VERSION: ClassVar[int] = 3  # 2: input_ids as base64 uint32 (TokenIds); 3: more sampling

    request_id: str
    input_ids: TokenIds  # a list[int] given here is converted once
    sampling: Sampling
    cache_salt: str
    decode_prefix_len: int
    kv_subject: str
    reply_to: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_ids", as_token_ids(self.input_ids))


@dataclass(frozen=True, slots=True)
class KVChunkAck(Message):
    """Decode -> prefill: frame `seq` of `request_id` was written (or rejected: `ok` False)."""

    TYPE: ClassVar[str] = "kv_ack"

    request_id: str
    seq: int
    ok: bool = True
    error: str = ""


# a heartbeat's interval must lie in this range: liveness (and every key and table entry an
# engine holds) lasts a few intervals, so a huge one would pin a fake engine for hours
MIN_HEARTBEAT_INTERVAL_S = 0.01
MAX_HEARTBEAT_INTERVAL_S = 60.0
MAX_NAME_LEN = 256  # model, bucket and namespace names in heartbeats


@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """Engine -> everyone, every `interval_s`: alive, how loaded, and its cache counters
    (cumulative since the engine started or flushed; the router exports them per engine)."""

    TYPE: ClassVar[str] = "heartbeat"
    # 2: cache usage and counters; 3: eviction counters; 4: card; 5: external storage;
    # 6: bus_reconnects; 7: generation_tokens, gen_throughput
    VERSION: ClassVar[int] = 8  # 8: speculative decoding's counters

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
    token_usage: float = 0.0  # device KV pages in use / device pages
    host_token_usage: float = 0.0  # host KV pages in use / host pages (0 without HiCache)
    cached_tokens: int = 0  # prompt tokens reused from the device and host tiers
    num_loads: int = 0  # host -> device loads
    num_backups: int = 0  # device -> host backups
    evicted_device_pages: int = 0  # device pages evicted from the radix cache
    evicted_host_pages: int = 0  # host pages evicted from the radix cache
    # the digest of the engine's ModelCard: a router that holds no card of that digest asks
    # the engine for it (request/reply on `subjects.engine_model_card`)
    card_digest: str = ""
    # external storage (L3): which store the engine reads and writes (engines with the same
    # id share objects; "" without storage), and its counters
    store_id: str = ""
    storage_pages_read: int = 0
    storage_pages_written: int = 0
    storage_write_failures: int = 0  # puts that stopped early (a full or read-only store)
    storage_quarantined: int = 0  # objects that failed verification: set aside, not read
    # speculative decoding: verify rounds, draft tokens proposed, accepted, and tokens the
    # rounds emitted (the router exports sglang:spec_accept_length and _rate from them)
    spec_verify_rounds: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_emitted_tokens: int = 0
    # how often the engine's NATS connection came back: messages to it, or from it to a
    # router not yet resubscribed, may have been lost then (routers check their streams)
    bus_reconnects: int = 0
    # output tokens streamed since the engine started (a P/D decode engine's include the
    # first token, which prefill sampled; a prefill engine streams none), and their rate
    # over the last heartbeat interval in tokens/s (SGLang's gen_throughput)
    generation_tokens: int = 0
    gen_throughput: float = 0.0

    def __post_init__(self) -> None:
        if not MIN_HEARTBEAT_INTERVAL_S <= self.interval_s <= MAX_HEARTBEAT_INTERVAL_S:
            raise ValueError(
                f"interval_s must be in [{MIN_HEARTBEAT_INTERVAL_S}, "
                f"{MAX_HEARTBEAT_INTERVAL_S}], got {self.interval_s}"
            )
        for name in ("model", "bucket", "namespace", "card_digest", "store_id"):
            if len(getattr(self, name)) > MAX_NAME_LEN:
                raise ValueError(f"{name} is longer than {MAX_NAME_LEN} characters")


@dataclass(frozen=True, slots=True)
class ModelCardRequest(Message):
    TYPE: ClassVar[str] = "model_card_request"


@dataclass(frozen=True, slots=True)
class ModelCard(Message):
    """Engine -> router (reply): how to speak the served model's language, so the router
    tokenizes, applies the chat template and detokenizes exactly as the model expects
    without importing `gpu_worker` (DESIGN.md 7). It names no engine: every engine of one
    model, tokenizer and template has the same card, hence the same digest."""

    TYPE: ClassVar[str] = "model_card"

    served_model_name: str  # what clients name the model (`--served-model-name`)
    model: str  # the engine's --model value
    tokenizer: str  # "bytes" (UTF-8 bytes are ids 0..255: the random presets) or "json"
    tokenizer_json: str  # a `tokenizers` JSON when tokenizer == "json", else ""
    chat_template: str | None  # a Jinja chat template, or None for the built-in plain one
    eos_token_ids: list[int]  # eos and the template's end of turn
    bos_token_id: int | None
    context_len: int
    vocab_size: int

    def __post_init__(self) -> None:
        if self.tokenizer not in ("bytes", "json"):
            raise ValueError(f"tokenizer must be 'bytes' or 'json', got {self.tokenizer!r}")
        if (self.tokenizer == "json") != bool(self.tokenizer_json):
            raise ValueError("tokenizer_json is given exactly when tokenizer is 'json'")

    @property
    def digest(self) -> str:
        """A stable digest of the card's content (what heartbeats carry)."""
        return hashlib.blake2b(self.encode(), digest_size=12).hexdigest()

    @property
    def speech_digest(self) -> str:
        """The digest of what requests are parsed with (everything but the context length):
        engines of one model in buckets of different lengths speak alike."""
        same = dataclasses.replace(self, context_len=0)
        return hashlib.blake2b(same.encode(), digest_size=12).hexdigest()


@dataclass(frozen=True, slots=True)
class KVEvent(Message):
    """Pages that became (`stored`) or stopped being (`removed`) held in one tier.

    Events are per logical page (the router's index scores logical prefixes), whatever the
    engine's layout. An engine whose KV is sharded by page over `cp_size` > 1 CP ranks
    (`--enable-kv-cache-sharding`) also says which rank holds each page: page `i` of
    `page_hashes` on CP rank `(owner_rotation + i) % cp_size`, so another topology or a P/D
    decode engine can tell. Both fields are left out at their defaults (`OMIT_DEFAULTS`:
    every rank holds every page), so a consumer that predates them reads every other
    engine's events, and a message without them reads as one of those.
    """

    TYPE: ClassVar[str] = "kv_event"
    OMIT_DEFAULTS: ClassVar[frozenset[str]] = frozenset({"owner_rotation", "cp_size"})

    kind: str  # "stored" | "removed"
    tier: str  # "device" | "host"
    page_hashes: list[str]
    owner_rotation: int = 0  # sharded CP: the CP rank holding the first page
    cp_size: int = 1  # CP ranks the pages are sharded over (1: every rank holds every page)

    def __post_init__(self) -> None:
        if self.kind not in ("stored", "removed"):
            raise ValueError(f"kind must be 'stored' or 'removed', got {self.kind!r}")
        if self.tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {self.tier!r}")
        if self.cp_size < 1 or not 0 <= self.owner_rotation < self.cp_size:
            raise ValueError(
                f"owner_rotation {self.owner_rotation} is not a CP rank of cp_size {self.cp_size}"
            )


@dataclass(frozen=True, slots=True)
class KVEventBatch(Message):
    """Engine -> index: events in order. `seq` increases by one per batch of one epoch.

    A `snapshot` batch replaces everything the index holds for the engine: it lists every
    page the engine holds, per tier, as `stored` events.
    """

    TYPE: ClassVar[str] = "kv_events"
    # 2: store_id (events of the "storage" tier). KVEvent's CP fields bumped nothing: they
    # are left out at their defaults, so a version-2 consumer reads a CP1 engine's batches
    VERSION: ClassVar[int] = 2

    engine_id: str
    bucket: str
    epoch: str  # changes at every engine start
    seq: int
    namespace: str
    events: list[KVEvent]
    snapshot: bool = False
    # the store the engine's "storage" events are about (`Heartbeat.store_id`); storage
    # pages outlive the engine, so the index keeps them per store, not per engine
    store_id: str = ""


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
class StreamCheck(Message):
    """Router -> engine, after a NATS reconnect on either side: does the engine hold
    `request_id`, streaming to `reply_to`? Answered with a StreamState on `reply_to`."""

    TYPE: ClassVar[str] = "stream_check"

    request_id: str
    reply_to: str


@dataclass(frozen=True, slots=True)
class StreamState(Message):
    """Engine -> router, on the stream's own reply subject, after every chunk sent before
    it (one connection delivers in order): the engine holds the request (`held`) and has
    sent chunks 0..`next_seq`-1. A router that got fewer, or asks about a request the
    engine does not hold, lost replies on the bus."""

    TYPE: ClassVar[str] = "stream_state"

    request_id: str
    engine_id: str
    held: bool
    next_seq: int


PROGRESS_STATES = ("queued", "computing", "receiving")


@dataclass(frozen=True, slots=True)
class Progress(Message):
    """Engine -> whoever waits on a request it holds: the engine is working on it, so a
    silence that would otherwise read as a hang is not one. Sent about a request at most
    once per heartbeat interval, and only while the engine computed since the last one (a
    decoder layer, within a long step too) and no chunk of it went out meanwhile:
    `queued` (behind other requests, or in the command queue), `computing` (loading its
    cached prefix, prefilling, decoding) or `receiving` (a P/D decode engine wrote KV frames
    of it since the last one). A hung step loop sends none, however its heartbeats go on.

    It goes where a reply of that request goes, never into heartbeats: to the router on the
    request's reply subject (`next_chunk` restarts its deadline), and from a P/D prefill
    engine also to the decode engine on the admit's `kv_subject` (its KV watchdog restarts).
    Only the one waiter hears it, it costs nothing for requests no one waits on, a busy
    engine's heartbeats do not grow with its queue, and the decode engine needs no
    subscription to every heartbeat to learn that its prefill engine is busy with its
    request."""

    TYPE: ClassVar[str] = "progress"

    request_id: str
    engine_id: str
    state: str  # one of PROGRESS_STATES

    def __post_init__(self) -> None:
        if self.state not in PROGRESS_STATES:
            raise ValueError(f"state must be one of {PROGRESS_STATES}, got {self.state!r}")


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
