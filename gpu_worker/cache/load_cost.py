"""Is a slow-tier hit worth loading? Estimate both ways from what this engine measured.

Loading a host hit costs its bytes over the measured host->device bandwidth; not loading
it costs recomputing its tokens at the measured prefill throughput. Until something is
measured, loading is assumed to win. Wall-clock measurements differ between ranks, so a
multi-rank engine must take this decision on one rank and broadcast it (DESIGN.md 4).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class LoadCostModel:
    alpha: float = 0.2  # EMA weight of a new observation
    load_bytes_per_s: float | None = None
    prefill_tokens_per_s: float | None = None
    fixed_load_s: float = 0.0  # per-load latency beyond the bytes (ACK round, hand-off)

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
