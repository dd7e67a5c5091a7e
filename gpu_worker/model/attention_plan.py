"""What attention reads, planned once per forward pass and reused by every layer: each
request's span of new rows and its slots, and the group of decode rows attended together
(with their runs of consecutive slots, for the in-place decode path).

Under a CP split (`cp_split.py`) a rank attends only its own rows: a request it computes in
part has one span per range of its rows, whose keys end at the range's last query (the
masked keys past it are not read: that is what makes zigzag's early chunk cheap), and its
rows are numbered in the rank's own (T_local, ...) tensors. Each query row is computed the
same way whatever rows share its span: the batch-invariant attention reduces every row on
its own, and keys beyond a row's position are masked to exact zeros, so how far the span's
keys reach does not change the row's bits (the float64 oracle of `tests/test_cp_engine.py`
checks it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.model.cp_split import CPSplit
from gpu_worker.model.forward_batch import ForwardBatch

# Decode rows whose slots form at most this many runs of consecutive slots attend over the
# pool in place (one attention call per run); more fragmented ones are gathered first.
MAX_DECODE_RUNS = 4
IN_PLACE_MAX_THREADS = 1  # several rows attend in place only at up to this many torch threads


@dataclass(frozen=True, slots=True)
class RequestSpan:
    """Where one request's new tokens sit in the batch, and what its attention reads. Under
    a CP split, one range of a rank's share of them: S ends at the range's last query."""

    start: int  # first row of its new tokens in the (T, ...) batch tensors (T_local: split)
    end: int  # one past its last row
    slot_ids: torch.Tensor  # (S,) int64: slots of positions 0..S-1, S the seq_len (or less)
    mask: torch.Tensor  # (n, S) bool: True where one of its n queries may see a key
    lower_right: bool = False  # a split's contiguous range: its queries are the last n of S


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """The requests of a batch that feed one token each (decode steps), attended together:
    one gather of every row's keys into a padded (B, S_max) block and one attention call per
    layer, instead of a gather and a call per request.

    `runs`: when every row's slots form at most `MAX_DECODE_RUNS` runs of consecutive slots
    (fresh pages are handed out in order; a cached prefix adds a run or two), GQA attention
    reads those runs in place from a pool whose slots are contiguous rows (`KVReader.contiguous_slices`), with no gather, one call
    per row and run. At batch 8 and 576 tokens of context the gather and the padded
    attention call cost 53 of a 148 ms decode step on one CPU thread, and the in-place way
    made the step 14% faster; with two threads the one padded call spreads its rows over
    both and the row-by-row calls cannot, so several rows are gathered unless torch runs
    one thread (`benchmarks/bench_decode_attention.py`; BENCHMARKS.md, issue 11)."""

    rows: torch.Tensor  # (B,) int64: their rows in the (T, ...) batch tensors
    slot_ids: torch.Tensor  # (B * S_max,) int64: each row's slots, padded with its first one
    max_len: int  # S_max
    mask: torch.Tensor | None  # (B, 1, 1, S_max) bool: True at real keys; None if no padding
    runs: list[list[tuple[int, int]]] | None = None  # per row: (first slot, count) per run

    @classmethod
    def build(cls, spans: list[RequestSpan], device: torch.device) -> DecodeGroup:
        runs = [_slot_runs(s.slot_ids) for s in spans]
        serial = len(spans) == 1 or torch.get_num_threads() <= IN_PLACE_MAX_THREADS
        in_place = serial and all(len(r) <= MAX_DECODE_RUNS for r in runs)
        max_len = max(len(s.slot_ids) for s in spans)
        padded = torch.stack(
            [
                torch.cat([s.slot_ids, s.slot_ids[:1].expand(max_len - len(s.slot_ids))])
                for s in spans
            ]
        )  # (B, S_max)
        lens = torch.tensor([len(s.slot_ids) for s in spans], device=device)
        mask = None
        if int(lens.min()) < max_len:
            mask = (torch.arange(max_len, device=device)[None, :] < lens[:, None])[:, None, None]
        rows = torch.tensor([s.start for s in spans], device=device)
        return cls(rows, padded.reshape(-1), max_len, mask, runs if in_place else None)


def _slot_runs(slot_ids: torch.Tensor) -> list[tuple[int, int]]:
    """The maximal runs of consecutive slots in `slot_ids`, as (first slot, count)."""
    n = len(slot_ids)
    breaks = torch.nonzero(slot_ids[1:] - slot_ids[:-1] != 1).flatten().add_(1).tolist()
    edges = [0, *breaks, n]
    firsts = slot_ids[edges[:-1]].tolist()
    pairs = zip(firsts, edges[:-1], edges[1:], strict=True)
    return [(first, end - begin) for first, begin, end in pairs]


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """Built once per forward pass, reused by every layer. Requests with several new tokens
    (prefill chunks) attend one by one (`spans`); with `group_decode`, two or more requests
    with one new token each attend together (`decode`). `split`: this rank's share of a
    CP-split batch (the spans are its own rows'; `new_slot_ids` stay every new token's)."""

    spans: list[RequestSpan]
    new_slot_ids: torch.Tensor  # (T,) int64: the slots the new tokens' K/V go to
    last_rows: torch.Tensor  # (batch_size,) int64: row of each request's last new token
    decode: DecodeGroup | None = None
    split: CPSplit | None = None

    def all_new(self, x: torch.Tensor) -> torch.Tensor:
        """A layer's new K/V (or latents) of this rank's rows -> every new token's (T, ...):
        the split's all-gather, or `x` itself without a split."""
        return x if self.split is None else self.split.all_new(x)

    @classmethod
    def build(
        cls,
        batch: ForwardBatch,
        context_len: int,
        group_decode: bool = False,
        split: CPSplit | None = None,
    ) -> AttentionPlan:
        spans: list[RequestSpan] = []
        new_slots: list[torch.Tensor] = []
        start, local, device = 0, 0, batch.input_ids.device
        for i, (seq_len, extend_len, slot_ids) in enumerate(
            zip(batch.seq_lens, batch.extend_lens, batch.slot_ids, strict=True)
        ):
            if not 0 < extend_len <= seq_len <= context_len:
                raise ValueError(
                    f"need 0 < extend_len ({extend_len}) <= seq_len ({seq_len})"
                    f" <= context_len ({context_len})"
                )
            if slot_ids.shape != (seq_len,):
                raise ValueError(f"slot_ids shape {tuple(slot_ids.shape)} != ({seq_len},)")
            prefix_len = seq_len - extend_len
            for rows in [range(extend_len)] if split is None else split.ranges[i]:
                num_keys = prefix_len + rows[-1] + 1  # seq_len unless split
                query_pos = torch.arange(  # (n,)
                    prefix_len + rows.start, prefix_len + rows.stop, rows.step, device=device
                )
                key_pos = torch.arange(num_keys, device=device)  # (num_keys,)
                mask = key_pos[None, :] <= query_pos[:, None]  # (n, num_keys)
                keys = slot_ids if num_keys == seq_len else slot_ids[:num_keys]
                contiguous = split is not None and rows.step == 1
                spans.append(RequestSpan(local, local + len(rows), keys, mask, contiguous))
                local += len(rows)
            new_slots.append(slot_ids[prefix_len:])
            start += extend_len
        if not spans:
            raise ValueError("empty batch")
        if start != batch.input_ids.shape[0]:
            raise ValueError(f"sum(extend_lens) = {start} != {batch.input_ids.shape[0]} tokens")
        ends = torch.tensor(batch.extend_lens, device=device).cumsum(0)
        last_rows = ends - 1  # in the batch: under a split, `CPSplit.last_hidden` reads them
        single = [s for s in spans if s.end - s.start == 1]
        if not group_decode or not single:
            return cls(spans, torch.cat(new_slots), last_rows, split=split)
        others = [s for s in spans if s.end - s.start > 1]
        decode = DecodeGroup.build(single, device)
        return cls(others, torch.cat(new_slots), last_rows, decode, split)
