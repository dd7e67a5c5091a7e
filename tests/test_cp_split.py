"""A prefill's tokens split over the CP ranks (issue 22 build 3, `--cp-split`).

The assignment (`gpu_worker/model/cp_split.py`) as pure functions: every new token on
exactly one rank (or on every rank for a request too short to cut), zigzag's causal work
balanced, and the gather plans that bring the rows back in batch order, simulated here
without a process group; a chunk's attention without its mask (`lower_right_attention`,
the CPU path of a split's contiguous spans) against the masked call. Then real CP worlds:
the engine's ranks compute their share only, and the other two modes (`interleave`, and
`none`: every rank computes every token), and zigzag on an MLA model, give CP1's float64
logits bit for bit as zigzag does in `tests/test_cp_engine.py`.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch
from multirank import Run, run_world
from test_cp_engine import config, make_prompts, reference, workload

from gpu_worker.engine.engine import Engine
from gpu_worker.model.attention import causal_attention, lower_right_attention
from gpu_worker.model.attention_plan import AttentionPlan
from gpu_worker.model.cp_split import CPSplit, CPSplitConfig, RowGather, split_ranges
from gpu_worker.model.forward_batch import ForwardBatch
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.parallel.config import CP_SPLITS, ParallelConfig
from services.engine import flags
from services.engine.config import engine_config_from_args

CPU = torch.device("cpu")


def owners(extend_len: int, cp_size: int, mode: str) -> list[list[int]]:
    """Per new token of one request, the ranks that compute it."""
    got: list[list[int]] = [[] for _ in range(extend_len)]
    for rank in range(cp_size):
        for rows in split_ranges(extend_len, cp_size, rank, mode):
            for t in rows:
                got[t].append(rank)
    return got


@pytest.mark.parametrize("mode", CP_SPLITS)
def test_every_token_on_one_rank_or_on_all(mode: str) -> None:
    for cp_size in (1, 2, 3, 4):
        for extend_len in range(1, 50):
            got = owners(extend_len, cp_size, mode)
            cut = mode != "none" and extend_len >= 2 * cp_size
            if not cut:  # decode rows and short chunks: every rank, as without CP
                assert got == [list(range(cp_size))] * extend_len
                continue
            assert all(len(ranks) == 1 for ranks in got), (mode, cp_size, extend_len)
            counts = [sum(r == [rank] for r in got) for rank in range(cp_size)]
            assert max(counts) - min(counts) <= 2  # near-equal shares
            for rank in range(cp_size):  # ranges are increasing and non-empty
                ranges = split_ranges(extend_len, cp_size, rank, mode)
                assert all(len(r) > 0 for r in ranges)
                assert [t for r in ranges for t in r] == sorted(t for r in ranges for t in r)


def test_zigzag_takes_chunks_r_and_2n_minus_1_minus_r() -> None:
    assert split_ranges(16, 4, 0, "zigzag") == [range(0, 2), range(14, 16)]
    assert split_ranges(16, 4, 3, "zigzag") == [range(6, 8), range(8, 10)]
    assert split_ranges(10, 2, 1, "zigzag") == [range(2, 5), range(5, 7)]
    assert split_ranges(12, 3, 2, "interleave") == [range(2, 12, 3)]
    assert split_ranges(7, 4, 1, "zigzag") == [range(7)]  # too short to cut


def causal_work(ranges: list[range], prefix: int) -> int:
    """Query-key pairs a rank attends: each range's queries over keys up to its last."""
    return sum(len(r) * (prefix + r[-1] + 1) for r in ranges)


@pytest.mark.parametrize("prefix", [0, 1000])
def test_zigzag_balances_causal_work_better_than_contiguous_chunks(prefix: int) -> None:
    n, cp = 8192, 4
    zig = [causal_work(split_ranges(n, cp, r, "zigzag"), prefix) for r in range(cp)]
    assert max(zig) / min(zig) < 1.01
    inter = [causal_work(split_ranges(n, cp, r, "interleave"), prefix) for r in range(cp)]
    assert max(inter) > 1.4 * max(zig) if prefix == 0 else max(inter) > max(zig)
    plain = [causal_work([range(r * n // cp, (r + 1) * n // cp)], prefix) for r in range(cp)]
    assert max(plain) / min(plain) > (1.5 if prefix == 0 else 1.1)


def simulate(splits: list[CPSplit], gather: str, x: torch.Tensor) -> list[torch.Tensor]:
    """What each rank's `RowGather` yields from the batch tensor `x` (T, d), the
    all-gather done by hand: rank r's chunk is its `send` rows, padded to `width`."""

    def gathers(s: CPSplit) -> RowGather:
        return s.kv if gather == "kv" else s.last

    width = gathers(splits[0]).width
    chunks = []
    for s in splits:
        g = gathers(s)
        assert g.width == width  # equal chunks on every rank
        chunk = torch.full((width, x.shape[1]), float("nan"), dtype=x.dtype)
        chunk[: len(g.send)] = x[s.rows][g.send]
        chunks.append(chunk)
    return [torch.cat([*chunks, x[s.rows]])[gathers(s).place] for s in splits]


@pytest.mark.parametrize("mode", ["zigzag", "interleave"])
def test_gather_plans_restore_batch_order(mode: str) -> None:
    """A mixed batch (decode rows, short and long chunks): each rank's rows are its share
    plus every uncut request's, and the gathers give every row (and each request's last)
    in batch order on every rank."""
    extend_lens = [1, 37, 1, 5, 64, 9]
    cp = 4
    cfgs = [CPSplitConfig(mode, r, cp, None) for r in range(cp)]
    splits = [c.build(extend_lens, CPU) for c in cfgs]
    assert all(s is not None for s in splits)
    splits_ = [s for s in splits if s is not None]
    total = sum(extend_lens)
    x = torch.arange(total * 3, dtype=torch.float64).view(total, 3)
    rows = [set(s.rows.tolist()) for s in splits_]
    uncut = {0, 38, 39, 40, 41, 42, 43}  # the decode rows and the 5-token chunk
    assert set.intersection(*rows) == uncut
    assert set.union(*rows) == set(range(total))
    assert sum(len(r - uncut) for r in rows) == total - len(uncut)  # each cut row once
    for got in simulate(splits_, "kv", x):
        assert torch.equal(got, x)
    ends = torch.tensor(extend_lens).cumsum(0) - 1
    for got in simulate(splits_, "last", x):
        assert torch.equal(got, x[ends])
    assert CPSplitConfig(mode, 0, cp, None).build([1, 1, 7], CPU) is None  # nothing cut
    assert CPSplitConfig("none", 0, cp, None).build(extend_lens, CPU) is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_lower_right_attention_equals_the_masked_call(dtype: torch.dtype) -> None:
    """A split chunk's attention without the (n, S) mask: the prefix part and the diagonal
    block joined by their log-sum-exps give the masked SDPA call's result (to rounding)."""
    gen = torch.Generator().manual_seed(3)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for n, seq_len in [(2, 3), (5, 40), (64, 64 * 7), (33, 34)]:
        q = torch.randn((n, 4, 16), generator=gen).to(dtype)
        k, v = (torch.randn((seq_len, 2, 16), generator=gen).to(dtype) for _ in range(2))
        key_pos, query_pos = torch.arange(seq_len), torch.arange(seq_len - n, seq_len)
        mask = key_pos[None, :] <= query_pos[:, None]
        want = causal_attention(q, k, v, mask)
        got = causal_attention(q, k, v, mask, lower_right=True)
        assert got.dtype == dtype and got.shape == want.shape == (n, 4, 16)
        assert torch.allclose(got.double(), want.double(), atol=tol, rtol=tol), (n, seq_len)
        # the same computation as the masked call, not its bits (float64 differs in the last)
        assert torch.equal(got, lower_right_attention(q, k, v))


def test_split_spans_of_contiguous_rows_attend_without_a_mask() -> None:
    """Zigzag's ranges are contiguous (lower_right spans, keys up to their last query);
    interleave's are strided (masked); without a split nothing changes."""
    slots = torch.arange(40)
    batch = ForwardBatch.build([(list(range(30)), 10, slots)], CPU)

    def spans(mode: str) -> list[tuple[int, int, int, bool]]:
        split = CPSplitConfig(mode, 1, 2, None).build(batch.extend_lens, CPU)
        plan = AttentionPlan.build(batch, 64, split=split)
        return [(s.start, s.end, len(s.slot_ids), s.lower_right) for s in plan.spans]

    # 30 new tokens after 10 cached: zigzag chunks 1 and 2 of 4 are tokens 7..14 and 15..21
    assert spans("zigzag") == [(0, 8, 25, True), (8, 15, 32, True)]
    assert spans("interleave") == [(0, 15, 40, False)]  # tokens 1, 3, .., 29
    assert spans("none") == [(0, 30, 40, False)]


def test_cp_split_flag() -> None:
    parser = argparse.ArgumentParser()
    flags.add_engine_args(parser)
    default = engine_config_from_args(parser.parse_args(["--cp-size", "2"]))
    assert default.parallel.cp_split == "zigzag"
    argv = ["--cp-size", "4", "--cp-split", "interleave"]
    assert engine_config_from_args(parser.parse_args(argv)).parallel.cp_split == "interleave"
    assert flags.engine_argv(parser.parse_args(argv)) == argv
    assert flags.CP_SPLITS == CP_SPLITS
    with pytest.raises(SystemExit):  # argparse: not a choice
        parser.parse_args(["--cp-split", "ring"])
    with pytest.raises(ValueError, match="--cp-split must be one of zigzag, interleave, none"):
        ParallelConfig(cp_size=2, cp_split="ring")
    with pytest.raises(ValueError, match="unknown CP split"):
        split_ranges(16, 2, 0, "ring")
    with pytest.raises(ValueError, match="outside a CP group of 2"):
        split_ranges(16, 2, 2, "zigzag")


def prefill_rows(engine: Engine, prompt: list[int]) -> tuple[int, list[int]]:
    """Rank 0's rows of a one-request prefill (the only forward of a 1-token request), and
    the token it sampled."""
    out = engine.run([engine.submit(prompt, SamplingParams(max_new_tokens=1))])[0]
    cached = engine.executor.model._split_of  # (batch, its split) of the last forward
    split = cached[1] if cached else None
    return (len(prompt) if split is None else split.num_rows), out.output_ids


def test_ranks_compute_their_share_only() -> None:
    """CP4 zigzag: rank 0 runs 2 of 8 chunks of a 24-token prompt (one prefill chunk);
    `none` (CP2, a smaller world): all of it."""
    prompt = [(7 * i) % 256 for i in range(24)]
    got = run_world(config(4, True), prefill_rows, prompt)
    none = run_world(config(2, True, split="none"), prefill_rows, prompt)
    assert got[0] == 6 and none[0] == 24
    assert got[1] == none[1]


def cp1_run(model: str, gather: bool) -> Run:
    if model == "tiny":
        return reference(1, None, gather=gather)
    engine = Engine(dataclasses.replace(config(1, False, gather=gather), model=model))
    try:
        return workload(engine, make_prompts())[0]
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("cp", "sharded", "split", "model"),
    [
        (2, True, "none", "tiny"),
        (2, False, "interleave", "tiny"),
        (2, True, "zigzag", "tiny-mla"),  # the gathered rows are latents
    ],
)
def test_none_interleave_and_mla_equal_cp1(cp: int, sharded: bool, split: str, model: str) -> None:
    want = cp1_run(model, gather=sharded)
    cfg = dataclasses.replace(config(cp, sharded, split=split), model=model)
    got = run_world(cfg, workload, make_prompts())[0]
    for (phase, w_out, w_dev, w_host, w_logits), (_, out, dev, host, logits) in zip(
        want, got, strict=True
    ):
        assert (out, dev, host) == (w_out, w_dev, w_host), phase
        assert torch.equal(logits, w_logits), f"{phase}: logits are not bit-identical to CP1"
