"""What the engine runner reports to its service about each request it holds: new tokens
(`TokenUpdate`), a P/D decode request's admission (`Admission`), what the engine does with
it now (`Holding`), and the engine's load (`LoadInfo`). Frozen: they cross from the
runner's thread onto the service's event loop."""

from __future__ import annotations

from dataclasses import dataclass

from gpu_worker.scheduler.request import RequestError


@dataclass(frozen=True, slots=True)
class ReceivedKV:
    """P/D decode: how much of a request's prompt KV came from its prefill engine."""

    prefix_len: int  # decode_prefix_len: prompt tokens reused from this engine's cache
    num_tokens: int  # prompt tokens past `prefix_len` whose KV is written so far
    num_bytes: int  # bytes of KV received for them


@dataclass(frozen=True, slots=True)
class TokenUpdate:
    """New tokens of one request since the last update; `finished` on its last one."""

    request_id: str  # the router's id of the request
    token_ids: list[int]  # the new output tokens
    prompt_tokens: int  # the prompt's length
    cached_device: int  # prompt tokens served from the device tier
    cached_host: int  # prompt tokens loaded back from the host tier
    finished: bool  # the request's last update
    finish_reason: str | None  # "stop", "length", "abort" or "error" once finished
    error: RequestError | None = None  # when it failed
    received: ReceivedKV | None = None  # P/D decode, once admitted
    # when asked for: per new token (its logprob or None, the top (id, logprob) pairs)
    logprobs: tuple[tuple[float | None, tuple[tuple[int, float], ...]], ...] = ()
    cached_storage: int = 0  # prompt tokens read from external storage for it
    # speculative decoding so far: verify rounds, draft tokens proposed and accepted
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


@dataclass(frozen=True, slots=True)
class LoadInfo:
    running: int  # requests in the running batch
    waiting: int  # requests in the scheduler's queue
    inflight_tokens: int  # prompt + max new tokens of the running requests


@dataclass(frozen=True, slots=True)
class Holding:
    """What the engine does with a request it holds (`EngineRunner.holding`): `queued`
    (waiting in the command queue or the scheduler's queue), `computing` (loading its cached
    prefix, prefilling or decoding) or `receiving` (P/D decode: its KV comes from a prefill
    engine; `received_len` prompt tokens of it are written)."""

    state: str
    received_len: int = 0


QUEUED, COMPUTING = Holding("queued"), Holding("computing")


@dataclass(frozen=True, slots=True)
class Admission:
    """P/D decode: what a request reused locally once admitted."""

    decode_prefix_len: int  # prompt tokens reused from this engine's cache (page-aligned)
    cached_device: int  # of them, on the device
    cached_host: int  # of them, loaded back from the host tier
