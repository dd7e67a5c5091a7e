"""The CP gather's scratch buffers in the admission budget (issue 22, build 4).

A sharded pool whose transport is the collective (`--cp-gather-transport collective`, and
every GPU; the CPU `shm` transport reads the owners' rows and has no scratch buffer, so no
budget) all-gathers, before each layer's attention, every prefix page of the step's
batch into one of its scratch buffers (`memory/sharded_pool.py`, `CPGatherPlan`): `N * M`
gathered pages (`M`: the most prefix pages one rank owns), the pages that hold only the
step's new tokens, and one trash page, in each of its buffers. The buffers grow to the
largest plan they served and stay, so what must stay within `--cp-gather-buffer-mb` is the
largest plan any step can make. Admission decides it, before a request joins the running
set, from a bound that every later step of that set keeps to:

- every page a running request reads or writes is reserved when it is admitted
  (`Req.page_ids`), so a step's gathered pages are a subset of `U`, the union of the
  running requests' pages, and `M <= max_owned(U)`;
- a step's staged pages hold only its new tokens: a prefill chunk of `c` tokens fills at
  most `ceil(c / p)` pages it does not share with its prefix and chunks sum to at most
  `chunked_prefill_size`, a decode row at most one; and they are pages of `U` too.

So a step's plan has at most `N * max_owned(U) + min(|U|, C // p + R) + 1` scratch pages,
with `C` the chunked prefill size and `R` the running requests. The bound reads only page
ids, counts and the config, which every rank holds alike, so every CP (and TP, PP) rank
takes the same decision; the admission's consensus record carries it.

A request that would push the bound past the budget waits (first come, first served, like
the page budget), until running requests finish. One whose bound alone is past it could
never run: it fails with a clear error instead of waiting forever.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpu_worker.memory.allocator import PageId


@dataclass(frozen=True, slots=True)
class GatherBudget:
    """The scratch pages one plan may have (every buffer sized for it within the budget)."""

    max_scratch_pages: int
    cp_size: int  # N: owner classes, page q on rank q % N
    page_size: int
    chunked_prefill_size: int
    budget_mb: float  # for the error message

    def scratch_pages(self, num_pages: int, max_owned: int, num_requests: int) -> int:
        """The bound on a step's scratch pages for `num_pages` distinct pages of
        `num_requests` requests, at most `max_owned` of them of one owner class."""
        staged = min(num_pages, self.chunked_prefill_size // self.page_size + num_requests)
        return self.cp_size * max_owned + staged + 1

    def alone(self, num_pages: int) -> int:
        """The bound for one request of `num_pages` path pages running alone: page `i` of
        a path is of owner class `i % N`."""
        return self.scratch_pages(num_pages, -(-num_pages // self.cp_size), 1)

    def with_request(
        self,
        running_page_ids: Iterable[Sequence[PageId]],
        num_running: int,
        prefix_page_ids: Sequence[PageId],
        num_new_pages: int,
    ) -> int:
        """The bound for the running requests' pages plus one more request: its matched
        prefix `prefix_page_ids` (maybe shared) and `num_new_pages` fresh pages continuing
        the prefix's owner cycle."""
        union: set[int] = set(prefix_page_ids)
        for ids in running_page_ids:
            union.update(ids)
        n = self.cp_size
        counts = [0] * n
        for q in union:
            counts[q % n] += 1
        base, extra = divmod(num_new_pages, n)
        first = len(prefix_page_ids) % n
        for o in range(n):
            counts[o] += base + int((o - first) % n < extra)
        return self.scratch_pages(len(union) + num_new_pages, max(counts), num_running + 1)

    def too_big(self, num_pages: int) -> str:
        """Why a request of `num_pages` path pages can never be admitted."""
        need = self.alone(num_pages)
        return (
            f"the request needs {need} pages of CP gather scratch ({num_pages} pages of "
            f"{self.page_size} tokens over {self.cp_size} ranks, both buffers) and "
            f"--cp-gather-buffer-mb {self.budget_mb:g} holds {self.max_scratch_pages}: "
            "shorten the prompt or max_tokens, or raise --cp-gather-buffer-mb"
        )
