"""Which CP rank computes which new tokens of a batch, and the gathers that make the split
invisible to everything after the model (`parallel/config.py`, `--cp-split`).

A request with `extend_len` new tokens is cut independently of its pages' owners:
`zigzag` gives rank r chunks r and `2N - 1 - r` of `2N` near-equal chunks (causal work
grows with a token's position, so an early chunk and a late one balance), `interleave`
gives it tokens r, r + N, .... A request shorter than `2N` new tokens (decode rows above
all) is computed by every rank, as without CP: cutting it would leave ranks idle and add a
gather to every decode step for no compute saved.

Each rank runs its rows of the batch (`CPSplit.rows`, in batch order) through the layers.
Per layer, `all_new` all-gathers the K/V (or MLA latents) of the split rows over the CP
group and puts them, with the rows every rank computed itself, back in batch order: every
rank then writes the whole chunk's K/V as without the split (the sharded pool keeps its
owned rows and stages the rest, the replicated pool writes all), and attends its own
queries. At the end `last_hidden` brings every request's last hidden state to every rank
(smaller than its logits: hidden_size against vocab_size values a row), so every rank
computes the same logits from the same rows and samples the same token.

The gathers are copies (bytes, as the sharded pool's), every chunk padded to the most rows
one rank sends, so they are bit-exact; with batch-invariant float64 a row's math does not
depend on the rows around it, and a split engine's logits equal CP1's bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def split_ranges(extend_len: int, cp_size: int, cp_rank: int, mode: str) -> list[range]:
    """The new tokens (0-based, within the request) rank `cp_rank` computes, as ranges in
    increasing order. Every rank gets all of them when the request is not cut."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"CP rank {cp_rank} is outside a CP group of {cp_size}")
    if mode == "none" or extend_len < 2 * cp_size:
        return [range(extend_len)]
    if mode == "zigzag":
        n = 2 * cp_size
        first, last = cp_rank, n - 1 - cp_rank
        return [range(k * extend_len // n, (k + 1) * extend_len // n) for k in (first, last)]
    if mode == "interleave":
        return [range(cp_rank, extend_len, cp_size)]
    raise ValueError(f"unknown CP split {mode!r}")


@dataclass(frozen=True, slots=True, eq=False)
class RowGather:
    """Some rows of a batch tensor, each computed by one rank or by every rank, brought to
    every rank in a given order. Chunk `r` of the all-gather holds rank r's rows, padded to
    `width`; `place` indexes the concatenation (gathered chunks, this rank's rows)."""

    send: torch.Tensor  # (k,) int64: this rank's rows (local indices) it contributes
    width: int  # the most rows one rank contributes (0: no gather at all)
    place: torch.Tensor  # (n,) int64: each wanted row's row in cat(gathered, local)

    def to(self, device: torch.device) -> RowGather:
        return RowGather(self.send.to(device), self.width, self.place.to(device))

    def __call__(
        self, x: torch.Tensor, group: dist.ProcessGroup | None, cp_size: int
    ) -> torch.Tensor:
        """x (T_local, ...) of this rank's rows -> (n, ...) the wanted rows, on every rank."""
        if self.width == 0:
            return x.index_select(0, self.place)
        send = x.new_zeros((self.width, *x.shape[1:]))
        send[: len(self.send)] = x.index_select(0, self.send)
        out = x.new_empty((cp_size * self.width, *x.shape[1:]))
        # bytes: bit-exact, and a dtype every backend moves
        dist.all_gather_single(
            out.view(-1).view(torch.uint8), send.view(-1).view(torch.uint8), group=group
        )
        return torch.cat([out, x]).index_select(0, self.place)


@dataclass(frozen=True, slots=True, eq=False)
class CPSplit:
    """One batch's split, as seen by one rank (the same plan on every rank of the group:
    it depends only on the batch's `extend_lens`)."""

    ranges: list[list[range]]  # per request: the new tokens this rank computes
    rows: torch.Tensor  # (T_local,) int64: this rank's rows of the batch, in batch order
    kv: RowGather  # every row of the batch, in batch order
    last: RowGather  # each request's last row, in request order
    group: dist.ProcessGroup | None
    cp_size: int

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def all_new(self, x: torch.Tensor) -> torch.Tensor:
        """A layer's new K/V (or latents) of this rank's rows (T_local, ...) -> every new
        token's, in batch order (T, ...)."""
        return self.kv(x, self.group, self.cp_size)

    def last_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states of this rank's rows (T_local, hidden) -> each request's last one
        (batch_size, hidden), the same on every rank."""
        return self.last(h, self.group, self.cp_size)


@dataclass(frozen=True, slots=True)
class CPSplitConfig:
    """How this rank splits batches: the mode, its place in the CP group, the group."""

    mode: str
    cp_rank: int
    cp_size: int
    group: dist.ProcessGroup | None

    def build(self, extend_lens: list[int], device: torch.device) -> CPSplit | None:
        """The split of a batch with these `extend_lens`; None when no request is cut (every
        rank computes every row: nothing to gather)."""
        n = self.cp_size
        if self.mode == "none" or max(extend_lens, default=0) < 2 * n:
            return None  # decode steps above all: nothing to cut, no per-request work
        per_rank = [[split_ranges(e, n, r, self.mode) for e in extend_lens] for r in range(n)]
        cut = [per_rank[0][i] != [range(e)] for i, e in enumerate(extend_lens)]
        if not any(cut):
            return None
        # the rank that computes each row, -1 for every rank; built on the host (a batch's
        # few ranges), moved to `device` once
        owner = torch.full((sum(extend_lens),), -1, dtype=torch.int64)
        start = 0
        for i, e in enumerate(extend_lens):
            for r in range(n) if cut[i] else ():
                for rg in per_rank[r][i]:
                    owner[start + rg.start : start + rg.stop : rg.step] = r
            start += e
        mine = (owner == -1) | (owner == self.cp_rank)
        rows = mine.nonzero().flatten()  # batch order
        local = torch.full_like(owner, -1)  # each row's index among this rank's, or -1
        local[rows] = torch.arange(len(rows))  # (integer index_put: fast)
        ends = torch.tensor(extend_lens).cumsum(0) - 1
        everything = torch.arange(len(owner))
        return CPSplit(
            per_rank[self.cp_rank],
            rows.to(device),
            self._gather(everything, owner, local).to(device),
            self._gather(ends, owner, local).to(device),
            self.group,
            n,
        )

    def _gather(self, wanted: torch.Tensor, owner: torch.Tensor, local: torch.Tensor) -> RowGather:
        """The `RowGather` of batch rows `wanted` (in the order they are wanted)."""
        by = owner[wanted]  # (n,) the rank that sends each wanted row, -1: every rank has it
        pos = local[wanted]  # a row every rank has: its local index
        counts = [0] * self.cp_size
        for r in range(self.cp_size):
            sent = by == r
            upto = sent.cumsum(0)  # (a bool mask's index_put is ~100x slower)
            counts[r] = int(upto[-1]) if len(upto) else 0
            pos = torch.where(sent, upto - 1, pos)  # its place in rank r's chunk
        width = max(counts)
        place = torch.where(by >= 0, by * width + pos, self.cp_size * width + pos)
        return RowGather(local[wanted[by == self.cp_rank]], width, place)
