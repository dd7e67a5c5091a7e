"""Backups of one rank's host pages to external storage (L3), and what the index is told.

A page committed to the host is written to the store by `write_through`, or once its node
was matched `hicache_storage_write_threshold` times (`write_through_selective`). Whether to
write is decided from replicated state (a node is marked `in_storage` when its write is
submitted, whatever the result), so every rank submits the same writes. The host pages stay
pinned until the WRITE ACK is consumed, which comes once they are copied out for the store
(`StorageIO`), not once the store took them: a slow store never keeps host pages from
eviction. Rank 0 advertises to the index (a "stored" storage KV event) the leading pages of a
write that every rank's store took, and no others: an event for a page one rank's shard
lacks would send requests after a hit no engine of this layout can read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gpu_worker.cache.host_pages import HostPages
from gpu_worker.cache.radix import KVEventRecord, RadixTree, TreeNode
from gpu_worker.cache.storage_io import StorageIO
from gpu_worker.consensus.checker import rank_consensus

StorageWritePolicy = Literal["write_through", "write_through_selective"]
STORAGE_WRITE_POLICIES: tuple[StorageWritePolicy, ...] = (
    "write_through",
    "write_through_selective",
)


@dataclass(frozen=True, slots=True)
class WriteOp:
    last_node: TreeNode  # pinned with ref_host until the WRITE ACK is consumed
    num_pages: int
    page_hashes: list[str]  # hex, for rank 0's storage KV events


class StorageWrites:
    """See the module docstring. Owned by the `StorageTier`, which hands it WRITE ACKs."""

    def __init__(
        self,
        host: HostPages,
        tree: RadixTree,
        io: StorageIO,
        policy: StorageWritePolicy,
        threshold: int,
    ) -> None:
        """`host`: the owning cache's host pages (read here for its counters only); `tree`:
        its radix tree, whose nodes are marked and pinned while their writes run."""
        self.host = host
        self.tree = tree
        self.io = io
        self.policy = policy
        self.threshold = threshold
        self.events: list[KVEventRecord] = []  # "stored" on "storage": rank 0 sends them

    def after_backup(self, last_node: TreeNode) -> None:
        """Pages of the path to `last_node` reached the host: write-through to the store."""
        if self.policy == "write_through":
            self.write(last_node)

    def after_match(self, node: TreeNode) -> None:
        """A match reached `node`: write_through_selective writes a hot enough path."""
        if self.policy == "write_through_selective" and node.hit_count >= max(self.threshold, 1):
            self.write(node)

    @rank_consensus(same_params=["last_node.id"], same_results=["result"])
    def write(self, last_node: TreeNode) -> int:
        """Write the host pages of the path to `last_node` not yet in the store; pages. The
        path stays pinned until the pages are staged (the WRITE ACK)."""
        tree = self.tree
        page_hashes: list[bytes] = []
        host_ids: list[int] = []
        end = last_node
        for _, n in last_node.path():
            if n.host_page_ids is None:
                break  # host coverage is prefix-closed: nothing below is on the host
            end = n
            if n.in_storage:
                continue
            assert n.page_hashes is not None
            n.in_storage = True
            page_hashes += n.page_hashes
            host_ids += n.host_page_ids
        if not page_hashes:
            return 0
        tree.tiers.ref_host(end)
        keys = self.io.codec.keys(page_hashes)
        op = WriteOp(end, len(page_hashes), [h.hex() for h in page_hashes])
        self.io.write(keys, host_ids, op)
        self.host.stats.num_storage_writes += 1
        return len(page_hashes)

    def on_ack(self, op: object, staged: int) -> None:
        """A consumed WRITE ACK: the pages are copied out, they may be evicted from now on."""
        assert isinstance(op, WriteOp)
        self.tree.tiers.unref_host(op.last_node)

    def collect_stored(self) -> None:
        """Writes whose put finished: count them, and (rank 0) advertise the leading pages
        that every rank stored, and no others. Decides nothing the ranks must share."""
        for done in self.io.pop_stored():
            op = done.op
            assert isinstance(op, WriteOp)
            self.host.stats.storage_pages_written += done.local_pages
            if done.agreed_pages and self.tree.record_events:
                hashes = op.page_hashes[: done.agreed_pages]
                self.events.append(KVEventRecord("stored", "storage", hashes))

    def drain_events(self) -> list[KVEventRecord]:
        self.collect_stored()
        events, self.events = self.events, []
        return events
