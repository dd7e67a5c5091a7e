"""The prefix cache of one rank: radix tree + pool group + (optionally) the host tier.

`PrefixCache` is the scheduler's only door to cached KV. It owns the tree, the engine's KV
pools (a `PoolGroup`: the device pages it hands out are the group's), the host tier
(`host_tier.py`: host pages and the transfer engine) and the ordered ACK queues
(`acks.py`); requests hold tree nodes only through `lock`. All of it is driven from the
scheduler thread; the transfer engine's workers only complete copies, and their effects
land here when ACKs are consumed, in submission order.

Write policies (SGLang's names): `write_through` backs up every inserted node at once,
`write_through_selective` backs up a node once it has been matched `write_through_threshold`
times, `write_back` backs up only what device eviction is about to drop.

With external storage (`hicache_storage_backend`), a `StorageTier` prefetches requests'
prefixes from the store into host pages and writes host pages to it
(`gpu_worker/cache/storage_tier.py`); its ACKs are consumed with the transfer ACKs, by
agreed counts per queue (`ready_counts` / `consume_counts`).

Its configuration (`CacheConfig`, `config.py`) is imported from here by its users.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bus_schemas.token_ids import TokenIds
from gpu_worker.cache.acks import AckQueues
from gpu_worker.cache.config import LOAD_POLICIES, WRITE_POLICIES, CacheConfig, WritePolicy
from gpu_worker.cache.host_tier import HostTier, LoadTicket
from gpu_worker.cache.load_cost import LoadCostEstimate, LoadCostModel
from gpu_worker.cache.radix import KVEventRecord, MatchResult, PageIds, RadixTree, TreeNode
from gpu_worker.cache.stats import CacheStats
from gpu_worker.cache.storage_codec import StorageLayout
from gpu_worker.cache.storage_io import StorageIO
from gpu_worker.cache.storage_tier import StorageTier
from gpu_worker.cache.transfer import TransferEngine
from gpu_worker.consensus.checker import rank_consensus
from gpu_worker.memory.allocator import PageId
from gpu_worker.memory.host_pool import HOST_LAYOUTS, HostKVPool
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.memory.pool_group import PoolGroup
from gpu_worker.storage import StorageBackend

# the cache's config lives in `config.py`; its users import it from here, with the cache
__all__ = [
    "HOST_LAYOUTS",
    "LOAD_POLICIES",
    "WRITE_POLICIES",
    "CacheConfig",
    "CachedPrefix",
    "PrefixCache",
    "WritePolicy",
]


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """What `PrefixCache.insert` made of a request's prefix: the tree now holds it."""

    page_ids: PageIds  # the tree's device pages of the whole aligned prefix, in order
    last_node: TreeNode  # ends the prefix: the caller locks it, unlocks its previous node


class PrefixCache:
    """One rank's cache, the scheduler's door to it (see the module docstring): the tree,
    the device pages, and the write policies; the host tier's copies are `host`'s, the ACK
    agreement's queues `acks`'."""

    def __init__(
        self,
        config: CacheConfig,
        spec: KVSpec,
        device: torch.device,
        namespace: str | None = None,
        num_host_pages: int | None = None,
        delay_seed: int = 0,
        record_events: bool = True,
        storage: StorageBackend | None = None,
        storage_layout: StorageLayout | None = None,
        storage_groups: tuple[Any, Any, Any] = (None, None, None),
        rank: int = 0,
        pools: PoolGroup | None = None,
        cp_size: int = 1,
    ) -> None:
        """With a `namespace`, the tree hashes its pages (and, with `record_events`, records
        KV events).

        `num_host_pages` overrides the size the config gives (a multi-rank engine agrees on
        one size for all ranks, whose bytes per page differ); `delay_seed` is added to the
        injected transfer delays' seed, so each rank sees its own readiness. `storage` adds the
        L3 tier: `storage_layout` says which objects hold this rank's part of a page (the
        unified scheme lays the host pool out `page_unified`), and the `storage_groups`
        (hit, progress, write) agree over the world (None in a world of one). `pools`: the
        engine's KV pools (default: the target pool of `spec` alone), without host pools:
        the cache makes those when it has a host tier. `cp_size`: the CP ranks device pages
        go round-robin over (the pools' owner classes; `alloc`)."""
        self.config = config
        self.spec = spec
        if pools is None:
            pools = PoolGroup.target_only(
                spec, config.num_device_pages, device, config.check_reads, cp_size
            )
        if pools.spec != spec:
            raise ValueError(f"the pool group's target holds {pools.spec}, not {spec}")
        if pools.device.allocator.num_owners != cp_size:
            raise ValueError(f"the pool group's device pages are not in {cp_size} owner classes")
        self.pools = pools
        self.device_pool = self.pools.device
        self.tree = RadixTree(config.page_size, namespace, record_events, cp_size)
        self.hierarchical = config.enable_hierarchical_cache and config.enable_radix_cache
        self.stats = CacheStats()
        self.cost = LoadCostModel()  # rank 0's measurements
        self.cost_estimate = LoadCostEstimate()  # what every rank decides from (SetLoadCost)
        self.host_pool: HostKVPool | None = None
        self.transfers: TransferEngine | None = None
        self.host: HostTier | None = None
        self.storage: StorageTier | None = None
        if self.hierarchical:
            self.host = _host_tier(self, num_host_pages, delay_seed, storage_layout, storage)
            self.host_pool, self.transfers = self.host.pool, self.host.transfers
        if storage is not None:
            if self.host is None or namespace is None or storage_layout is None:
                raise ValueError("external storage needs the host tier, a namespace, a layout")
            self.storage = _storage_tier(
                config, self.host, self.tree, storage, storage_layout, storage_groups, rank
            )
            self.host.after_backup = self.storage.writes.after_backup
        self.acks = AckQueues(self.host, self.storage)

    @property
    def page_size(self) -> int:
        return self.config.page_size

    @property
    def num_free_device_pages(self) -> int:
        return self.device_pool.allocator.num_free

    @property
    def num_available_device_pages(self) -> int:
        """Free pages plus pages that eviction could free (unlocked tree pages)."""
        return self.num_free_device_pages + self.tree.num_evictable_device_pages

    @property
    def num_queued_acks(self) -> int:
        """Host<->device copies in flight."""
        return 0 if self.host is None else self.host.num_queued_acks

    # ----------------------------------------------------------------- match / lock

    def no_match(self) -> MatchResult:
        return MatchResult(0, 0, array("q"), array("q"), self.tree.root, self.tree.root)

    @rank_consensus(
        same_params=["len(ids)", "salt"],
        same_results=[
            "result.device_len",
            "result.host_len",
            "list(result.device_page_ids)",
            "list(result.host_page_ids)",
        ],
    )
    def match(self, ids: TokenIds | Sequence[int], salt: str = "") -> MatchResult:
        """The cached prefix of `ids` (nothing when the radix cache is off).

        `ids` is a request's `prompt_ids` (TokenIds): it reaches the tree without conversion.

        The last page-aligned token is never matched in full: a request must compute at least
        one token to get logits, so a full-prompt hit is cut back by one page.
        """
        if not self.config.enable_radix_cache:
            return self.no_match()
        limit = len(ids) - 1
        result = self.tree.match_prefix(ids[:limit], salt)
        if self.config.hicache_write_policy == "write_through_selective" and self.host:
            node = result.last_device_node
            if node.parent is not None and node.hit_count >= self.config.write_through_threshold:
                self.host.backup(node)
        if self.storage is not None and result.last_node.parent is not None:
            self.storage.writes.after_match(result.last_node)
        return result

    def lock(self, node: TreeNode) -> None:
        self.tree.tiers.lock(node)

    def unlock(self, node: TreeNode) -> None:
        self.tree.tiers.unlock(node)

    # ----------------------------------------------------------------- device pages

    def can_alloc(self, num_pages: int, start_page: int = 0) -> bool:
        """Whether `alloc(num_pages, start_page)` can succeed: enough free pages plus pages
        eviction could free (unlocked tree pages) in every owner class the run takes from.
        With several classes this walks the tree's nodes."""
        allocator = self.device_pool.allocator
        k = allocator.num_owners
        if k == 1:
            return num_pages <= self.num_available_device_pages
        available = [allocator.num_free_of(o) for o in range(k)]
        for node in self.tree.iter_nodes():
            if node.lock_ref == 0 and node.device_page_ids is not None:
                for q in node.device_page_ids:
                    available[q % k] += 1
        need = allocator.run_counts(num_pages, start_page % k)
        return all(n <= a for n, a in zip(need, available, strict=True))

    @rank_consensus(same_params=["num_pages", "start_page"], same_results=["result"])
    def alloc(self, num_pages: int, start_page: int = 0) -> list[PageId] | None:
        """Take `num_pages` device pages for a request's path pages `start_page, ...`,
        evicting unlocked cache if needed; None (nothing taken) if impossible.

        Page j is of owner class `(start_page + j) % cp_size`: a request's new pages continue
        its prefix's owner cycle (a path from a root starts at rotation 0), which the tree
        requires of every insert. With one class the pages are the lowest free ids.
        """
        allocator = self.device_pool.allocator
        first = start_page % allocator.num_owners
        short = allocator.shortfall(num_pages, first)
        while short > 0:
            free = allocator.num_free
            self.evict_device(short)
            # eviction frees LRU pages of any class: go on while it frees and a class is short
            if allocator.num_owners == 1 or allocator.num_free == free:
                break
            short = allocator.shortfall(num_pages, first)
        pages = allocator.alloc_run(num_pages, first)
        return None if pages is None else [PageId(p) for p in pages]

    def free(self, page_ids: list[PageId]) -> None:
        self.device_pool.allocator.free(list(page_ids))

    def evict_device(self, num_pages: int) -> None:
        """Free `num_pages` device pages from unlocked cache (write_back backs them up first)."""
        host = self.host
        write_back = host is not None and self.config.hicache_write_policy == "write_back"
        freed = 0
        while freed < num_pages:
            result = self.tree.tiers.evict_device(num_pages - freed, delete_unbacked=not write_back)
            self.free([PageId(p) for p in result.freed_page_ids])
            freed += len(result.freed_page_ids)
            self.stats.evicted_device_pages += len(result.freed_page_ids)
            if freed >= num_pages or not result.unbacked:
                break
            # write_back: back up the leaves about to go, wait for them, then evict again.
            assert host is not None
            if not any([host.backup(node) for node in result.unbacked]):
                break
            host.consume(host.num_queued_acks)

    # ----------------------------------------------------------------- insert / load

    @rank_consensus(
        same_params=["len(ids)", "list(page_ids)", "cached_len", "salt"],
        same_results=["list(result.page_ids)", "result.last_node.id"],
    )
    def insert(
        self,
        ids: TokenIds | Sequence[int],
        page_ids: Sequence[PageId],
        cached_len: int,
        salt: str = "",
    ) -> CachedPrefix:
        """Put the page-aligned prefix of `ids` (KV in `page_ids`) into the tree.

        `cached_len` tokens at the front are pages the request got from the tree. The request's
        own pages that duplicate tree pages are freed here; the returned pages (the tree's, for
        the whole aligned prefix) replace the request's, and the returned node ends that prefix:
        the caller locks it and unlocks its previous node.
        """
        ps = self.page_size
        aligned = len(ids) - len(ids) % ps
        result = self.tree.insert(ids[:aligned], page_ids[: aligned // ps], salt)
        self.free(list(page_ids[cached_len // ps : result.dup_len // ps]))
        if self.host is not None and self.config.hicache_write_policy == "write_through":
            self.host.backup(result.last_node)
        return CachedPrefix(result.last_node.path_device_page_ids(), result.last_node)

    @rank_consensus(
        same_params=["match.host_len", "list(match.host_page_ids)"],
        same_results=["None if result is None else list(result.page_ids)"],
    )
    def start_load(self, match: MatchResult) -> LoadTicket | None:
        """Start loading a match's host part back to device pages; None if there is no room.

        The caller has locked `match.last_device_node`. The host range stays pinned until the
        ACK is consumed; the ticket's pages join the tree only then.
        """
        if match.host_len == 0 or self.host is None:
            return None
        if self.config.hicache_load_policy == "cost" and not self.cost_estimate.worth_loading(
            match.host_len
        ):
            self.stats.loads_skipped += 1
            return None
        self.tree.tiers.ref_host(match.last_node)
        pages = self.alloc(len(match.host_page_ids), match.device_len // self.page_size)
        if pages is None:
            self.tree.tiers.unref_host(match.last_node)
            return None
        return self.host.load(match, pages)

    # ----------------------------------------------------------------- whole-cache

    def drain(self) -> None:
        """Wait for and apply every queued ACK (`AckQueues.drain`)."""
        self.acks.drain()

    def flush(self) -> None:
        """Drop every cached page (device and host). Only valid with no request running."""
        self.drain()
        dropped = self.tree.reset()
        self.free(dropped.device_page_ids)
        if self.host_pool is not None:
            self.host_pool.allocator.free(list(dropped.host_page_ids))
        self.stats.reset()

    def drain_events(self) -> list[KVEventRecord]:
        events = self.tree.drain_events()
        if self.storage is not None:
            events += self.storage.writes.drain_events()
        return events

    def check_integrity(self, request_page_ids: set[int] | None = None) -> None:
        """Tree invariants, plus: every device page is free, in the tree, or held by a request."""
        self.tree.check_integrity()
        free = self.device_pool.allocator.free_set()
        in_tree = self.tree.device_page_set()
        held = request_page_ids or set()
        assert free.isdisjoint(in_tree), "a free device page is in the tree"
        assert free.isdisjoint(held), "a free device page is held by a request"
        if request_page_ids is not None and not self.num_queued_acks:
            total = len(free) + len(in_tree | held)
            assert total == self.device_pool.num_pages, f"device pages leaked: {total}"
        if self.host_pool is not None:
            host_free = self.host_pool.allocator.free_set()
            assert host_free.isdisjoint(self.tree.host_page_set()), (
                "a free host page is in the tree"
            )

    def close(self) -> None:
        if self.transfers is not None:
            self.transfers.close()
        if self.storage is not None:
            self.storage.io.close()


def _host_tier(
    cache: PrefixCache,
    num_host_pages: int | None,
    delay_seed: int,
    layout: StorageLayout | None,
    storage: StorageBackend | None,
) -> HostTier:
    """The host tier of `cache`: its pool group gains the host pools (laid out
    `page_unified` for the unified storage scheme), copies run on a transfer engine."""
    config = cache.config
    unified = storage is not None and layout is not None and layout.unified
    cache.pools.attach_host(
        num_host_pages or config.num_host_pages(cache.spec),
        "page_unified" if unified else config.hicache_mem_layout,
        layout.group_heads if layout is not None and unified else None,
    )
    delay = config.transfer_delay
    if delay is not None and delay_seed:
        delay = dataclasses.replace(delay, seed=delay.seed + delay_seed)
    transfers = TransferEngine(cache.device_pool.device, config.transfer_workers, delay)
    return HostTier(
        cache.pools,
        cache.tree,
        transfers,
        cache.stats,
        cache.cost,
        lambda: cache.cost_estimate,
        config.debug_fail_loads,
    )


def _storage_tier(
    config: CacheConfig,
    host: HostTier,
    tree: RadixTree,
    backend: StorageBackend,
    layout: StorageLayout,
    groups: tuple[Any, Any, Any],
    rank: int,
) -> StorageTier:
    """The L3 tier over `host`'s pages: objects named and laid out as `layout` says, counts
    agreed over the `groups` (hit, progress, write)."""
    io = StorageIO(backend, layout.codec(host.pool), rank, *groups, config.storage_faults)
    return StorageTier(
        host,
        tree,
        io,
        layout.scope,
        config.hicache_storage_prefetch_policy,
        config.prefetch_timeout,
        config.hicache_storage_write_policy,
        config.hicache_storage_write_threshold,
        config.storage_batch_pages,
        host.pool.num_pages,
        read_by_cost=config.hicache_load_policy == "cost",
    )
