"""The KV-event records of the radix tree: what it stored and removed, per tier.

A record is a `KVEventRecord`: stored or removed, on which tier, which page hashes. The tree calls
`KVEventLog.record` at every tier change of a node, in the order the changes happen;
`drain` hands them to the KV-event stream (rank 0 publishes them) and `snapshot` lists
`stored` records for everything a tree holds, for a resync. Records exist only for a tree
with a namespace (its nodes carry chained page hashes) that records events at all.

This module knows nothing of the tree: a node is anything with the attributes of
`HashedNode`, so it imports nothing of `radix.py` (no import circle).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True, order=True)
class KVEventRecord:
    """One tier change of the pages a node (or a storage write) names. Ordered as the tuple
    of its fields, so a batch can be sorted where its order does not matter."""

    kind: str  # "stored" | "removed"
    tier: str  # "device" | "host" | "storage"
    page_hashes: list[str]  # hex, in path order


class HashedNode(Protocol):
    """What a record is made from: a node's page hashes and the tiers it is on."""

    @property
    def page_hashes(self) -> list[bytes] | None: ...

    @property
    def device_page_ids(self) -> array[Any] | None: ...

    @property
    def host_page_ids(self) -> array[Any] | None: ...


class KVEventLog:
    """The records of one tree since the last `drain`, in order. With `enabled` False
    (no namespace, or a rank that does not publish), `record` keeps nothing."""

    __slots__ = ("enabled", "events")

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.events: list[KVEventRecord] = []

    def record(self, kind: str, tier: str, node: HashedNode) -> None:
        if self.enabled:
            assert node.page_hashes is not None
            self.events.append(KVEventRecord(kind, tier, [h.hex() for h in node.page_hashes]))

    def drain(self) -> list[KVEventRecord]:
        """The records since the last drain, in order."""
        events, self.events = self.events, []
        return events


def snapshot(nodes: Iterable[HashedNode]) -> list[KVEventRecord]:
    """`stored` records for every tier each of `nodes` is on (device first, then host)."""
    out: list[KVEventRecord] = []
    for n in nodes:
        assert n.page_hashes is not None
        hashes = [h.hex() for h in n.page_hashes]
        if n.device_page_ids is not None:
            out.append(KVEventRecord("stored", "device", hashes))
        if n.host_page_ids is not None:
            out.append(KVEventRecord("stored", "host", hashes))
    return out
