"""Admission: which waiting requests start, what each reserves, and their load-back.

A request is admitted first come, first served while the page budget allows: its matched
prefix is locked, and pages for the host part to load and for every token it may still
write (`ReqLens.max_kv_len`) are reserved up front, so nothing is ever preempted. An
admitted request with a host hit waits in LOADING until the load's ACK is consumed.

With a sharded CP pool, admission also holds the running set to `--cp-gather-buffer-mb`:
the largest gather any of its steps can make, in both scratch buffers, must fit
(`scheduler/gather_budget.py`); a request waits until it does, or fails if it never can.
"""

from __future__ import annotations

from collections import deque

from gpu_worker.cache.hicache import PrefixCache
from gpu_worker.cache.radix import MatchResult
from gpu_worker.consensus.checker import rank_consensus
from gpu_worker.memory.sharded_pool import AttendedBatch, ShardedDeviceKVPool
from gpu_worker.scheduler.config import SchedulerConfig
from gpu_worker.scheduler.gather_budget import GatherBudget
from gpu_worker.scheduler.request import CachedTokens, Req, ReqState, RequestError


class Admission:
    """Moves requests from the scheduler's waiting queue into its running list, and on from
    LOADING once their load-back completed (or failed)."""

    def __init__(
        self, config: SchedulerConfig, cache: PrefixCache, perturb_rotation: bool = False
    ) -> None:
        """`perturb_rotation`: test hook (`DebugHooks.perturb_owner_rotation_rank`): this
        rank starts every request's new pages one owner class later than its prefix's
        cycle asks, so it disagrees with the other CP ranks on every page's owner."""
        self.config = config
        self.cache = cache
        self.perturb_rotation = perturb_rotation
        self.gather = _gather_budget(config, cache)

    def admit(self, waiting: deque[Req], running: list[Req]) -> list[Req]:
        """First come, first served while pages (and a sharded pool's gather scratch) allow;
        a request whose storage prefetch may not end yet (its policy) waits without holding
        back those behind it. Returns the requests that failed because they never fit."""
        storage = self.cache.storage
        failed: list[Req] = []
        for req in list(waiting):
            if len(running) >= self.config.max_running_requests:
                break
            p = req.prefetch
            if p is not None and storage is not None and not p.finished:
                if not storage.ready(p):
                    continue
                storage.finish(p)
            if self.gather is not None and self._never_fits(req):
                waiting.remove(req)
                failed.append(req)
                continue
            if not self._admit_next(req, waiting, running):
                break
        return failed

    def _never_fits(self, req: Req) -> bool:
        """Fail `req` (400) if its gather scratch alone exceeds the budget."""
        assert self.gather is not None
        num_pages = -(-req.lens.max_kv_len // self.cache.page_size)
        if self.gather.alone(num_pages) <= self.gather.max_scratch_pages:
            return False
        req.error = RequestError(self.gather.too_big(num_pages), 400)
        req.state, req.finish_reason = ReqState.FINISHED, "error"
        if req.prefetch is not None and self.cache.storage is not None:
            self.cache.storage.cancel(req.prefetch)
        return True

    @rank_consensus(
        same_params=["req.rid", "req.prompt_len"],
        same_results=["result", "req.cached", "list(req.page_ids)"],
    )
    def _admit_next(self, req: Req, waiting: deque[Req], running: list[Req]) -> bool:
        """Admit waiting request `req` if the page budget allows; whether it did."""
        cache, ps = self.cache, self.cache.page_size
        match = (
            cache.no_match()
            if req.remote is not None and not req.remote.reuse
            else cache.match(req.prompt_ids, req.cache_salt)
        )
        cache.lock(match.last_device_node)
        load_pages = len(match.host_page_ids)
        own_pages = -(-req.lens.max_kv_len // ps) - match.total_len // ps
        start_page = self._owner_rotation(req, match.device_len // ps)
        # the host part's pages and the request's own follow the device part on its path
        if not cache.can_alloc(load_pages + own_pages, start_page):
            cache.unlock(match.last_device_node)
            # nothing running and no copy in flight (a backup's ACK unlocks its pages, a
            # failed load's frees them): nothing will ever free more (the engine checks
            # sizes). The queued count is the same on every rank: ACKs queue at submission.
            if not running and not cache.num_queued_acks:
                raise RuntimeError(f"request {req.rid} does not fit the device pool")
            return False
        if not self._gather_fits(req, match, load_pages + own_pages, running):
            # running requests hold the gathers: it fits once they finish (alone its bound
            # is `GatherBudget.alone`, which `_never_fits` checked)
            cache.unlock(match.last_device_node)
            return False
        waiting.remove(req)
        ticket = cache.start_load(match)
        if ticket is None and match.host_len:  # no room to load: compute it instead
            own_pages += load_pages
        pages = cache.alloc(own_pages, start_page + (load_pages if ticket else 0))
        assert pages is not None, "the budget check guaranteed these pages"
        req.last_node = match.last_device_node
        req.lens.cached_len = match.device_len
        host_len = match.host_len if ticket is not None else 0
        req.lens.computed_len = match.device_len + host_len
        storage_len = self._storage_len(req, match.device_len, match.device_len + host_len)
        req.cached = CachedTokens(match.device_len, host_len - storage_len, storage_len)
        req.page_ids = list(match.device_page_ids) + (ticket.page_ids if ticket else []) + pages
        req.load = ticket
        idle = ReqState.RECEIVING if req.remote is not None else ReqState.PREFILL
        req.state = ReqState.LOADING if ticket else idle
        if req.remote is not None:
            req.remote.prefix_len = req.remote.received_end = req.lens.computed_len
        cache.stats.device_hit_tokens += match.device_len
        cache.stats.host_hit_tokens += host_len - storage_len
        cache.stats.storage_hit_tokens += storage_len
        if req.prefetch is not None and cache.storage is not None:
            cache.storage.release(req.prefetch)  # its load (if any) pins what it reads now
        running.append(req)
        return True

    @rank_consensus(same_params=["req.rid", "prefix_pages"], same_results=["result"])
    def _owner_rotation(self, req: Req, prefix_pages: int) -> int:
        """The path position whose owner class `req`'s first new page takes (`alloc`'s
        `start_page`): the one after its device prefix, so its pages continue the prefix's
        owner cycle. A consensus record of its own: the ownership decision every CP rank
        must take alike (the perturbation hook makes one rank take another)."""
        return prefix_pages + int(self.perturb_rotation)

    @rank_consensus(same_params=["req.rid", "num_new_pages"], same_results=["result"])
    def _gather_fits(
        self, req: Req, match: MatchResult, num_new_pages: int, running: list[Req]
    ) -> bool:
        """Whether the running requests' gathers with `req`'s pages added stay within the
        scratch budget (always, without a sharded pool)."""
        if self.gather is None:
            return True
        need = self.gather.with_request(
            (r.page_ids for r in running), len(running), match.device_page_ids, num_new_pages
        )
        return need <= self.gather.max_scratch_pages

    def check_gather(self, batch: AttendedBatch) -> None:
        """Raise if a step's gather plan is over what admission allowed: the bound of
        `gather_budget.py` must hold for every step of an admitted set (a failure here is a
        bug in it, not a request's fault). Free: the pool builds the plan once per batch,
        and the forward reuses it."""
        pool = self.cache.device_pool
        if self.gather is None or not isinstance(pool, ShardedDeviceKVPool):
            return
        pages = pool.plan(batch).num_scratch_pages
        if pages > self.gather.max_scratch_pages:
            raise RuntimeError(
                f"a step's gather plan takes {pages} scratch pages, over the "
                f"{self.gather.max_scratch_pages} its admission allowed"
            )

    @staticmethod
    def _storage_len(req: Req, lo: int, hi: int) -> int:
        """Tokens of the loaded range [lo, hi) that this request's prefetch brought in."""
        if req.prefetch is None:
            return 0
        a, b = req.prefetch.storage_range
        return max(0, min(b, hi) - max(a, lo))

    def finish_loads(self, running: list[Req]) -> None:
        """Requests whose load-back completed take the loaded pages as their cached prefix
        and move on (to prefill, or for P/D decode to receiving)."""
        for req in running:
            if req.state is ReqState.LOADING and req.load is not None and req.load.failed:
                self._load_failed(req)
            elif req.state is ReqState.LOADING and req.load is not None and req.load.done:
                ticket, old = req.load, req.last_node
                assert old is not None
                self.cache.lock(ticket.last_node)
                self.cache.unlock(old)
                req.last_node, req.load = ticket.last_node, None
                prefix = ticket.last_node.path_device_page_ids()
                req.page_ids[: len(prefix)] = prefix
                req.lens.cached_len = len(prefix) * self.cache.page_size
                req.state = ReqState.RECEIVING if req.remote else ReqState.PREFILL

    def _load_failed(self, req: Req) -> None:
        """The host hit could not be loaded. A local request computes that range instead (its
        pages are already reserved); a P/D decode request promised it to prefill, so it fails
        with 409 and the router retries without reuse."""
        req.load = None
        req.lens.computed_len = req.lens.cached_len
        req.cached = CachedTokens(device=req.lens.cached_len, host=0)
        if req.remote is not None:
            req.error = RequestError("restore could not deliver the promised prefix", 409)
            req.aborted = True
            req.state = ReqState.RECEIVING
        else:
            req.state = ReqState.PREFILL


def _gather_budget(config: SchedulerConfig, cache: PrefixCache) -> GatherBudget | None:
    """The gather scratch budget of a sharded CP pool that all-gathers; None for any other
    pool (transport shm reads the owners' rows and has no scratch buffer)."""
    pool = cache.device_pool
    if not isinstance(pool, ShardedDeviceKVPool) or pool.cp_size == 1 or pool.transport == "shm":
        return None
    budget_bytes = int(config.cp_gather_buffer_mb * 2**20)
    return GatherBudget(
        pool.scratch_pages_within(budget_bytes),
        pool.cp_size,
        cache.page_size,
        config.chunked_prefill_size,
        config.cp_gather_buffer_mb,
    )
