"""Typed commands: the only way state-changing input reaches an engine's ranks.

The engine's API on rank 0 (`Engine.submit`, `abort`, `flush_cache`, `write_kv`, ...) turns
every input into one of these. At the start of each step rank 0 hands its list to every
rank (`gpu_worker/parallel/sync.py`), and every rank applies the same list in the same
order before its scheduler runs, so all ranks change state at the same logical points.
Commands are pickled for the other ranks; the fields marked "result" are filled on rank 0's
own objects when they are applied (rank 0 reports them to its caller).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.scheduler.request import Req


@dataclass(slots=True)
class AddRequest:
    """A new request, already validated and given its rid and sampling seed by rank 0."""

    req: Req


@dataclass(frozen=True, slots=True)
class Abort:
    rid: int


@dataclass(slots=True)
class Flush:
    """Drop every cached page; refused while requests run (every rank decides the same)."""

    ok: bool | None = None  # result


@dataclass(slots=True)
class WriteKV:
    """P/D decode: KV of tokens [token_start, token_end) for request `rid`, in the unified
    order with one KV head per group. `payloads[r]` is this engine's world rank r's shard
    (its layers and KV heads); every rank writes its own. Rank 0 collects the sending
    engine's shards in `parts` until all arrived and cuts them for its own ranks (not sent
    on)."""

    rid: int
    token_start: int
    token_end: int
    payloads: tuple[bytes, ...]
    first_token: int | None
    parts: dict[int, bytes] = field(default_factory=dict)  # rank 0 only: shards so far
    sender: ParallelConfig | None = None  # rank 0 only: the sending engine's layout
    applied: bool = False  # result: the step that wrote it ran
    error: str | None = None  # result: why the chunk did not fit the request
    written: int = 0  # result: bytes written on rank 0

    def __getstate__(self) -> dict[str, object]:
        """What the other ranks get: the chunk, not rank 0's collection or results."""
        return {
            "rid": self.rid,
            "token_start": self.token_start,
            "token_end": self.token_end,
            "payloads": self.payloads,
            "first_token": self.first_token,
        }

    def __setstate__(self, state: dict[str, object]) -> None:
        WriteKV.__init__(self, **state)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class EvictDevice:
    """Test hook (`generate --flush-device`): drain transfers, then evict `num_pages` pages
    of unlocked device cache, so the next hits come from the host tier."""

    num_pages: int


@dataclass(frozen=True, slots=True)
class Drain:
    """Wait for every queued transfer and apply its ACK (on every rank: their queues stay
    alike, which the per-step agreement relies on)."""


@dataclass(frozen=True, slots=True)
class SetLoadCost:
    """Rank 0's measured figures for `--hicache-load-policy cost`: every rank decides from
    these, never from its own clock. Seconds per token, or None while unmeasured."""

    load_s_per_token: float | None
    recompute_s_per_token: float | None
    storage_s_per_token: float | None = None


@dataclass(frozen=True, slots=True)
class StopPrefetch:
    """Rank 0's `timeout` verdict on request `rid`'s storage prefetch (read off its clock
    alone): every rank takes the pages read so far, at the same logical point."""

    rid: int


@dataclass(frozen=True, slots=True)
class Stop:
    """The engine is shutting down: every other rank leaves its step loop."""


Command = (
    AddRequest | Abort | Flush | WriteKV | EvictDevice | Drain | SetLoadCost | StopPrefetch | Stop
)
