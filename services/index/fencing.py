"""Which KV event batches the index may apply: epoch fencing and per-epoch sequence checks.

Pure functions over a small immutable `Fence`, so every rule is tested without a network.

An engine's epoch is a decimal integer string (its start time in ns) that grows at every
restart; within one epoch its batches carry `seq` 0, 1, 2, ... A batch from an older epoch
comes from a dead incarnation and is rejected. A newer epoch means the engine restarted, so
whatever the index holds for it is stale. A gap or a repeated `seq` means events were lost or
replayed, so the index can no longer trust its copy: it drops the engine's entries and asks
for a snapshot, and applies nothing more from that engine until the snapshot arrives.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Action(enum.Enum):
    APPLY = "apply"  # apply the batch's events (after clearing, if `Decision.clear`)
    REJECT = "reject"  # older epoch: change nothing
    RESYNC = "resync"  # drop the engine's entries and request a snapshot
    WAIT = "wait"  # a snapshot is already requested: drop the batch


@dataclass(frozen=True, slots=True)
class Fence:
    """What the index knows of one engine's event stream."""

    epoch: int
    # last applied `seq` of `epoch`; None: nothing applied yet in this epoch, or out of sync
    last_seq: int | None = None
    # entries were dropped and a snapshot requested; non-snapshot batches are dropped
    awaiting_snapshot: bool = False


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    clear: bool  # drop every entry of the engine before anything else
    fence: Fence  # the fence once the decision is carried out
    reason: str = ""


def parse_epoch(epoch: str) -> int:
    """The epoch as an integer; ValueError unless it is a plain decimal integer."""
    if not epoch.isascii() or not epoch.isdigit():
        raise ValueError(f"epoch must be a decimal integer string, got {epoch!r}")
    return int(epoch)


def epoch_order(fence: Fence | None, epoch: int) -> int:
    """-1: `epoch` is older than the fence's, 0: the same, 1: newer (or the engine is new)."""
    if fence is None or epoch > fence.epoch:
        return 1
    return 0 if epoch == fence.epoch else -1


def decide_batch(fence: Fence | None, epoch: int, seq: int, snapshot: bool) -> Decision:
    """What to do with a batch `(epoch, seq, snapshot)` from an engine whose fence is `fence`.

    `fence` is None for an engine the index has no record of; it is treated as a new epoch
    (its entries, if any are left over, are cleared).
    """
    order = epoch_order(fence, epoch)
    if order < 0:
        assert fence is not None
        return Decision(Action.REJECT, False, fence, f"epoch {epoch} is older than {fence.epoch}")
    if order > 0:
        if snapshot or seq == 0:
            return Decision(Action.APPLY, True, Fence(epoch, seq), "new epoch")
        return Decision(
            Action.RESYNC, True, Fence(epoch, None, True), f"new epoch starts at seq {seq}"
        )
    assert fence is not None
    if snapshot:
        return Decision(Action.APPLY, True, Fence(epoch, seq), "snapshot")
    if fence.awaiting_snapshot:
        return Decision(Action.WAIT, False, fence, "awaiting a snapshot")
    expected = 0 if fence.last_seq is None else fence.last_seq + 1
    if seq == expected:
        return Decision(Action.APPLY, False, Fence(epoch, seq))
    kind = "gap" if seq > expected else "repeated seq"
    return Decision(
        Action.RESYNC, True, Fence(epoch, None, True), f"{kind}: expected {expected}, got {seq}"
    )
