"""P/D decode: a request whose prompt KV arrives from a prefill engine.

Admission reserves its pages and answers `RemoteKV.prefix_len` (what this engine already
holds); `RemoteKVReceiver.write` then writes each received chunk of KV into those pages, and
once the restore and the reception are both complete `finish_received` starts it decoding
with the first token prefill sampled.

With speculative decoding each chunk carries the draft's KV of the same pages too, written
into the draft pool (`PoolGroup.draft`, the same page ids): the request then decodes with
the draft's state of the whole prompt (`Req.draft_len`), and once its KV enters the tree a
later decode-side reuse hit holds both, as a colocated device hit does.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from gpu_worker.cache.hicache import PrefixCache
from gpu_worker.kernels.moves import move_pages
from gpu_worker.kernels.relayout import RunView
from gpu_worker.scheduler.handoff import KVHandOff
from gpu_worker.scheduler.pd_pages import rank_pages
from gpu_worker.scheduler.request import Req, ReqState


class RemoteKVReceiver:
    def __init__(
        self,
        cache: PrefixCache,
        handoff: KVHandOff,
        eos_token_ids: Collection[int],
        device: torch.device,
    ) -> None:
        self.cache = cache
        self.handoff = handoff
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.zero_draft = False  # test switch: received draft rows are written as zeros

    def write(
        self,
        req: Req,
        token_start: int,
        token_end: int,
        staging: torch.Tensor,
        draft: torch.Tensor | None = None,
    ) -> None:
        """Write received KV of tokens [token_start, token_end) into the pages this request
        reserved. `staging` is this rank's heads and layers in the unified order, one head
        per group (`KVHandOff._pack_export`), its first page at `token_start` (aligned), of
        every page of the chunk: a CP-sharded rank writes those it owns. `draft`: the same
        pages of the draft's KV, in its own unified shape (an engine with a draft, which is
        never CP-sharded, needs it; one without refuses it)."""
        remote, ps = req.remote, self.cache.page_size
        draft_pool = self.cache.pools.draft
        if (draft is None) != (draft_pool is None):
            raise ValueError(
                f"KV chunk {'without' if draft is None else 'with'} the draft's KV for an "
                f"engine {'with' if draft is None else 'without'} a speculative draft"
            )
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
        mine = rank_pages(self.cache.pools, dst)  # sharded CP: the pages this rank owns
        if mine.rows:
            move_pages(
                RunView.unified(staging.to(self.device)),
                mine.view,
                torch.tensor(mine.positions, dtype=torch.int64, device=self.device),
                torch.tensor(mine.rows, dtype=torch.int64, device=self.device),
            )
        if draft is not None and draft_pool is not None:
            if self.zero_draft:
                draft = torch.zeros_like(draft)
            move_pages(
                RunView.unified(draft.to(self.device)),
                draft_pool.run_view(1),
                torch.arange(num_pages, dtype=torch.int64, device=self.device),
                torch.tensor(dst, dtype=torch.int64, device=self.device),
            )
        remote.received_end = token_end  # on every rank, whether it owns a page or not

    def finish_received(self, running: list[Req]) -> list[Req]:
        """Requests whose restore and KV reception are both complete start decoding with the
        first token prefill sampled; those that it finishes at once. The caller drops the
        finished ones from `running`."""
        done = []
        for req in running:
            remote = req.remote
            if (
                req.state is not ReqState.RECEIVING
                or req.aborted
                or remote is None
                or remote.first_token is None
                or remote.received_end < req.prompt_len
            ):
                continue
            req.lens.computed_len = req.prompt_len
            if self.cache.pools.draft is not None:  # received (or held) with the target's
                req.draft_len = req.prompt_len
            req.state = ReqState.DECODE
            self.handoff.cache_prompt(req)
            req.append_outputs([remote.first_token], self.eos_token_ids)
            if req.sampling.logprobs is not None:  # prefill sampled it: its logprob is there
                req.logprobs.append((None, ()))
            if req.finish_reason is not None:
                self.handoff.finish(req)
                done.append(req)
        return done
