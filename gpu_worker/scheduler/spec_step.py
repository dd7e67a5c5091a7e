"""Speculative decoding's step: the draft proposes, the target verifies in one forward.

Per decoding request of a step (a request at `kv_len` L, its last output t0 not fed yet):
1. draft forward 1 feeds what the draft has not seen (t0, and after a round that accepted
   every proposal also that last proposal: the draft's KV must be complete, or its next
   proposals read a hole) and proposes d1; forwards 2..k feed d1..d(k-1) and propose
   d2..dk. Every request's forward j runs in one batch; the first also carries the draft's
   copy of the step's prefill chunks, so the draft's KV covers every token the target's
   does, at the same slots (`PoolGroup.draft`): a device prefix hit holds both;
2. the target runs one extend of k+1 tokens (t0, d1..dk) at positions L..L+k and returns
   the logits of all of them (`ForwardBatch.logit_rows`);
3. greedy: the target's own token at each position is taken while it equals the proposal,
   then one more (its correction, or after k agreements its bonus token): exactly the
   tokens speculation off gives. Sampled: proposal d is kept with probability
   min(1, p(d)/q(d)) and on the first rejection the token is drawn from norm(max(0, p - q)),
   else the bonus from p (p, q: the target's and the draft's distributions after every
   sampling parameter), so the output follows the target's distribution.

A round proposes k = min(K, outputs left - 1), so its verify never writes past the slots a
request reserved for its outputs (`ReqLens.max_kv_len`) and never emits more than it may;
the KV of rejected positions is overwritten by later rounds. A stop token inside an
accepted run cuts the output there (`Req.append_outputs`). Logprobs and the logits trace
hold the target's logits at every emitted position.

TP and PP engines: the draft is sharded like the target (`engine/draft.py`), and every
rank runs every draft forward and the verify through the pipeline with the same batch.
Only the last stage holds logits, so the decisions are made there, once, by its first rank
(`parallel.sync.decider_rank`): each draft forward's proposals, and each verify's outcome
(the tokens a round appends, with their logprobs and traced logits). They are broadcast
(`broadcast_decision`) and every rank applies them alike: no rank decides from its own
logits, so the TP ranks of the last stage agree by construction (and a seeded draw needs
no rank-identical generator: one rank draws). Each rank then applies the accepted count to
its own draft state (`_settle`: the draft's fed length) and the scheduler to its outputs.
The consensus checker records every round's accepted count and fed length (`_settle`) and
each step's draft feed (`_feed`). CP engines do not speculate (`EngineConfig` refuses).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpu_worker.consensus.checker import rank_consensus
from gpu_worker.memory.allocator import PageId
from gpu_worker.memory.device_pool import DeviceKVPool
from gpu_worker.model.forward_batch import ForwardBatch, KVCache
from gpu_worker.model.sampling import (
    Sampled,
    SamplingParams,
    distribution,
    sample,
    sample_with_logprobs,
    spec_generator,
    step_generator,
    with_logprobs,
)
from gpu_worker.parallel.groups import ParallelGroups
from gpu_worker.parallel.sync import broadcast_decision, decider_rank
from gpu_worker.scheduler.executor import SampleOutcome, StepExecutor
from gpu_worker.scheduler.request import Req
from gpu_worker.scheduler.spec_config import SpecConfig


@dataclass(slots=True)
class SpecStats:
    """An engine's verify rounds so far (`/stats`, the prometheus gauges)."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens the rounds appended (accepted + one each, before stop cuts)

    @property
    def accept_rate(self) -> float:
        """Accepted proposals / proposals."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def accept_length(self) -> float:
        """Tokens per verify round (SGLang's accept length: accepted + 1)."""
        return self.emitted / self.rounds if self.rounds else 0.0


@dataclass(slots=True)
class _Round:
    """One request's round: its proposals and the draft's logits each came from."""

    req: Req
    k: int  # proposals this round
    drafts: list[int]
    draft_logits: list[torch.Tensor]

    @property
    def kv_len(self) -> int:
        return self.req.lens.kv_len


class SpecDecoder:
    def __init__(
        self,
        config: SpecConfig,
        draft: StepExecutor,
        draft_pool: DeviceKVPool,
        target: StepExecutor,
        device: torch.device,
        groups: ParallelGroups | None = None,
        zero_hits: bool = False,
        skip_final_feed: bool = False,
        perturb_accept: bool = False,
    ) -> None:
        """`draft`: the draft model's executor over `draft_pool` (the pool group's draft
        member, this rank's shard of it). `groups`: the engine's world (None: one rank).
        Test hooks (`DebugHooks`): `zero_hits` zeroes the draft's rows of a request's
        prefix hit (device, host or L3) before its prefill; `skip_final_feed` counts an
        all-accepted round's last proposal as fed without feeding it; `perturb_accept`
        makes this rank apply one accepted proposal fewer than the decision (the checker
        must name it)."""
        self.config = config
        self.draft = draft
        self.draft_pool = draft_pool
        self.target = target
        self.device = device
        self.groups = groups or ParallelGroups.single()
        self.decides = self.groups.rank == decider_rank(self.groups)
        self.zero_hits = zero_hits
        self.skip_final_feed = skip_final_feed
        self.perturb_accept = perturb_accept
        self.stats = SpecStats()

    def step(
        self, prefill: Sequence[tuple[Req, list[int], int]], decode: Sequence[Req], pool: KVCache
    ) -> list[SampleOutcome]:
        """Run the draft over the step's prefill chunks (`(req, new_ids, kv_len)`) and a
        speculative round for every request of `decode`; one outcome per `decode` request,
        in order. The target's own prefill forward is the scheduler's."""
        rounds = [_Round(r, self._num_proposals(r), [], []) for r in decode]
        self._draft_first(prefill, rounds)
        for j in range(1, self.config.num_steps):
            active = [r for r in rounds if r.k > j]
            if not active:
                break
            seqs = []
            for r in active:
                pos = r.kv_len + j
                seqs.append(([r.drafts[-1]], pos, self._slots(r.req, pos + 1)))
            self._propose(active, self.draft.logits(self._batch(seqs, None), self.draft_pool))
        if not rounds:
            return []
        return self._verify(rounds, pool)

    def _num_proposals(self, req: Req) -> int:
        left = req.sampling.max_new_tokens - len(req.output_ids)
        return max(0, min(self.config.num_steps, left - 1))

    def _slots(self, req: Req, n: int) -> torch.Tensor:
        return self.draft_pool.slot_ids(req.page_ids, n)

    def _batch(
        self, seqs: list[tuple[list[int], int, torch.Tensor]], rows: list[int] | None
    ) -> ForwardBatch:
        batch = ForwardBatch.build(seqs, self.device)
        if rows is not None:
            batch.logit_rows = torch.tensor(rows, dtype=torch.int64, device=self.device)
        return batch

    def _draft_first(
        self, prefill: Sequence[tuple[Req, list[int], int]], rounds: list[_Round]
    ) -> None:
        """Draft forward 1: the prefill chunks, and every round's unseen tokens (t0, maybe
        the last round's final proposal) with the first proposal."""
        seqs: list[tuple[list[int], int, torch.Tensor]] = []
        for req, new_ids, kv_len in prefill:
            if self.zero_hits and kv_len and kv_len == req.cached.total:
                self._zero(req.page_ids[: kv_len // self.draft_pool.spec.page_size])
            seqs.append((new_ids, kv_len, self._slots(req, kv_len + len(new_ids))))
        rows, end = [], sum(len(s[0]) for s in seqs)
        for r in rounds:
            req = r.req
            assert req.draft_len is not None and req.draft_len <= r.kv_len, req.draft_len
            unseen = list(req.token_ids(req.lens.seq_len)[req.draft_len :])
            seqs.append((unseen, req.draft_len, self._slots(req, req.lens.seq_len)))
            end += len(unseen)
            rows.append(end - 1)
        if not seqs:
            return
        # recorded before the forward: ranks whose draft state diverged are named here, not
        # by the forward's batch-shape guard
        fed = [(req, kv_len + len(new_ids)) for req, new_ids, kv_len in prefill]
        self._feed(fed + [(r.req, r.req.lens.seq_len) for r in rounds])
        logits = self.draft.logits(self._batch(seqs, rows or [end - 1]), self.draft_pool)
        proposing = [i for i, r in enumerate(rounds) if r.k > 0]
        if proposing:
            self._propose(
                [rounds[i] for i in proposing], logits[proposing] if self.decides else logits
            )

    @rank_consensus(same_params=["[(req.rid, req.draft_len, n) for req, n in fed]"])
    def _feed(self, fed: list[tuple[Req, int]]) -> None:
        """The draft's cache decision of a step: for each request, from where its KV is fed
        and how far it then covers (prefill chunks and every round's unseen tokens)."""
        for req, n in fed:
            req.draft_len = n

    def _zero(self, page_ids: list[PageId]) -> None:
        ps = self.draft_pool.spec.page_size
        slots = self.draft_pool.slot_ids(page_ids, len(page_ids) * ps)
        self.draft_pool.kv[:, :, slots] = 0

    def _propose(self, rounds: list[_Round], logits: torch.Tensor) -> None:
        """Each round's next proposal from its row of the draft's `logits`, drawn by the
        decider (the last stage's first rank: the only rows there are) and broadcast, so
        every rank feeds the same proposals to its draft and target shards."""
        tokens: list[int] | None = None
        if self.decides:
            tokens = []
            for r, q in zip(rounds, logits, strict=True):
                tokens.append(_proposal(r, q))
                r.draft_logits.append(q)
        tokens = broadcast_decision(self.groups, tokens)
        assert tokens is not None
        for r, token in zip(rounds, tokens, strict=True):
            r.drafts.append(token)

    def _verify(self, rounds: list[_Round], pool: KVCache) -> list[SampleOutcome]:
        """The target's forward over every round's t0 + proposals; the outcomes."""
        seqs: list[tuple[list[int], int, torch.Tensor]] = []
        rows: list[int] = []
        end = 0
        for r in rounds:
            req = r.req
            ids = [req.output_ids[-1], *r.drafts]
            seqs.append((ids, r.kv_len, pool_slots(pool, req, r.kv_len + len(ids))))
            rows.extend(range(end, end + len(ids)))
            end += len(ids)
        logits = self.target.logits(self._batch(seqs, rows), pool)
        decided: list[SampleOutcome] | None = None
        if self.decides:  # the verify decision, made once (see `_propose`)
            decided, at = [], 0
            for r in rounds:
                decided.append(_decide(r, logits[at : at + r.k + 1]))
                at += r.k + 1
        decided = broadcast_decision(self.groups, decided)
        assert decided is not None
        return [self._apply(r, o) for r, o in zip(rounds, decided, strict=True)]

    def _apply(self, r: _Round, outcome: SampleOutcome) -> SampleOutcome:
        """Apply the decided `outcome` of `r` to this rank's state: the draft's fed length
        here, the request's outputs by the scheduler with the outcome returned."""
        if outcome.error is not None:
            return outcome
        accepted = len(outcome.tokens) - 1
        if self.perturb_accept and accepted > 0:  # the test switch: this rank alone differs
            accepted -= 1
            outcome = SampleOutcome(
                outcome.tokens[: accepted + 1], None, outcome.logits[: accepted + 1]
            )
        self._settle(r, accepted, len(outcome.tokens))
        return outcome

    @rank_consensus(same_params=["r.req.rid", "r.kv_len", "r.k"], same_results=["result"])
    def _settle(self, r: _Round, accepted: int, emitted: int) -> tuple[int, int]:
        """One verify round's accepted count applied to the draft: its KV now covers t0
        and the proposals that went through it (all but an all-accepted round's last,
        which the next round feeds). Returns (accepted, the draft's fed length)."""
        req, L = r.req, r.kv_len
        fed = L + 1 + min(accepted, max(r.k - 1, 0))  # t0, then d1..d(k-1) went through
        req.draft_len = L + 1 + accepted if self.skip_final_feed else fed
        req.spec_rounds.append((r.k, accepted))
        s = self.stats
        s.rounds, s.proposed, s.accepted = s.rounds + 1, s.proposed + r.k, s.accepted + accepted
        s.emitted += emitted
        return accepted, req.draft_len


def pool_slots(pool: KVCache, req: Req, n: int) -> torch.Tensor:
    assert isinstance(pool, DeviceKVPool), "speculative decoding reads an unsharded pool"
    return pool.slot_ids(req.page_ids, n)


def _proposal(r: _Round, q: torch.Tensor) -> int:
    """The draft's next token for `r` from its logits `q` (greedy, or drawn seeded)."""
    req, sp = r.req, r.req.sampling
    outputs = [*req.output_ids, *r.drafts]
    prompt = req.prompt_ids if sp.uses_history else ()
    if sp.greedy:
        return sample(q, sp, None, prompt, outputs)
    probs = distribution(q, sp, prompt, outputs)
    gen = _seeded(sp, len(outputs), "draft")
    return int(torch.multinomial(probs.cpu(), 1, generator=gen).item())


def _decide(r: _Round, p: torch.Tensor) -> SampleOutcome:
    """The verify decision of `r` from the target's logits `p` (k + 1 rows): the tokens it
    appends (accepted proposals and one more), with the traced logits of each."""
    try:
        tokens = _greedy(r, p) if r.req.sampling.greedy else _rejection(r, p)
    except Exception as e:  # the request fails, with the reason; the engine keeps going
        return SampleOutcome((), f"sampling failed: {e}")
    trace = r.req.logits_trace is not None
    traced = tuple(p[i].detach().clone().cpu() for i in range(len(tokens))) if trace else ()
    return SampleOutcome(tuple(tokens), None, traced)


def _seeded(sp: SamplingParams, step: int, draw: str) -> torch.Generator | None:
    return None if sp.seed is None else spec_generator(sp.seed, step, draw)


def _greedy(r: _Round, p: torch.Tensor) -> list[Sampled]:
    """The target's own greedy tokens while they agree with the proposals, and one more."""
    req, sp = r.req, r.req.sampling
    prompt = req.prompt_ids if sp.uses_history else ()
    out: list[Sampled] = []
    for j in range(r.k + 1):
        outputs = [*req.output_ids, *r.drafts[:j]]
        s = sample_with_logprobs(p[j], sp, None, prompt, outputs)
        out.append(s)
        if j == r.k or s.token != r.drafts[j]:
            break
    return out


def _rejection(r: _Round, p: torch.Tensor) -> list[Sampled]:
    """The standard rejection rule (see the module doc): tokens distributed as the
    target's."""
    req, sp = r.req, r.req.sampling
    prompt = req.prompt_ids if sp.uses_history else ()
    out: list[Sampled] = []
    for j in range(r.k):
        outputs = [*req.output_ids, *r.drafts[:j]]
        step = len(outputs)
        pt = distribution(p[j], sp, prompt, outputs).cpu()
        qt = distribution(r.draft_logits[j], sp, prompt, outputs).cpu()
        d = r.drafts[j]
        u = torch.rand(1, dtype=torch.float64, generator=_seeded(sp, step, "accept")).item()
        if u * float(qt[d]) < float(pt[d]):  # u < p/q, without dividing
            out.append(with_logprobs(p[j], sp, d))
            continue
        residual = torch.clamp(pt - qt, min=0.0)
        if not float(residual.sum()) > 0:  # p == q up to rounding: any rejection is p's
            residual = pt
        gen = _seeded(sp, step, "residual")
        token = int(torch.multinomial(residual, 1, generator=gen).item())
        out.append(with_logprobs(p[j], sp, token))
        return out
    outputs = [*req.output_ids, *r.drafts]
    gen = None if sp.seed is None else step_generator(sp.seed, len(outputs))
    out.append(sample_with_logprobs(p[r.k], sp, gen, prompt, outputs))
    return out
