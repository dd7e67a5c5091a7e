"""The prefix cache's configuration: one frozen dataclass, flags named like SGLang's.

`CacheConfig` sizes the device and host tiers and picks their policies (write, load,
prefetch, storage); `PrefixCache` (`hicache.py`) and the tiers it owns read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gpu_worker.cache.storage_io import StorageFaults
from gpu_worker.cache.storage_tier import PREFETCH_POLICIES, PrefetchPolicy, PrefetchTimeout
from gpu_worker.cache.storage_writes import STORAGE_WRITE_POLICIES, StorageWritePolicy
from gpu_worker.cache.transfer import DelayInjection
from gpu_worker.memory.host_pool import HOST_LAYOUTS, HostLayout
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.storage.layout import KEY_SCHEMES, KeyScheme

WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
LoadPolicy = Literal["always", "cost"]
LOAD_POLICIES: tuple[LoadPolicy, ...] = ("always", "cost")
WRITE_POLICIES: tuple[WritePolicy, ...] = ("write_through", "write_through_selective", "write_back")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Cache sizing and policy of one engine; flags named like SGLang's."""

    page_size: int = 16
    num_device_pages: int = 1024
    enable_radix_cache: bool = True  # --disable-radix-cache turns reuse off (the oracle's cold run)
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0  # host pages = ratio x device pages
    hicache_size_gb: float = 0.0  # when > 0, host pool size in GB (overrides the ratio)
    hicache_write_policy: WritePolicy = "write_through"
    hicache_mem_layout: HostLayout = "layer_first"
    write_through_threshold: int = 2
    transfer_workers: int = 1
    transfer_delay: DelayInjection | None = None  # test hook
    check_reads: bool = False  # fail any read of a page whose load is not consumed
    debug_fail_loads: int = 0  # test hook: the next N host->device loads fail
    hicache_load_policy: LoadPolicy = "always"  # "cost": load a host hit only if cheaper
    # external storage (L3): a backend name ("file") turns it on (needs the host tier)
    hicache_storage_backend: str | None = None
    hicache_storage_dir: str = ""  # "" -> the per-user default (gpu_worker.storage)
    # None: the default cap (`gpu_worker.storage.default_capacity_bytes`); 0: no cap
    hicache_storage_size_gb: float | None = None
    hicache_storage_key_file: str = ""  # the objects' MAC key; "": DIR/.key, made if missing
    hicache_storage_prefetch_policy: PrefetchPolicy = "timeout"
    prefetch_timeout: PrefetchTimeout = field(default_factory=PrefetchTimeout)
    hicache_storage_write_policy: StorageWritePolicy = "write_through"
    hicache_storage_write_threshold: int = 2  # matches before write_through_selective writes
    storage_batch_pages: int = 16  # pages per read batch (one progress ACK each)
    # which objects hold a page (gpu_worker/storage/layout.py): "rank-suffix", or "unified"
    # on a grid of layer ranges x KV-head groups shared by every TP/PP layout of the model
    # (it lays the host pool out page_unified, whatever hicache_mem_layout says)
    hicache_storage_key_scheme: KeyScheme = "rank-suffix"
    storage_layer_partition: int = 0  # layers per object; 0: all of the model's layers
    storage_head_partition: int = 1  # KV heads per object
    storage_faults: StorageFaults | None = None  # test hook: slow and failing reads

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.num_device_pages <= 0:
            raise ValueError("page_size and num_device_pages must be positive")
        if self.hicache_write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"unknown --hicache-write-policy {self.hicache_write_policy!r}; "
                f"choose one of {WRITE_POLICIES}"
            )
        if self.hicache_mem_layout not in HOST_LAYOUTS:
            raise ValueError(
                f"unknown --hicache-mem-layout {self.hicache_mem_layout!r}; "
                f"choose one of {HOST_LAYOUTS}"
            )
        if self.hicache_ratio <= 0 or self.hicache_size_gb < 0:
            raise ValueError("--hicache-ratio must be > 0 and --hicache-size >= 0")
        if self.hicache_load_policy not in LOAD_POLICIES:
            raise ValueError(
                f"unknown --hicache-load-policy {self.hicache_load_policy!r}; "
                f"choose one of {LOAD_POLICIES}"
            )
        if self.write_through_threshold < 1:
            raise ValueError("write_through_threshold must be >= 1")
        if self.hicache_storage_prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(
                f"unknown --hicache-storage-prefetch-policy "
                f"{self.hicache_storage_prefetch_policy!r}; choose one of {PREFETCH_POLICIES}"
            )
        if self.hicache_storage_write_policy not in STORAGE_WRITE_POLICIES:
            raise ValueError(
                f"unknown --hicache-storage-write-policy {self.hicache_storage_write_policy!r}; "
                f"choose one of {STORAGE_WRITE_POLICIES}"
            )
        size = self.hicache_storage_size_gb
        if (size is not None and not size >= 0) or self.storage_batch_pages < 1:
            raise ValueError("--hicache-storage-size must be >= 0 and batch pages >= 1")
        if self.hicache_storage_key_scheme not in KEY_SCHEMES:
            raise ValueError(
                f"unknown --hicache-storage-key-scheme {self.hicache_storage_key_scheme!r}; "
                f"choose one of {KEY_SCHEMES}"
            )
        if self.storage_layer_partition < 0 or self.storage_head_partition < 1:
            raise ValueError(
                "--hicache-storage-layer-partition must be >= 0 (0: all layers) and "
                "--hicache-storage-head-partition >= 1"
            )
        if self.hicache_storage_backend is not None and not self.enable_hierarchical_cache:
            raise ValueError(
                "--hicache-storage-backend needs the host tier: add --enable-hierarchical-cache"
            )

    def num_host_pages(self, spec: KVSpec, num_shards: int = 1) -> int:
        """Logical pages: --hicache-size is per rank, of which `num_shards` CP ranks each
        hold 1/num_shards (sharded pools); the ratio is of the logical device pages."""
        if self.hicache_size_gb > 0:
            return max(1, int(self.hicache_size_gb * 1e9) // spec.bytes_per_page) * num_shards
        return max(1, int(self.num_device_pages * self.hicache_ratio))
