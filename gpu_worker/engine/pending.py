"""Rank 0's commands for the next step: what the engine's API queued, and rank 0's own
verdicts that every rank must take at the same logical point (load-cost figures, storage
prefetch timeouts), read off rank 0's clock alone."""

from __future__ import annotations

import time

from gpu_worker.cache.hicache import CacheConfig, PrefixCache
from gpu_worker.cache.load_cost import LoadCostEstimate
from gpu_worker.engine.commands import AddRequest, Command, SetLoadCost, StopPrefetch
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.scheduler.request import Req


class PendingCommands:
    """Rank 0 only: the list the next step hands to every rank."""

    def __init__(self, cache: PrefixCache, config: CacheConfig, kv_spec: KVSpec) -> None:
        self._cache = cache
        self._config = config
        self._kv_spec = kv_spec
        self._commands: list[Command] = []
        self._sent_estimate = LoadCostEstimate()
        self.taken_at = time.monotonic()  # when a step last took the list

    def __bool__(self) -> bool:
        """Commands not yet handed to the ranks."""
        return bool(self._commands)

    def put(self, cmd: Command) -> None:
        self._commands.append(cmd)

    def withdraw_request(self, rid: int) -> Req | None:
        """Take back request `rid` if no step has handed it out yet (no other rank has it)."""
        for cmd in self._commands:
            if isinstance(cmd, AddRequest) and cmd.req.rid == rid:
                self._commands.remove(cmd)
                return cmd.req
        return None

    def take(self) -> list[Command]:
        """The list for this step, with rank 0's verdicts added; leaves it empty."""
        self._offer_load_cost()
        self._offer_prefetch_verdicts()
        commands, self._commands = self._commands, []
        self.taken_at = time.monotonic()
        return commands

    def _offer_load_cost(self) -> None:
        """Send the load-cost figures when they moved (every rank decides by them)."""
        cache = self._cache
        if self._config.hicache_load_policy != "cost":
            return
        spec, storage = self._kv_spec, cache.storage
        estimate = cache.cost.estimate(
            spec.bytes_per_page / spec.page_size,
            None if storage is None else storage.io.seconds_per_page(),
            spec.page_size,
        )
        if estimate.differs_from(self._sent_estimate):
            self._sent_estimate = estimate
            self._commands.append(
                SetLoadCost(
                    estimate.load_s_per_token,
                    estimate.recompute_s_per_token,
                    estimate.storage_s_per_token,
                )
            )

    def _offer_prefetch_verdicts(self) -> None:
        """Storage prefetches past their deadline (`timeout` policy) stop, on every rank at
        once; only rank 0's clock decides."""
        storage = self._cache.storage
        if storage is not None:
            self._commands += [StopPrefetch(rid) for rid in storage.timed_out(time.monotonic())]
