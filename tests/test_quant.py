"""The re-quantized self-draft (`gpu_worker/model/quant.py`, issue 23 build 2).

Checked on random weights and the `tiny` preset, in seconds:
- every scheme's round trip: codes in [-qmax, qmax], each weight within scale / 2 of the
  source, each group's largest weight exact in magnitude (its code is +-qmax);
- the reference path (float64, or no prepack) is exactly `F.linear` with the dequantized
  weight; the fast path (float32, prepacked: torch's int4 kernel on one or two planes for few
  rows, oneDNN bfloat16 for more) equals it within bfloat16's error, on both sides of
  `KERNEL_ROWS`;
- `requantize` leaves its input untouched, swaps exactly the decoder linears (the logits
  layer stays float, sharing a tied embedding), keeps prepacking and batch invariance, and
  "none" gives logits equal to the source's bit for bit;
- a quantized model's forward gives logits of the right shape, close to the source's, and
  its batch-invariant float64 rows are bit-identical decoded or prefilled;
- bad schemes and group sizes raise ValueError naming the allowed values;
- the benchmark's speculative chain (`benchmarks/bench_quant_draft.py`): an exact float64
  copy as the draft has every proposal accepted (K + 1 tokens a round, the draft fed the
  last accepted proposal it never saw), and a quantized one fewer.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.memory.device_pool import DeviceKVPool
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.model.config import PRESETS
from gpu_worker.model.forward_batch import ForwardBatch
from gpu_worker.model.layers import MLP, Linear
from gpu_worker.model.llama import LlamaModel, create_model
from gpu_worker.model.quant import (
    KERNEL_ROWS,
    QuantLinear,
    QuantSpec,
    dequantize,
    quantize,
    requantize,
)
from gpu_worker.model.weights import build_model, init_random_weights

SCHEMES = ["int4", "int5", "int6", "int8"]
QMAX = {"int4": 7, "int5": 15, "int6": 31, "int8": 127}


def random_weight(out_f: int = 48, in_f: int = 128, seed: int = 0) -> torch.Tensor:
    """Weights whose groups differ in scale by 100x (a per-tensor scale would show)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=gen, dtype=torch.float64)
    return w * torch.logspace(-2, 0, in_f, dtype=torch.float64)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_round_trip_is_within_half_a_scale_per_group(scheme: str) -> None:
    w = random_weight()
    codes, scales = quantize(w, QuantSpec(scheme, 32))
    assert codes.dtype == torch.int8 and scales.shape == (48, 4)
    assert codes.abs().max() == QMAX[scheme]
    deq = dequantize(codes, scales, 32).double()
    err = (w - deq).abs().reshape(48, 4, 32)
    assert (err <= scales.double()[..., None] / 2 * (1 + 1e-6)).all()
    # the scale is each group's max |w| / qmax: the largest weight is +-qmax exactly
    group_max = w.abs().reshape(48, 4, 32).amax(-1)
    torch.testing.assert_close(scales.double(), group_max / QMAX[scheme], rtol=1e-6, atol=0)


def test_more_bits_give_a_smaller_error_and_a_zero_group_stays_zero() -> None:
    w = random_weight()
    w[:, :32] = 0
    errors = []
    for scheme in SCHEMES:
        codes, scales = quantize(w, QuantSpec(scheme, 32))
        deq = dequantize(codes, scales, 32).double()
        assert (deq[:, :32] == 0).all()
        errors.append((w - deq).abs().max().item())
    assert errors == sorted(errors, reverse=True) and errors[-1] < errors[0] / 10


@pytest.mark.parametrize("scheme", SCHEMES)
def test_reference_path_is_the_dequantized_matmul_exactly(scheme: str) -> None:
    w = random_weight()
    layer = QuantLinear(w, QuantSpec(scheme, 32))
    assert not layer.prepack()  # float64: no fast path
    x = torch.randn(5, 128, dtype=torch.float64)
    codes, scales = quantize(w, QuantSpec(scheme, 32))
    expected = F.linear(x, dequantize(codes, scales, 32).double())
    assert torch.equal(layer(x), expected)


@pytest.mark.parametrize("rows", [1, 2, KERNEL_ROWS, KERNEL_ROWS + 1, 9])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_fast_path_equals_the_dequantized_matmul_within_bfloat16(scheme: str, rows: int) -> None:
    layer = QuantLinear(random_weight().float(), QuantSpec(scheme, 32))
    assert layer.prepack() and layer.packed_bf16 is not None
    assert len(layer.planes) == (1 if scheme == "int4" else 2)
    x = torch.randn(rows, 128)
    expected = F.linear(x.double(), layer.weight.double())
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 48)
    assert ((out.double() - expected).abs().max() / expected.abs().max()).item() < 1.5e-2
    # few rows run torch's int4 kernel, one call per plane; more, oneDNN bfloat16
    x16 = x.to(torch.bfloat16)
    if rows * len(layer.planes) <= KERNEL_ROWS:
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        parts = [mm(x16, packed, 32, sz).float() for packed, sz in layer.planes]
        assert torch.equal(out, parts[0] if len(parts) == 1 else parts[0] + parts[1])
    else:
        onednn = torch.ops.mkldnn._linear_pointwise(x16, layer.packed_bf16, None, "none", [], "")
        assert torch.equal(out, onednn.float())
    layer.unpack()  # back to the float32 reference: exact
    assert torch.equal(layer(x), F.linear(x, layer.weight))


def last_logits(model: LlamaModel, seqs: list[list[int]]) -> torch.Tensor:
    """Logits (len(seqs), vocab) of each sequence's last token, all prefilled in one pass."""
    cfg = model.config
    spec = KVSpec(
        cfg.num_layers,
        cfg.num_kv_heads,
        cfg.head_dim,
        16,
        model.layers[0].mlp.gate_proj.weight.dtype,
    )
    pool = DeviceKVPool(spec, 4 * len(seqs), torch.device("cpu"))
    rows = []
    for i, ids in enumerate(seqs):
        slots = pool.slot_ids(list(range(4 * i, 4 * i + 4)), len(ids))
        rows.append((ids, 0, slots))
    with torch.inference_mode():
        return model(ForwardBatch.build(rows, pool.device), pool)


PROMPTS = [[5, 17, 200, 3, 99, 41], [7, 7, 8, 250, 1], [33] * 9]


def test_requantize_leaves_the_input_untouched_and_swaps_the_decoder_linears() -> None:
    _, source = build_model("tiny", "cpu", torch.float64, seed=3)
    before = {k: v.clone() for k, v in source.state_dict().items()}
    draft = requantize(source, "int4")
    after = source.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any(isinstance(m, QuantLinear) for m in source.modules())
    layers = [m for layer in draft.layers for m in layer.modules() if isinstance(m, Linear)]
    assert len(layers) == 7 * 4 and all(isinstance(m, QuantLinear) for m in layers)
    assert all(m.spec.scheme == "int4" for m in layers)
    assert isinstance(draft.lm_head, QuantLinear) and draft.lm_head.spec.scheme == "float"
    assert source.lm_head is not None and torch.equal(draft.lm_head.weight, source.lm_head.weight)
    q = draft.layers[0].self_attn.q_proj
    assert not torch.equal(q.weight, source.layers[0].self_attn.q_proj.weight)
    assert q.weight.dtype == torch.float64


def test_none_is_a_plain_copy_with_the_same_logits() -> None:
    _, source = build_model("tiny", "cpu", torch.float64, seed=3)
    copy = requantize(source, "none")
    assert copy is not source and not any(isinstance(m, QuantLinear) for m in copy.modules())
    assert copy.embed_tokens is not None and source.embed_tokens is not None
    assert copy.embed_tokens.weight.data_ptr() != source.embed_tokens.weight.data_ptr()
    assert torch.equal(last_logits(copy, PROMPTS), last_logits(source, PROMPTS))


def test_the_copy_keeps_the_source_tp_reduce() -> None:
    """A TP shard's draft must complete its row-parallel sums as the shard does; a reduce
    that doubles stands in for the all_reduce of two equal ranks."""
    _, source = build_model("tiny", "cpu", torch.float64, seed=3)
    plain = last_logits(source, PROMPTS)
    source.set_tp_reduce(lambda t: t * 2)
    reduced = last_logits(source, PROMPTS)
    assert not torch.equal(reduced, plain)
    assert torch.equal(last_logits(requantize(source, "none"), PROMPTS), reduced)
    draft = requantize(source, "int8")
    assert all(m.tp_reduce is not None for m in draft.modules() if isinstance(m, MLP))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_quantized_model_gives_logits_near_the_source(scheme: str) -> None:
    _, source = build_model("tiny", "cpu", torch.float64, seed=3)
    draft = requantize(source, scheme)
    logits, ref = last_logits(draft, PROMPTS), last_logits(source, PROMPTS)
    assert logits.shape == (3, source.config.vocab_size) and logits.dtype == torch.float64
    rel = ((logits - ref).abs().max() / ref.abs().max()).item()
    assert 0 < rel < (0.05 if scheme == "int8" else 0.5)  # tiny's random weights amplify


def test_a_tied_embedding_stays_float_and_shared_by_the_logits() -> None:
    config = dataclasses.replace(PRESETS["tiny"], tie_word_embeddings=True)
    source = create_model(config, "cpu", torch.float64)
    init_random_weights(source, seed=3)
    assert source.lm_head is None
    draft = requantize(source, "int8")
    assert isinstance(draft.lm_head, QuantLinear) and draft.embed_tokens is not None
    assert draft.lm_head.weight is draft.embed_tokens.weight
    assert source.embed_tokens is not None
    assert torch.equal(draft.embed_tokens.weight, source.embed_tokens.weight)
    assert last_logits(draft, PROMPTS).shape == (3, config.vocab_size)


def test_a_prepacked_float32_source_gives_a_prepacked_fast_draft() -> None:
    _, source = build_model("tiny", "cpu", torch.float32, seed=3)  # prepacked by default
    assert source.lm_head is not None and source.lm_head.weight.is_mkldnn
    draft = requantize(source, "int6")
    layers = [m for m in draft.modules() if isinstance(m, QuantLinear)]
    assert all(m.packed_bf16 is not None for m in layers)
    assert all(len(m.planes) == 2 for m in layers if m is not draft.lm_head)
    _, reference = build_model("tiny", "cpu", torch.float64, seed=3)
    expected = last_logits(requantize(reference, "int6"), PROMPTS)
    logits = last_logits(draft, PROMPTS)
    assert logits.dtype == torch.float32 and logits.shape == expected.shape
    assert ((logits.double() - expected).abs().max() / expected.abs().max()).item() < 3e-2


def test_batch_invariant_quantized_rows_are_bit_identical() -> None:
    """The engine's float64 oracle needs a draft row computed alone (decode) and inside a
    batch (prefill) to agree in every bit, as the target's do."""
    _, source = build_model("tiny", "cpu", torch.float64, seed=3, batch_invariant=True)
    draft = requantize(source, "int5")
    assert all(m.batch_invariant for m in draft.modules() if isinstance(m, QuantLinear))
    alone = [last_logits(draft, [ids]) for ids in PROMPTS]
    assert torch.equal(torch.cat(alone), last_logits(draft, PROMPTS))


@pytest.mark.parametrize(
    ("scheme", "group_size", "message"),
    [
        ("int3", 32, "none, int4, int5, int6, int8"),
        ("q4_0", 32, "none, int4, int5, int6, int8"),
        ("int4", 48, "32, 64, 128, 256"),
        ("int8", 0, "32, 64, 128, 256"),
        ("int4", 256, "in groups of 256"),  # tiny's layers have 64 or 128 inputs
    ],
)
def test_bad_schemes_and_group_sizes_are_refused(
    scheme: str, group_size: int, message: str
) -> None:
    _, source = build_model("tiny", "cpu", torch.float64, seed=3)
    with pytest.raises(ValueError, match=message):
        requantize(source, scheme, group_size)


def test_the_bench_chain_accepts_every_proposal_of_an_exact_copy() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from bench_quant_draft import Chain, greedy, run_chain

    _, target = build_model("tiny", "cpu", torch.float64, seed=3, batch_invariant=True)
    prompt = [5, 17, 200, 3, 99, 41, 7, 7]
    seq = prompt + greedy(target, prompt, 23)
    exact, rough = Chain(), Chain()
    run_chain(requantize(target, "none"), seq, len(prompt), 4, exact)
    assert (exact.rounds, exact.proposals, exact.accepted, exact.generated) == (
        5,
        19,
        19,
        23,
    )  # 4 rounds of 4 + 1, then 3 + 0
    run_chain(requantize(target, "int4"), seq, len(prompt), 4, rough)
    assert rough.generated == 23 and rough.rounds > 5 and rough.accepted < rough.proposals
