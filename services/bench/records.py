"""One measured request (`RequestResult`) and what its final `usage` says about the cache.

`usage.prompt_tokens_details` carries `cached_tokens` and `cached_tokens_by_tier`
(`device`, `host`). A P/D mesh adds `usage["disaggregation"]`: which engines ran prefill
and decode, how much of the prompt decode already held (`decode_prefix_len`), what was
moved from prefill to decode, and each side's cached tokens by tier. A server that does
not send a field gives zeros (counts) or None (names, the whole P/D block).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any


def _int(d: Mapping[str, Any], key: str) -> int:
    value = d.get(key)
    return int(value) if isinstance(value, int | float) else 0


@dataclass(frozen=True, slots=True)
class Disaggregation:
    """`usage["disaggregation"]` of a P/D mesh."""

    prefill_engine: str | None
    decode_engine: str | None
    decode_prefix_len: int  # prompt tokens decode reused from its own cache
    transferred_tokens: int  # KV tokens moved prefill -> decode
    transferred_bytes: int
    prefill_cached_device: int
    prefill_cached_host: int
    decode_cached_device: int
    decode_cached_host: int
    prefill_cached_storage: int = 0

    @classmethod
    def from_usage(cls, usage: Mapping[str, Any]) -> Disaggregation | None:
        d = usage.get("disaggregation")
        if not isinstance(d, Mapping):
            return None
        prefill, decode = d.get("prefill_engine"), d.get("decode_engine")
        return cls(
            prefill_engine=None if prefill is None else str(prefill),
            decode_engine=None if decode is None else str(decode),
            decode_prefix_len=_int(d, "decode_prefix_len"),
            transferred_tokens=_int(d, "transferred_tokens"),
            transferred_bytes=_int(d, "transferred_bytes"),
            prefill_cached_device=_int(d, "prefill_cached_device"),
            prefill_cached_host=_int(d, "prefill_cached_host"),
            decode_cached_device=_int(d, "decode_cached_device"),
            decode_cached_host=_int(d, "decode_cached_host"),
            prefill_cached_storage=_int(d, "prefill_cached_storage"),
        )


@dataclass(frozen=True, slots=True)
class CacheUsage:
    """The cache counts of one response's `usage`."""

    cached_tokens: int = 0
    cached_device: int = 0
    cached_host: int = 0
    disaggregation: Disaggregation | None = None
    cached_storage: int = 0

    @classmethod
    def from_usage(cls, usage: Mapping[str, Any] | None) -> CacheUsage:
        if not usage:
            return cls()
        details = usage.get("prompt_tokens_details")
        details = details if isinstance(details, Mapping) else {}
        tiers = details.get("cached_tokens_by_tier")
        tiers = tiers if isinstance(tiers, Mapping) else {}
        return cls(
            cached_tokens=_int(details, "cached_tokens"),
            cached_device=_int(tiers, "device"),
            cached_host=_int(tiers, "host"),
            disaggregation=Disaggregation.from_usage(usage),
            cached_storage=_int(tiers, "storage"),
        )


@dataclass(frozen=True, slots=True)
class RequestResult:
    """One request of one arm. Times in seconds; `start` is from the arm's start."""

    arm: str
    conversation: int
    group: int
    turn: int  # 1-based
    prompt_len: int
    output_len: int  # tokens received
    start: float
    ttft: float | None  # to the first event that carries tokens
    latency: float  # end to end
    itl: tuple[float, ...] = ()  # one gap per token after the first
    cache: CacheUsage = field(default_factory=CacheUsage)
    engine: str | None = None  # X-Hicache-Engine
    error: str | None = None  # why it failed: the server's message, or the client's exception
    error_code: str | None = None  # "HTTP 504 kv_transfer_timeout", "stream error ...", ...
    round: int = 0  # the interleaved round it ran in (0-based)

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_record(self) -> dict[str, Any]:
        """The JSON line written to `--output-file`."""
        return {
            "arm": self.arm,
            "round": self.round,
            "conversation": self.conversation,
            "group": self.group,
            "turn": self.turn,
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
            "start": self.start,
            "ttft": self.ttft,
            "latency": self.latency,
            "itl": list(self.itl),
            "itl_mean": sum(self.itl) / len(self.itl) if self.itl else None,
            "cached_tokens": self.cache.cached_tokens,
            "cached_tokens_by_tier": {
                "device": self.cache.cached_device,
                "host": self.cache.cached_host,
                "storage": self.cache.cached_storage,
            },
            "disaggregation": (
                None if self.cache.disaggregation is None else asdict(self.cache.disaggregation)
            ),
            "engine": self.engine,
            "error": self.error,
            "error_code": self.error_code,
        }

    @property
    def failure(self) -> str | None:
        """Why it failed, as the summary counts it ("CODE: message"); None if it did not."""
        if self.error is None:
            return None
        return self.error if self.error_code is None else f"{self.error_code}: {self.error}"
