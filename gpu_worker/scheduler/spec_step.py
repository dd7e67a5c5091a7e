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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

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
        zero_hits: bool = False,
        skip_final_feed: bool = False,
    ) -> None:
        """`draft`: the draft model's executor over `draft_pool` (the pool group's draft
        member). Test hooks (`DebugHooks`): `zero_hits` zeroes the draft's rows of a
        request's prefix hit (device, host or L3) before its prefill; `skip_final_feed` counts an
        all-accepted round's last proposal as fed without feeding it."""
        self.config = config
        self.draft = draft
        self.draft_pool = draft_pool
        self.target = target
        self.device = device
        self.zero_hits = zero_hits
        self.skip_final_feed = skip_final_feed
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
        logits = self.draft.logits(self._batch(seqs, rows or [end - 1]), self.draft_pool)
        for req, new_ids, kv_len in prefill:
            req.draft_len = kv_len + len(new_ids)
        for r in rounds:
            r.req.draft_len = r.req.lens.seq_len
        proposing = [(r, logits[i]) for i, r in enumerate(rounds) if r.k > 0]
        if proposing:
            self._propose([r for r, _ in proposing], torch.stack([q for _, q in proposing]))

    def _zero(self, page_ids: list[PageId]) -> None:
        ps = self.draft_pool.spec.page_size
        slots = self.draft_pool.slot_ids(page_ids, len(page_ids) * ps)
        self.draft_pool.kv[:, :, slots] = 0

    def _propose(self, rounds: list[_Round], logits: torch.Tensor) -> None:
        """Each round's next proposal from its row of the draft's `logits`."""
        for r, q in zip(rounds, logits, strict=True):
            req, sp = r.req, r.req.sampling
            outputs = [*req.output_ids, *r.drafts]
            prompt = req.prompt_ids if sp.uses_history else ()
            step = len(outputs)
            if sp.greedy:
                token = sample(q, sp, None, prompt, outputs)
            else:
                probs = distribution(q, sp, prompt, outputs)
                gen = _seeded(sp, step, "draft")
                token = int(torch.multinomial(probs.cpu(), 1, generator=gen).item())
            r.drafts.append(token)
            r.draft_logits.append(q)

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
        outcomes, at = [], 0
        for r in rounds:
            p = logits[at : at + r.k + 1]
            at += r.k + 1
            outcomes.append(self._accept(r, p))
        return outcomes

    def _accept(self, r: _Round, p: torch.Tensor) -> SampleOutcome:
        req, sp = r.req, r.req.sampling
        trace = req.logits_trace is not None
        try:
            tokens = _greedy(r, p) if sp.greedy else _rejection(r, p)
        except Exception as e:  # the request fails, with the reason; the engine keeps going
            return SampleOutcome((), f"sampling failed: {e}")
        accepted = len(tokens) - 1
        L = r.kv_len
        fed = L + 1 + min(accepted, max(r.k - 1, 0))  # t0, then d1..d(k-1) went through
        req.draft_len = L + 1 + accepted if self.skip_final_feed else fed
        req.spec_rounds.append((r.k, accepted))
        s = self.stats
        s.rounds, s.proposed, s.accepted = s.rounds + 1, s.proposed + r.k, s.accepted + accepted
        s.emitted += len(tokens)
        traced = tuple(p[i].detach().clone().cpu() for i in range(len(tokens))) if trace else ()
        return SampleOutcome(tuple(tokens), None, traced)


def pool_slots(pool: KVCache, req: Req, n: int) -> torch.Tensor:
    assert isinstance(pool, DeviceKVPool), "speculative decoding reads an unsharded pool"
    return pool.slot_ids(req.page_ids, n)


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
