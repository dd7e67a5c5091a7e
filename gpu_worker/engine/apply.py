"""Applying one step's commands on a rank: the same list, in the same order, on every rank
(results land on rank 0's own command objects)."""

from __future__ import annotations

from gpu_worker.cache.hicache import PrefixCache
from gpu_worker.cache.load_cost import LoadCostEstimate
from gpu_worker.engine.commands import (
    Abort,
    AddRequest,
    Command,
    Drain,
    EvictDevice,
    Flush,
    SetLoadCost,
    Stop,
    StopPrefetch,
    WriteKV,
)
from gpu_worker.engine.config import DebugHooks
from gpu_worker.engine.kv_import import KVImport
from gpu_worker.scheduler.request import Req
from gpu_worker.scheduler.scheduler import Scheduler


class CommandApplier:
    """Turns each command into its change of this rank's scheduler and cache."""

    def __init__(
        self,
        scheduler: Scheduler,
        cache: PrefixCache,
        kv_import: KVImport,
        rank: int,
        debug: DebugHooks,
    ) -> None:
        self._scheduler = scheduler
        self._cache = cache
        self._kv_import = kv_import
        self._rank = rank
        self._debug = debug
        self.stopped = False  # set by the Stop command

    def apply(self, cmd: Command) -> None:
        """Apply one command; the same on every rank."""
        scheduler, cache = self._scheduler, self._cache
        if isinstance(cmd, AddRequest):
            self._debug_raise(cmd.req)
            scheduler.add(cmd.req)
        elif isinstance(cmd, Abort):
            scheduler.abort(cmd.rid)
        elif isinstance(cmd, WriteKV):
            self._kv_import.write(cmd, scheduler)
        elif isinstance(cmd, Flush):
            cmd.ok = scheduler.idle
            if cmd.ok:
                cache.flush()
        elif isinstance(cmd, EvictDevice):
            cache.drain()
            cache.evict_device(min(cmd.num_pages, cache.tree.num_device_pages))
        elif isinstance(cmd, Drain):
            cache.drain()
        elif isinstance(cmd, SetLoadCost):
            cache.cost_estimate = LoadCostEstimate(
                cmd.load_s_per_token,
                cmd.recompute_s_per_token,
                storage_s_per_token=cmd.storage_s_per_token,
            )
        elif isinstance(cmd, StopPrefetch):
            scheduler.stop_prefetch(cmd.rid)
        elif isinstance(cmd, Stop):
            self.stopped = True

    def _debug_raise(self, req: Req) -> None:
        hook = self._debug.rank_raise
        if hook is not None and hook[0] == self._rank and hook[1] in req.prompt_ids:
            raise RuntimeError(f"debug: rank {self._rank} raises on prompt token {hook[1]}")
