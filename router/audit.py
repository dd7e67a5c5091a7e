"""Predicted against delivered prefix hits: how stale the index is.

When the router routes by the index it knows the prefix (in tokens) the chosen engine should
reuse; the engine's first chunk says what it did reuse. In steady state the two are equal.
An engine that dropped pages without telling the index (a lost event, a flush behind its
back) delivers less than predicted ("over"); pages the index has not heard of yet make it
deliver more ("under"). `/stats` shows the summary (`prefix_prediction`), `/metrics` the
counts and the error histogram.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

RECENT = 16  # mispredictions kept for /stats


@dataclass(slots=True)
class PredictionAudit:
    exact: int = 0
    over: int = 0  # delivered less than predicted (the index is ahead of the engine)
    under: int = 0  # delivered more than predicted (the index is behind)
    abs_error_sum: int = 0
    max_abs_error: int = 0
    recent: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=RECENT))

    def observe(self, engine_id: str, predicted: int, delivered: int) -> str:
        """Count one served request; returns "exact", "over" or "under"."""
        error = predicted - delivered
        if error == 0:
            self.exact += 1
            return "exact"
        self.abs_error_sum += abs(error)
        self.max_abs_error = max(self.max_abs_error, abs(error))
        result = "over" if error > 0 else "under"
        if result == "over":
            self.over += 1
        else:
            self.under += 1
        self.recent.append(
            {
                "time": time.time(),
                "engine_id": engine_id,
                "predicted": predicted,
                "delivered": delivered,
            }
        )
        return result

    def summary(self) -> dict[str, Any]:
        total = self.exact + self.over + self.under
        return {
            "requests": total,
            "exact": self.exact,
            "over": self.over,
            "under": self.under,
            "mean_abs_error_tokens": self.abs_error_sum / total if total else 0.0,
            "max_abs_error_tokens": self.max_abs_error,
            "recent_mispredictions": list(self.recent),
        }
