"""What one request got, whether recorded by the router or observed by the replay client.

An `Observation` is the common ground of every comparison: the recording against a replay,
and one arm against another. Times are seconds; `None` (or `()` for gaps) when the side did
not measure them (a whole response has no TTFT in the client; a rejected request no token).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TIERS = ("device", "host", "storage")


def _count(d: Mapping[str, Any], key: str) -> int:
    value = d.get(key)
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


@dataclass(frozen=True, slots=True)
class CachedTokens:
    """Prompt tokens not computed, by the tier they came from."""

    device: int = 0
    host: int = 0
    storage: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.storage

    def tier(self, name: str) -> int:
        return int(getattr(self, name))

    def minus(self, other: CachedTokens) -> CachedTokens:
        """Per tier, what `self` has beyond `other` (never negative)."""
        return CachedTokens(
            max(0, self.device - other.device),
            max(0, self.host - other.host),
            max(0, self.storage - other.storage),
        )

    def plus(self, other: CachedTokens) -> CachedTokens:
        return CachedTokens(
            self.device + other.device, self.host + other.host, self.storage + other.storage
        )

    @classmethod
    def from_tiers(cls, tiers: Mapping[str, Any] | None) -> CachedTokens:
        """`{"device": D, "host": H, "storage": S}`; a missing tier counts 0."""
        if not isinstance(tiers, Mapping):
            return cls()
        return cls(_count(tiers, "device"), _count(tiers, "host"), _count(tiers, "storage"))

    @classmethod
    def from_usage(cls, usage: Mapping[str, Any] | None) -> CachedTokens:
        """An OpenAI response's `usage.prompt_tokens_details.cached_tokens_by_tier`."""
        details = usage.get("prompt_tokens_details") if isinstance(usage, Mapping) else None
        tiers = details.get("cached_tokens_by_tier") if isinstance(details, Mapping) else None
        return cls.from_tiers(tiers)

    @classmethod
    def from_meta_info(cls, meta: Mapping[str, Any] | None) -> CachedTokens:
        """A `/generate` response's `meta_info` (`cached_tokens_device`, ...)."""
        if not isinstance(meta, Mapping):
            return cls()
        return cls(
            _count(meta, "cached_tokens_device"),
            _count(meta, "cached_tokens_host"),
            _count(meta, "cached_tokens_storage"),
        )


@dataclass(frozen=True, slots=True)
class ChoiceOutput:
    """One choice: the generated ids, the text (None when redacted) and why it ended."""

    output_ids: tuple[int, ...]
    text: str | None
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class Observation:
    """The answer to one request."""

    status: int
    choices: tuple[ChoiceOutput, ...] = ()
    prompt_tokens: int | None = None
    cached: CachedTokens | None = None  # None: the answer did not say (a stream without usage)
    ttft_s: float | None = None
    itl_s: tuple[float, ...] = ()
    e2e_s: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None
