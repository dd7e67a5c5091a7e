"""The synchronous scheduler loop of one rank: admit, load, prefill in chunks, decode.

One step (driven by `Engine.step`):
1. `consume_acks(n)`: apply the first `n` transfer ACKs, in order; `n` is agreed by every
   rank (`gpu_worker/parallel/sync.py`), never read from this rank's own queue alone;
2. the engine applies the step's commands (new requests, aborts, ...);
3. `step()`: move requests whose load-back completed on to prefill and admit waiting
   requests while the page budget allows, and with a sharded CP pool the gather scratch
   budget (`Admission`, `scheduler/admission.py`; `scheduler/gather_budget.py`);
4. plan one forward over a ragged batch (every decoding request plus prefill chunks up to
   `chunked_prefill_size` tokens) and run it through the `StepExecutor` (the engine's
   `ModelExecutor`, seen through `gpu_worker/scheduler/executor.py`), which returns on every
   rank the tokens each request appended (n >= 0; a decode step today appends one);
5. finish requests, and insert their KV into the tree (`KVHandOff`, `scheduler/handoff.py`).
P/D decode requests receive their prompt's KV through `RemoteKVReceiver`
(`scheduler/remote_kv.py`). A request's lengths, and what they mean, are `Req.lens`.

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

from gpu_worker.cache.hicache import PrefixCache
from gpu_worker.consensus.checker import rank_consensus
from gpu_worker.model.forward_batch import ForwardBatch
from gpu_worker.scheduler.admission import Admission
from gpu_worker.scheduler.config import SchedulerConfig
from gpu_worker.scheduler.executor import SampleOutcome, SampleSpec, StepExecutor
from gpu_worker.scheduler.handoff import KVHandOff
from gpu_worker.scheduler.remote_kv import RemoteKVReceiver
from gpu_worker.scheduler.request import Req, ReqState
from gpu_worker.scheduler.spec_step import SpecDecoder

__all__ = ["PlannedRow", "Scheduler", "SchedulerConfig"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PlannedRow:
    """One request's row of a step: it feeds `new_ids` at positions [kv_len, kv_len +
    len(new_ids)), whose KV the forward writes, and, when `samples`, appends the tokens
    sampled after them (n >= 0)."""

    req: Req
    new_ids: list[int]
    kv_len: int  # the request's `lens.kv_len` before the step
    samples: bool  # False for a prefill chunk before the last: no token yet


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        executor: StepExecutor,
        cache: PrefixCache,
        eos_token_ids: tuple[int, ...],
        device: torch.device,
        perturb_sampler: bool = False,
        perturb_rotation: bool = False,
        spec: SpecDecoder | None = None,
    ) -> None:
        """`perturb_sampler`: test hook (`DebugHooks.perturb_sampler`): change each request's
        third output token, so ranks or runs that should agree do not. `perturb_rotation`:
        test hook (`DebugHooks.perturb_owner_rotation_rank`, see `Admission`). `spec`:
        speculative decoding (`spec_step.py`): decoding requests take its rounds, and its
        draft computes every prefill chunk too."""
        self.config = config
        self.executor = executor
        self.cache = cache
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device = device
        self.waiting: deque[Req] = deque()
        self.last_step_worked = False  # whether the last step ran a forward
        self.running: list[Req] = []  # admitted, in admission order
        self.perturb_sampler = perturb_sampler
        self.spec = spec
        # transfer ACKs `consume_acks` took before their copy had finished (measured only):
        # 0 on the first stage, whose counts every TP rank holds finished; a later stage
        # may wait for its own copy of what PP0 counted
        self.num_ack_waits = 0
        self.admission = Admission(config, cache, perturb_rotation)
        self.handoff = KVHandOff(cache, executor, device)
        self.remote_kv = RemoteKVReceiver(cache, self.handoff, self.eos_token_ids, device)

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

    def write_remote_kv(
        self,
        req: Req,
        token_start: int,
        token_end: int,
        staging: torch.Tensor,
        draft: torch.Tensor | None = None,
    ) -> None:
        """P/D decode: write received KV of tokens [token_start, token_end) into the pages
        `req` reserved (`RemoteKVReceiver.write` says what `staging` and the draft's
        `draft` hold)."""
        self.remote_kv.write(req, token_start, token_end, staging, draft)

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
        self.admission.finish_loads(self.running)
        finished = self._finish_aborted()
        finished += self.admission.admit(self.waiting, self.running)
        finished += self._drop_finished(self.remote_kv.finish_received(self.running))
        finished += self._forward()
        if self.idle and self.config.check_integrity_when_idle:
            self.cache.drain()
            self.check_integrity()
        return finished

    def _finish_aborted(self) -> list[Req]:
        aborted = [r for r in self.running if r.aborted and r.state is not ReqState.LOADING]
        for req in aborted:
            req.finish_reason = "abort"
            self.handoff.finish(req)
        return self._drop_finished(aborted)

    def _drop_finished(self, finished: list[Req]) -> list[Req]:
        """Take the `finished` requests out of `running`; returns them."""
        if finished:
            self.running = [r for r in self.running if r.state is not ReqState.FINISHED]
        return finished

    # ----------------------------------------------------------------- forward

    def _plan(self) -> list[PlannedRow]:
        """Which requests run this step, with the new tokens each feeds: a decoding request
        its outputs whose KV is not written yet (today the last one), then prefill chunks
        while the budget lasts."""
        plan = [
            PlannedRow(r, r.output_ids[r.lens.kv_len - r.prompt_len :], r.lens.kv_len, True)
            for r in self.running
            if r.state is ReqState.DECODE
        ]
        budget = self.config.chunked_prefill_size
        for req in self.running:
            if req.state is not ReqState.PREFILL or budget == 0:
                continue
            start = req.lens.computed_len
            chunk = req.prompt_ids[start : start + budget].tolist()
            budget -= len(chunk)
            plan.append(PlannedRow(req, chunk, start, start + len(chunk) >= req.prompt_len))
        return plan

    def _forward(self) -> list[Req]:
        plan = self._plan()
        self.last_step_worked = bool(plan)
        if not plan:
            return []
        if self.spec is not None:
            return self._forward_spec(plan)
        outcomes = self._run(plan)
        finished = [
            row.req
            for row, outcome in zip(plan, outcomes, strict=True)
            if self._apply(row, outcome)
        ]
        return self._drop_finished(finished)

    def _forward_spec(self, plan: list[PlannedRow]) -> list[Req]:
        """A step with speculative decoding: the draft's forwards (proposals, and its copy
        of the prefill chunks), the target's verify of the decoding requests, then its
        forward of the prefill chunks alone."""
        assert self.spec is not None
        decode = [row for row in plan if row.req.state is ReqState.DECODE]
        prefill = [row for row in plan if row.req.state is not ReqState.DECODE]
        pool = self.cache.device_pool
        chunks = [(row.req, row.new_ids, row.kv_len) for row in prefill]
        verified = self.spec.step(chunks, [row.req for row in decode], pool)
        outcomes: list[SampleOutcome | None] = [*verified, *(self._run(prefill) if prefill else [])]
        finished = [
            row.req
            for row, outcome in zip([*decode, *prefill], outcomes, strict=True)
            if self._apply(row, outcome)
        ]
        return self._drop_finished(finished)

    def _run(self, plan: list[PlannedRow]) -> list[SampleOutcome | None]:
        """The target's forward over `plan`'s rows, sampling one token where they sample."""
        pool = self.cache.device_pool
        seqs = []
        for row in plan:
            slots = pool.slot_ids(row.req.page_ids, row.kv_len + len(row.new_ids))
            seqs.append((row.new_ids, row.kv_len, slots))
        batch = ForwardBatch.build(seqs, self.device)
        self.admission.check_gather(batch)
        specs = [_spec(row.req) if row.samples else None for row in plan]
        start = time.perf_counter()
        outcomes = self.executor.run(batch, pool, specs)
        num_prefill = sum(len(row.new_ids) for row in plan if row.req.state is ReqState.PREFILL)
        if num_prefill:  # rank 0's measurement for the load-or-recompute estimate only
            self.cache.cost.observe_prefill(len(batch.input_ids), time.perf_counter() - start)
        return outcomes

    def _apply(self, row: PlannedRow, outcome: SampleOutcome | None) -> bool:
        """Advance `row`'s request by what the step did: the prompt tokens it computed, then
        the n >= 0 tokens it appended. Whether the request finished."""
        req = row.req
        if req.state is ReqState.PREFILL:
            req.lens.computed_len += len(row.new_ids)
            if req.lens.computed_len < req.prompt_len:
                return False  # more chunks to go: no token yet
            req.state = ReqState.DECODE
            self.handoff.cache_prompt(req)
        assert outcome is not None
        if outcome.error is not None:
            if req.logits_trace is not None:
                req.logits_trace.extend(outcome.logits)
            log.warning("request %d failed: %s", req.rid, outcome.error)
            self.handoff.fail(req, outcome.error)
            return True
        tokens = [s.token for s in outcome.tokens]
        if self.perturb_sampler:
            vocab = self.executor.model_config_whole.vocab_size
            tokens = [
                (t + 1) % vocab if len(req.output_ids) + i == 2 else t for i, t in enumerate(tokens)
            ]
        n = req.append_outputs(tokens, self.eos_token_ids)
        if req.logits_trace is not None:  # the emitted tokens' only (a stop cuts a run)
            req.logits_trace.extend(outcome.logits[:n])
        for s in outcome.tokens[:n]:
            if s.logprob is not None:
                req.logprobs.append((s.logprob, s.top_logprobs))
        if req.finish_reason is None:
            return False
        self.handoff.finish(req)
        return True

    # ----------------------------------------------------------------- checks

    def held_page_ids(self) -> set[int]:
        """Device pages owned by running requests (their own pages, not the tree's)."""
        held: set[int] = set()
        for req in self.running:
            held.update(req.page_ids[req.lens.cached_len // self.cache.page_size :])
        return held

    def check_integrity(self) -> None:
        self.cache.check_integrity(self.held_page_ids())
        for req in self.running:
            req.lens.check()


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
