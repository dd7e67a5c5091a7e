"""The KV-event records of the radix tree: what it stored and removed, per tier.

A record is a `KVEventRecord`: stored or removed, on which tier, which page hashes, and under
CP page sharding which CP rank holds each page (the node's `owner_rotation`: page `i` of the
record on rank `(owner_rotation + i) % cp_size`; records stay per logical page, as the
index scores logical prefixes). The tree calls
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
    owner_rotation: int = 0  # sharded CP: the CP rank that holds the first page
    cp_size: int = 1  # the CP ranks pages are sharded over (1: every rank holds every page)


class HashedNode(Protocol):
    """What a record is made from: a node's page hashes and the tiers it is on."""

    @property
    def page_hashes(self) -> list[bytes] | None: ...

    @property
    def device_page_ids(self) -> array[Any] | None: ...

    @property
    def host_page_ids(self) -> array[Any] | None: ...

    @property
    def owner_rotation(self) -> int: ...  # the CP rank that owns its first page


class KVEventLog:
    """The records of one tree since the last `drain`, in order. With `enabled` False
    (no namespace, or a rank that does not publish), `record` keeps nothing. `cp_size`: the
    CP ranks the tree's pages are sharded over (its records then carry node rotations)."""

    __slots__ = ("cp_size", "enabled", "events")

    def __init__(self, enabled: bool, cp_size: int = 1) -> None:
        self.enabled = enabled
        self.cp_size = cp_size
        self.events: list[KVEventRecord] = []

    def record(self, kind: str, tier: str, node: HashedNode) -> None:
        if self.enabled:
            self.events.append(_record(kind, tier, node, self.cp_size))

    def drain(self) -> list[KVEventRecord]:
        """The records since the last drain, in order."""
        events, self.events = self.events, []
        return events


def snapshot(nodes: Iterable[HashedNode], cp_size: int = 1) -> list[KVEventRecord]:
    """`stored` records for every tier each of `nodes` is on (device first, then host)."""
    out: list[KVEventRecord] = []
    for n in nodes:
        if n.device_page_ids is not None:
            out.append(_record("stored", "device", n, cp_size))
        if n.host_page_ids is not None:
            out.append(_record("stored", "host", n, cp_size))
    return out


def _record(kind: str, tier: str, node: HashedNode, cp_size: int) -> KVEventRecord:
    assert node.page_hashes is not None
    hashes = [h.hex() for h in node.page_hashes]
    if cp_size == 1:  # every rank holds every page: the rotation says nothing
        return KVEventRecord(kind, tier, hashes)
    return KVEventRecord(kind, tier, hashes, node.owner_rotation, cp_size)
