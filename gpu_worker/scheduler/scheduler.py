"""The synchronous scheduler loop of one rank: admit, load, prefill in chunks, decode.

One step (driven by `Engine.step`):
1. `consume_acks(n)`: apply the first `n` transfer ACKs, in order; `n` is agreed by every
   rank (`gpu_worker/parallel/sync.py`), never read from this rank's own queue alone;
2. the engine applies the step's commands (new requests, aborts, ...);
3. `step()`: move requests whose load-back completed on to prefill; admit waiting requests
   first-come-first-served while the page budget allows (the matched prefix is locked,
   pages for the host part to load and for every token the request may still write are
   reserved up front, so nothing is ever preempted);
4. run one forward over a ragged batch (every decoding request plus prefill chunks up to
   `chunked_prefill_size` tokens) through the `StepExecutor` (the engine's `ModelExecutor`,
   seen through `gpu_worker/scheduler/executor.py`), which returns the sampled tokens on
   every rank;
5. finish requests, and insert their KV into the tree.

Every rank runs the same steps on the same inputs; no decision here reads a clock (the one
timing taken, of prefill throughput, only feeds rank 0's load-cost measurements, which
reach every rank as a command).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from bus_schemas.token_ids import TokenIds
from gpu_worker.cache.hicache import PrefixCache
from gpu_worker.consensus.checker import rank_consensus
from gpu_worker.kernels.moves import move_pages
from gpu_worker.kernels.relayout import RunView
from gpu_worker.model.forward_batch import ForwardBatch
from gpu_worker.scheduler.executor import SampleSpec, StepExecutor
from gpu_worker.scheduler.request import CachedTokens, KVExport, Req, ReqState, RequestError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    chunked_prefill_size: int = 512  # prompt tokens computed per step, all requests together
    max_running_requests: int = 64
    check_integrity_when_idle: bool = False

    def __post_init__(self) -> None:
        if self.chunked_prefill_size <= 0 or self.max_running_requests <= 0:
            raise ValueError("chunked_prefill_size and max_running_requests must be positive")


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        executor: StepExecutor,
        cache: PrefixCache,
        eos_token_ids: tuple[int, ...],
        device: torch.device,
    ) -> None:
        self.config = config
        self.executor = executor
        self.cache = cache
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device = device
        self.waiting: deque[Req] = deque()
        self.last_step_worked = False  # whether the last step ran a forward
        self.running: list[Req] = []  # admitted, in admission order
        self.perturb_sampler = False  # test hook (DebugHooks.perturb_sampler)
        # transfer ACKs `consume_acks` took before their copy had finished (measured only):
        # 0 on the first stage, whose counts every TP rank holds finished; a later stage
        # may wait for its own copy of what PP0 counted
        self.num_ack_waits = 0

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def abort(self, rid: int) -> None:
        """Stop a request: a waiting one leaves at once, a running one at the next step."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                req.state, req.finish_reason = ReqState.FINISHED, "abort"
                if req.prefetch is not None and self.cache.storage is not None:
                    self.cache.storage.cancel(req.prefetch)
                return
        for req in self.running:
            if req.rid == rid:
                req.aborted = True

    def add(self, req: Req) -> None:
        if req.sampling.max_new_tokens == 0:
            req.state, req.finish_reason = ReqState.FINISHED, "length"
            return
        storage = self.cache.storage
        if storage is not None and req.remote is None:  # P/D decode: its prefix is promised
            req.prefetch = storage.start(req.rid, req.prompt_ids, req.cache_salt)
        self.waiting.append(req)

    def stop_prefetch(self, rid: int) -> None:
        """Rank 0's timeout verdict: the request takes what its prefetch read so far."""
        if self.cache.storage is not None:
            self.cache.storage.stop(rid)

    # ----------------------------------------------------------------- step

    @rank_consensus(same_params=["num_acks"])
    def consume_acks(self, num_acks: tuple[int, ...]) -> None:
        """Apply the first `num_acks[i]` ACKs of each of the cache's queues (the agreed
        counts: transfers, then storage hits, read progress and writes), in order."""
        transfers = self.cache.transfers
        waited = 0 if transfers is None else transfers.num_waited
        self.cache.acks.consume_counts(num_acks)
        if transfers is not None:
            self.num_ack_waits += transfers.num_waited - waited

    def step(self) -> list[Req]:
        """Run one scheduling step (after `consume_acks` and the step's commands); returns
        the requests that finished in it."""
        if self.cache.storage is not None:
            self.cache.storage.grant()
        self._finish_loads()
        finished = self._finish_aborted()
        self._admit()
        finished += self._finish_received()
        finished += self._forward()
        if self.idle and self.config.check_integrity_when_idle:
            self.cache.drain()
            self.check_integrity()
        return finished

    def _finish_loads(self) -> None:
        for req in self.running:
            if req.state is ReqState.LOADING and req.load is not None and req.load.failed:
                self._load_failed(req)
            elif req.state is ReqState.LOADING and req.load is not None and req.load.done:
                ticket, old = req.load, req.last_node
                assert old is not None
                self.cache.lock(ticket.last_node)
                self.cache.unlock(old)
                req.last_node, req.load = ticket.last_node, None
                prefix = self.cache.tree.path_device_page_ids(ticket.last_node)
                req.page_ids[: len(prefix)] = prefix
                req.cached_len = len(prefix) * self.cache.page_size
                req.state = ReqState.RECEIVING if req.remote else ReqState.PREFILL

    def _load_failed(self, req: Req) -> None:
        """The host hit could not be loaded. A local request computes that range instead (its
        pages are already reserved); a P/D decode request promised it to prefill, so it fails
        with 409 and the router retries without reuse."""
        req.load = None
        req.computed_len = req.cached_len
        req.cached = CachedTokens(device=req.cached_len, host=0)
        if req.remote is not None:
            req.error = RequestError("restore could not deliver the promised prefix", 409)
            req.aborted = True
            req.state = ReqState.RECEIVING
        else:
            req.state = ReqState.PREFILL

    def _finish_received(self) -> list[Req]:
        """P/D decode: requests whose restore and KV reception are both complete start
        decoding with the first token prefill sampled."""
        done = []
        for req in self.running:
            remote = req.remote
            if (
                req.state is not ReqState.RECEIVING
                or req.aborted
                or remote is None
                or remote.first_token is None
                or remote.received_end < req.prompt_len
            ):
                continue
            req.computed_len = req.prompt_len
            req.state = ReqState.DECODE
            self._cache_prompt(req)
            req.output_ids.append(remote.first_token)
            if req.sampling.logprobs is not None:  # prefill sampled it: its logprob is there
                req.logprobs.append((None, ()))
            if self._is_finished(req, remote.first_token):
                self._finish(req)
                done.append(req)
        if done:
            self.running = [r for r in self.running if r.state is not ReqState.FINISHED]
        return done

    def _finish_aborted(self) -> list[Req]:
        aborted = [r for r in self.running if r.aborted and r.state is not ReqState.LOADING]
        for req in aborted:
            req.finish_reason = "abort"
            self._finish(req)
        if aborted:
            self.running = [r for r in self.running if r.state is not ReqState.FINISHED]
        return aborted

    def _admit(self) -> None:
        """First come, first served while pages allow; a request whose storage prefetch may
        not end yet (its policy) waits without holding back those behind it."""
        storage = self.cache.storage
        for req in list(self.waiting):
            if len(self.running) >= self.config.max_running_requests:
                return
            p = req.prefetch
            if p is not None and storage is not None and not p.finished:
                if not storage.ready(p):
                    continue
                storage.finish(p)
            if not self._admit_next(req):
                return

    @rank_consensus(
        same_params=["req.rid", "req.prompt_len"],
        same_results=["result", "req.cached", "list(req.page_ids)"],
    )
    def _admit_next(self, req: Req) -> bool:
        """Admit waiting request `req` if the page budget allows; whether it did."""
        cache, ps = self.cache, self.cache.page_size
        match = (
            cache.no_match()
            if req.remote is not None and not req.remote.reuse
            else cache.match(req.prompt_ids, req.cache_salt)
        )
        cache.lock(match.last_device_node)
        load_pages = len(match.host_page_ids)
        own_pages = -(-req.max_seq_len // ps) - match.total_len // ps
        if load_pages + own_pages > cache.num_available_device_pages:
            cache.unlock(match.last_device_node)
            # nothing running and no copy in flight (a backup's ACK unlocks its pages, a
            # failed load's frees them): nothing will ever free more (the engine checks
            # sizes). The queued count is the same on every rank: ACKs queue at submission.
            if not self.running and not cache.num_queued_acks:
                raise RuntimeError(f"request {req.rid} does not fit the device pool")
            return False
        self.waiting.remove(req)
        ticket = cache.start_load(match)
        if ticket is None and match.host_len:  # no room to load: compute it instead
            own_pages += load_pages
        pages = cache.alloc(own_pages)
        assert pages is not None, "the budget check guaranteed these pages"
        req.last_node = match.last_device_node
        req.cached_len = match.device_len
        host_len = match.host_len if ticket is not None else 0
        req.computed_len = match.device_len + host_len
        storage_len = self._storage_len(req, match.device_len, match.device_len + host_len)
        req.cached = CachedTokens(match.device_len, host_len - storage_len, storage_len)
        req.page_ids = list(match.device_page_ids) + (ticket.page_ids if ticket else []) + pages
        req.load = ticket
        idle = ReqState.RECEIVING if req.remote is not None else ReqState.PREFILL
        req.state = ReqState.LOADING if ticket else idle
        if req.remote is not None:
            req.remote.prefix_len = req.remote.received_end = req.computed_len
        cache.stats.device_hit_tokens += match.device_len
        cache.stats.host_hit_tokens += host_len - storage_len
        cache.stats.storage_hit_tokens += storage_len
        if req.prefetch is not None and cache.storage is not None:
            cache.storage.release(req.prefetch)  # its load (if any) pins what it reads now
        self.running.append(req)
        return True

    @staticmethod
    def _storage_len(req: Req, lo: int, hi: int) -> int:
        """Tokens of the loaded range [lo, hi) that this request's prefetch brought in."""
        if req.prefetch is None:
            return 0
        a, b = req.prefetch.storage_range
        return max(0, min(b, hi) - max(a, lo))

    # ----------------------------------------------------------------- forward

    def _plan(self) -> list[tuple[Req, list[int]]]:
        """Which requests run this step, with the new tokens each feeds."""
        plan = [(r, [r.output_ids[-1]]) for r in self.running if r.state is ReqState.DECODE]
        budget = self.config.chunked_prefill_size
        for req in self.running:
            if req.state is not ReqState.PREFILL or budget == 0:
                continue
            chunk = req.prompt_ids[req.computed_len : req.computed_len + budget].tolist()
            budget -= len(chunk)
            plan.append((req, chunk))
        return plan

    def _forward(self) -> list[Req]:
        plan = self._plan()
        self.last_step_worked = bool(plan)
        if not plan:
            return []
        pool = self.cache.device_pool
        seqs = []
        for req, new_ids in plan:
            prefix_len = req.computed_len if req.state is ReqState.PREFILL else req.seq_len - 1
            slots = pool.slot_ids(req.page_ids, prefix_len + len(new_ids))
            seqs.append((new_ids, prefix_len, slots))
        batch = ForwardBatch.build(seqs, self.device)
        specs = [
            _spec(req)
            if req.state is ReqState.DECODE or req.computed_len + len(new_ids) >= req.prompt_len
            else None  # a prefill chunk before the last: no token yet
            for req, new_ids in plan
        ]
        start = time.perf_counter()
        outcomes = self.executor.run(batch, self.cache.device_pool, specs)
        num_prefill = sum(len(ids) for r, ids in plan if r.state is ReqState.PREFILL)
        if num_prefill:  # rank 0's measurement for the load-or-recompute estimate only
            self.cache.cost.observe_prefill(len(batch.input_ids), time.perf_counter() - start)
        finished = []
        for (req, new_ids), outcome in zip(plan, outcomes, strict=True):
            if req.state is ReqState.PREFILL:
                req.computed_len += len(new_ids)
                if req.computed_len < req.prompt_len:
                    continue  # more chunks to go: no token yet
                req.state = ReqState.DECODE
                self._cache_prompt(req)
            assert outcome is not None
            if req.logits_trace is not None and outcome.logits is not None:
                req.logits_trace.append(outcome.logits)
            if outcome.token is None:
                log.warning("request %d failed: %s", req.rid, outcome.error)
                self._fail(req, outcome.error or "sampling failed")
                finished.append(req)
                continue
            token = outcome.token
            if self.perturb_sampler and len(req.output_ids) == 2:
                token = (token + 1) % self.executor.model_config_whole.vocab_size
            req.output_ids.append(token)
            if outcome.logprob is not None:
                req.logprobs.append((outcome.logprob, outcome.top_logprobs))
            if self._is_finished(req, token):
                self._finish(req)
                finished.append(req)
        if finished:
            self.running = [r for r in self.running if r.state is not ReqState.FINISHED]
        return finished

    def _fail(self, req: Req, message: str) -> None:
        """Finish `req` with an internal error; its KV goes back without entering the tree
        (what it computed may be the reason it failed)."""
        req.error = RequestError(message, 500)
        req.finish_reason = "error"
        req.state = ReqState.FINISHED
        assert req.last_node is not None
        self.cache.unlock(req.last_node)
        self.cache.free(req.page_ids[req.cached_len // self.cache.page_size :])
        req.page_ids, req.last_node = [], None

    def _is_finished(self, req: Req, token: int) -> bool:
        sp = req.sampling
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_token_ids):
            req.finish_reason = "stop"
        elif len(req.output_ids) >= sp.max_new_tokens:
            req.finish_reason = "length"
        return req.finish_reason is not None

    # ----------------------------------------------------------------- cache hand-off

    def _cache_prompt(self, req: Req) -> None:
        """After prefill, share the prompt's KV through the tree for requests behind it."""
        if not self.cache.config.enable_radix_cache:
            return
        self._insert(req, req.prompt_ids)

    def _insert(self, req: Req, ids: TokenIds) -> None:
        prefix = self.cache.insert(ids, req.page_ids, req.cached_len, req.cache_salt)
        self.cache.lock(prefix.last_node)
        assert req.last_node is not None
        self.cache.unlock(req.last_node)
        req.last_node = prefix.last_node
        req.page_ids[: len(prefix.page_ids)] = prefix.page_ids
        req.cached_len = len(prefix.page_ids) * self.cache.page_size

    def _finish(self, req: Req) -> None:
        """Insert the KV the request computed into the tree and release the rest."""
        if req.export_from is not None and req.output_ids and req.error is None:
            req.export = self._pack_export(req)
        kv_len = req.kv_len
        req.state = ReqState.FINISHED
        if self.cache.config.enable_radix_cache:
            self._insert(req, req.token_ids(kv_len))
        assert req.last_node is not None
        self.cache.unlock(req.last_node)
        self.cache.free(req.page_ids[req.cached_len // self.cache.page_size :])
        req.page_ids, req.last_node = [], None

    def _pack_export(self, req: Req) -> KVExport:
        """P/D prefill: pack the prompt's KV from `export_from` into a staging buffer in the
        unified order, one KV head per group, with the relayout kernel (the wire sends it,
        and a decode engine of any TP x PP layout cuts its ranks' heads and layers from it;
        this request's pages can go)."""
        assert req.export_from is not None
        ps = self.cache.page_size
        first_page = req.export_from // ps
        last_page = -(-req.prompt_len // ps)
        src = req.page_ids[first_page:last_page]
        spec = self.cache.spec
        staging = torch.empty(
            (len(src), spec.num_kv_heads, spec.num_layers, spec.num_kv, ps, 1, spec.head_dim),
            dtype=spec.dtype,
            device=self.device,
        )
        move_pages(
            self.cache.device_pool.run_view(1),
            RunView.unified(staging),
            torch.tensor(src, dtype=torch.int64, device=self.device),
            torch.arange(len(src), dtype=torch.int64, device=self.device),
        )
        ranks, stagings = self.executor.collect_export(staging.cpu())  # all, on rank 0
        first = req.output_ids[0]
        world = self.executor.groups.world_size
        return KVExport(stagings, req.export_from, req.prompt_len, first, ranks, world)

    def write_remote_kv(
        self, req: Req, token_start: int, token_end: int, staging: torch.Tensor
    ) -> None:
        """P/D decode: write received KV of tokens [token_start, token_end) into the pages this
        request reserved. `staging` is this rank's heads and layers in the unified order, one
        head per group (`_pack_export`), its first page at `token_start` (aligned)."""
        remote, ps = req.remote, self.cache.page_size
        if remote is None or req.state not in (ReqState.LOADING, ReqState.RECEIVING):
            raise ValueError(f"request {req.rid} is not waiting for KV")
        if token_start != remote.received_end or token_end > req.prompt_len:
            raise ValueError(
                f"KV chunk [{token_start}, {token_end}) does not continue "
                f"[{remote.prefix_len}, {remote.received_end}) of a {req.prompt_len}-token prompt"
            )
        num_pages = staging.shape[0]
        if token_start % ps or num_pages != -(-(token_end - token_start) // ps):
            raise ValueError("KV chunk pages do not match its token range")
        dst = req.page_ids[token_start // ps : token_start // ps + num_pages]
        move_pages(
            RunView.unified(staging.to(self.device)),
            self.cache.device_pool.run_view(1),
            torch.arange(num_pages, dtype=torch.int64, device=self.device),
            torch.tensor(dst, dtype=torch.int64, device=self.device),
        )
        remote.received_end = token_end

    # ----------------------------------------------------------------- checks

    def held_page_ids(self) -> set[int]:
        """Device pages owned by running requests (their own pages, not the tree's)."""
        held: set[int] = set()
        for req in self.running:
            held.update(req.page_ids[req.cached_len // self.cache.page_size :])
        return held

    def check_integrity(self) -> None:
        self.cache.check_integrity(self.held_page_ids())


def _spec(req: Req) -> SampleSpec:
    """How to sample `req`'s next token (the tokens seen so far only when a penalty reads
    them: references, not copies)."""
    sp = req.sampling
    history = sp.uses_history
    return SampleSpec(
        sp,
        len(req.output_ids),
        req.logits_trace is not None,
        req.prompt_ids if history else (),
        req.output_ids if history else (),
    )
