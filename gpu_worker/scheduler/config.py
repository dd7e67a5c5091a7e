"""The scheduler's configuration."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    chunked_prefill_size: int = 512  # prompt tokens computed per step, all requests together
    max_running_requests: int = 64
    check_integrity_when_idle: bool = False
    # a sharded CP pool's two gather scratch buffers together (`scheduler/gather_budget.py`)
    cp_gather_buffer_mb: float = 1024.0

    def __post_init__(self) -> None:
        if self.chunked_prefill_size <= 0 or self.max_running_requests <= 0:
            raise ValueError("chunked_prefill_size and max_running_requests must be positive")
        if not self.cp_gather_buffer_mb > 0:
            raise ValueError(
                f"cp_gather_buffer_mb must be positive, got {self.cp_gather_buffer_mb}"
            )
