"""Is a slow-tier hit worth loading? Estimate both ways from what rank 0 measured.

Loading a host hit costs its bytes over the measured host->device bandwidth; not loading
it costs recomputing its tokens at the measured prefill throughput. Until something is
measured, loading is assumed to win.

Wall-clock measurements differ between ranks, so the decision never reads them directly
(DESIGN.md 4): rank 0's `LoadCostModel` turns its measurements into a `LoadCostEstimate`
(seconds per token each way), the engine hands that to every rank as a command when it
changes, and every rank decides from the same estimate, in tokens, which are the same on
every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

REBROADCAST_CHANGE = 0.1  # a new estimate goes out when a figure moved by more than 10%


@dataclass(frozen=True, slots=True)
class LoadCostEstimate:
    """The figures every rank decides from (identical on all ranks)."""

    load_s_per_token: float | None = None
    recompute_s_per_token: float | None = None
    fixed_load_s: float = 0.0  # per-load latency beyond the bytes (ACK round, hand-off)
    storage_s_per_token: float | None = None  # reading from external storage (L3)

    def worth_loading(self, num_tokens: int) -> bool:
        if self.load_s_per_token is None or self.recompute_s_per_token is None:
            return True
        load = self.fixed_load_s + num_tokens * self.load_s_per_token
        return load < num_tokens * self.recompute_s_per_token

    def worth_reading(self, num_tokens: int) -> bool:
        """Whether reading `num_tokens` from storage, then loading them, beats recomputing."""
        if self.storage_s_per_token is None or self.recompute_s_per_token is None:
            return True
        read = num_tokens * (self.storage_s_per_token + (self.load_s_per_token or 0.0))
        return read < num_tokens * self.recompute_s_per_token

    def differs_from(self, other: LoadCostEstimate) -> bool:
        """Whether this estimate moved enough from `other` to be sent again."""
        for a, b in (
            (self.load_s_per_token, other.load_s_per_token),
            (self.recompute_s_per_token, other.recompute_s_per_token),
            (self.storage_s_per_token, other.storage_s_per_token),
        ):
            if (a is None) != (b is None):
                return True
            if a is not None and b is not None and abs(a - b) > REBROADCAST_CHANGE * abs(b):
                return True
        return False


@dataclass(slots=True)
class LoadCostModel:
    """Rank 0's own measurements (EMAs of bandwidth and throughput)."""

    alpha: float = 0.2  # EMA weight of a new observation
    load_bytes_per_s: float | None = None
    prefill_tokens_per_s: float | None = None
    fixed_load_s: float = 0.0

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def observe_load(self, num_bytes: int, seconds: float) -> None:
        if seconds > 0 and num_bytes > 0:
            self.load_bytes_per_s = self._ema(self.load_bytes_per_s, num_bytes / seconds)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if seconds > 0 and num_tokens > 0:
            self.prefill_tokens_per_s = self._ema(self.prefill_tokens_per_s, num_tokens / seconds)

    def load_seconds(self, num_bytes: int) -> float | None:
        if self.load_bytes_per_s is None:
            return None
        return self.fixed_load_s + num_bytes / self.load_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float | None:
        if self.prefill_tokens_per_s is None:
            return None
        return num_tokens / self.prefill_tokens_per_s

    def worth_loading(self, num_bytes: int, num_tokens: int) -> bool:
        load, recompute = self.load_seconds(num_bytes), self.recompute_seconds(num_tokens)
        return load is None or recompute is None or load < recompute

    def estimate(
        self, bytes_per_token: float, storage_s_per_page: float | None = None, page_size: int = 1
    ) -> LoadCostEstimate:
        """These measurements as per-token figures (rank 0's bytes per token; its measured
        storage read time per page, when it has read some)."""
        bw, tps = self.load_bytes_per_s, self.prefill_tokens_per_s
        return LoadCostEstimate(
            None if bw is None else bytes_per_token / bw,
            None if tps is None else 1.0 / tps,
            self.fixed_load_s,
            None if storage_s_per_page is None else storage_s_per_page / page_size,
        )
