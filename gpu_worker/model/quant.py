"""A re-quantized copy of a model: the speculative-decoding self-draft (issue 23, build 2).

`requantize(model, "int4")` returns a new model whose decoder linear layers (attention
projections and MLP) hold the source's weights rounded symmetrically, per group of
`group_size` input channels, to int4, int5, int6 or int8: per group, `scale = max|w| / qmax`
(qmax = 2^(bits-1) - 1) and `code = round(w / scale)` in [-qmax, qmax], so every weight is
within scale / 2 of the source's. The draft's KV then differs from the target's, as a real
draft's does, while its greedy tokens mostly agree: on SmolLM2-135M-Instruct, group 32,
K = 4 (`benchmarks/bench_quant_draft.py`), 46% of proposals accepted at int4, 69% at int5,
86% at int6, 95% at int8. int5, int6 and int8 cost the same (two kernel planes), so int8
is the draft to use; int4 (one plane) is faster but accepts too few to pay for itself.

The embedding and the logits projection (the LM head, or SmolLM2's tied embedding) are not
quantized: the lookup reads one row per token (nothing to speed up), and the argmax over
49,152 logits is where a rounding error turns straight into a rejected proposal. The logits
run through a `QuantLinear` of scheme "float" that shares the source's weight and, on the
fast path, multiplies in bfloat16 (half the bytes of the 28M-weight matrix, the largest
single matmul of a SmolLM2 step).

Two ways to run a `QuantLinear` (`x` (..., in) -> (..., out), the model's dtype):
- reference: `F.linear` (or the batch-invariant product) with the dequantized weight
  `codes * scale` in the model's dtype: exact, in float64 too, and no faster than float;
- fast (after `prepack`, float32 CPU models only): torch's int4 kernel
  `_weight_int4pack_mm_for_cpu` on bfloat16 activations for few rows, else a oneDNN
  bfloat16 matmul with the dequantized weight. Measured on this torch (2.13.0+cpu, AMD EPYC
  with AVX-512 BF16, one thread, SmolLM2's 210 decoder linears): float32 oneDNN 35 ms per
  pass at 1 row; the int4 kernel 8.5 ms at 1 row, 13 ms at 4, 24 ms at 8; oneDNN bfloat16
  19-23 ms at 1 to 8 rows; the int8 kernel `_weight_int8pack_mm` 16.5 ms at 1 row but 46 at
  8, with one scale per output channel only; both integer kernels take 3-40x longer on
  float32 activations than on bfloat16 ones, so the fast path always casts to bfloat16.
  An int5, int6 or int8 code `q` runs as two int4 "planes" (`q = 16 hi + lo`, each a
  4-bit code with its own per-group scale and zero: `int4_planes`), so every scheme keeps
  its exact codes in the kernel; two planes cost two int4 calls, which beat oneDNN bfloat16 at 1-2
  rows only (`KERNEL_ROWS`). The fast path's error is bfloat16's (activations, scales and,
  above `KERNEL_ROWS`, the dequantized weight rounded to 8 significant bits).

Where a 1-row SmolLM2 decode forward spends its time (torch profiler, same machine): the
float32 target 48 ms, 41 of them in its oneDNN linears; the int8 draft 24 ms (12.7 in the
int4 kernel's two planes, 3.5 in the bfloat16 logits, ~1.5 in the casts, ~6 in attention,
norms and the rest); the int4 draft 16 ms (6.3 in the kernel). The ~6 ms outside the
matmuls, the same in both models, is what keeps a draft above a third of the target.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.model.layers import MLP, PACK_ROWS, Linear, batch_invariant_linear
from gpu_worker.model.llama import LlamaModel, create_model

SCHEMES = ("none", "int4", "int5", "int6", "int8")
BITS = {"int4": 4, "int5": 5, "int6": 6, "int8": 8}
# Group sizes torch's int4 CPU kernel takes (each must also divide the layer's in-features).
GROUP_SIZES = (32, 64, 128, 256)
# Rows x int4 planes up to which the int4 kernel beats oneDNN bfloat16 (measured above):
# int4 (one plane) up to 4 rows, two-plane schemes up to 2.
KERNEL_ROWS = 4
PLANE_BITS = 4


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """How one layer's weight is stored: `scheme` ("float": not quantized) and group size."""

    scheme: str
    group_size: int

    @property
    def qmax(self) -> int:
        """The largest code magnitude: codes lie in [-qmax, qmax]."""
        return 2 ** (BITS[self.scheme] - 1) - 1

    @property
    def num_planes(self) -> int:
        """int4 planes the kernel runs (1 for int4, 2 for int5..int8, 0 for float)."""
        return 0 if self.scheme == "float" else -(-BITS[self.scheme] // PLANE_BITS)


def quantize(weight: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float -> codes (out, in) int8 in [-qmax, qmax] and scales (out, in / g)
    float32, symmetric per group of g input channels: `weight ~ codes * scales` per group,
    each weight within scale / 2 (an all-zero group gets scale 1 and codes 0)."""
    out_f, in_f = weight.shape
    groups = weight.detach().to(torch.float32).reshape(out_f, in_f // spec.group_size, -1)
    scales = groups.abs().amax(-1) / spec.qmax  # (out, in / g)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(groups / scales[..., None]).clamp(-spec.qmax, spec.qmax)
    return codes.reshape(out_f, in_f).to(torch.int8), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """codes (out, in) int8, scales (out, in / g) -> (out, in) float32 `codes * scale`."""
    out_f, in_f = codes.shape
    groups = codes.to(torch.float32).reshape(out_f, in_f // group_size, group_size)
    return (groups * scales[..., None]).reshape(out_f, in_f)


def int4_planes(
    codes: torch.Tensor, scales: torch.Tensor, spec: QuantSpec
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The operands of `_weight_int4pack_mm_for_cpu` whose results sum to `x @ W.T`, W the
    dequantized weight: per plane, the packed 4-bit codes and scales_and_zeros (in / g,
    out, 2) bfloat16. The kernel dequantizes a code c as `(c - 8) * scale + zero`. int4: one
    plane, c = q + 8, scale s, zero 0. Wider codes split as `q = 16 hi + lo`, lo = q mod 16
    in [0, 15] and hi in [-8, 7] (q in [-128, 127]): the low plane (c = lo, scale s, zero
    8 s) gives s lo, the high one (c = hi + 8, scale 16 s, zero 0) 16 s hi. The only zero is
    small (8 s): larger ones (an unsigned high plane) cancel to a bfloat16 rounding error
    times the group's sum of inputs."""
    q = codes.to(torch.int32)  # (out, in) in [-qmax, qmax]
    s = scales.t()  # (in / g, out)
    zero = torch.zeros_like(s)
    if spec.num_planes == 1:
        planes = [(q + 8, s, zero)]
    else:
        lo = torch.remainder(q, 16)
        planes = [(lo, s, 8 * s), (torch.div(q - lo, 16, rounding_mode="floor") + 8, 16 * s, zero)]
    return [
        (
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(c.contiguous(), 1),
            torch.stack([scale, z], -1).to(torch.bfloat16).contiguous(),
        )
        for c, scale, z in planes
    ]


class QuantLinear(Linear):
    """A bias-free linear layer whose `weight` parameter holds the dequantized weight (in
    the model's dtype: the reference and batch-invariant paths use it as any `Linear` does,
    and checkpoints and digests see a plain tensor); `codes` and `scales` hold the
    quantization itself (absent for "float"). `prepack` adds the fast path's operands (see
    the module doc) without replacing `weight`, which the logits layer shares with a tied
    embedding; `unpack` drops them."""

    def __init__(self, weight: torch.Tensor, spec: QuantSpec) -> None:
        nn.Module.__init__(self)  # nn.Linear's own init would allocate and initialise
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.spec = spec
        self.register_parameter("bias", None)
        self.codes: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        if spec.scheme == "float":  # the same Parameter: a tied embedding's stays shared
            self.weight = (
                weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, False)
            )
        else:
            self.codes, self.scales = quantize(weight, spec)
            deq = dequantize(self.codes, self.scales, spec.group_size)
            self.weight = nn.Parameter(deq.to(weight.dtype), requires_grad=False)
        self.planes: list[tuple[torch.Tensor, torch.Tensor]] = []  # int4 kernel operands
        self.packed_bf16: torch.Tensor | None = None  # oneDNN bfloat16 weight

    def prepack(self) -> bool:
        """Build the fast path (float32 CPU weights with oneDNN only); False where not."""
        w = self.weight
        if self.batch_invariant or w.device.type != "cpu" or w.dtype != torch.float32:
            return False
        if not torch.backends.mkldnn.is_available():
            return False
        if self.codes is not None and self.scales is not None:
            self.planes = int4_planes(self.codes, self.scales, self.spec)
        bf16 = w.detach().to(torch.bfloat16)
        self.packed_bf16 = torch.ops.mkldnn._reorder_linear_weight(bf16, PACK_ROWS)
        return True

    def unpack(self) -> None:
        self.planes, self.packed_bf16 = [], None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_bf16 is None:
            if self.batch_invariant:
                return batch_invariant_linear(x, self.weight, None)
            return F.linear(x, self.weight)
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # (n, in)
        if self.planes and len(rows) * len(self.planes) <= KERNEL_ROWS:
            g = self.spec.group_size
            mm = torch.ops.aten._weight_int4pack_mm_for_cpu
            parts = [mm(rows, packed, g, sz).to(x.dtype) for packed, sz in self.planes]
            out = parts[0] if len(parts) == 1 else parts[0] + parts[1]
        else:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_bf16, None, "none", [], "")
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def check_scheme(scheme: str, group_size: int) -> None:
    """Raise ValueError naming the allowed values for a bad scheme or group size."""
    if scheme not in SCHEMES:
        raise ValueError(f"quantization scheme {scheme!r}: expected one of {', '.join(SCHEMES)}")
    if group_size not in GROUP_SIZES:
        sizes = ", ".join(map(str, GROUP_SIZES))
        raise ValueError(f"quantization group size {group_size}: expected one of {sizes}")


def requantize(model: LlamaModel, scheme: str, group_size: int = 32) -> LlamaModel:
    """A new model with `model`'s weights, its decoder linears re-quantized to `scheme`
    (the module doc says how and what is left in float); "none" gives a plain copy. The
    input is untouched. The copy has the source's device, dtype, stages, batch invariance,
    TP reduce and CP split (a TP or PP shard's draft is the same shard of the draft: the
    group size must divide the shard's in-features), and is prepacked (`prepack_weights`) exactly when the source is. Raises ValueError for a bad
    scheme, a bad group size, or a group size that does not divide a layer's in-features."""
    check_scheme(scheme, group_size)
    state = {k: v.to_dense() if v.is_mkldnn else v for k, v in model.state_dict().items()}
    ref = next(v for v in state.values() if v.is_floating_point())
    copy = create_model(
        model.config, ref.device, ref.dtype, model.batch_invariant, model.first_stage,
        model.last_stage,
    )  # fmt: skip
    copy.load_state_dict(state)
    copy.set_tp_reduce(next((m.tp_reduce for m in model.modules() if isinstance(m, MLP)), None))
    copy.set_cp_split(model.cp_split)
    prepacked = any(m.weight.is_mkldnn for m in model.modules() if isinstance(m, Linear))
    prepacked = prepacked or model.packed_logits is not None
    if scheme != "none":
        quantize_layers(copy, QuantSpec(scheme, group_size))
    if prepacked:
        copy.prepack_weights()
    return copy


def quantize_layers(model: LlamaModel, spec: QuantSpec) -> None:
    """Swap every decoder `Linear` of `model` for a `QuantLinear` of `spec`, and its logits
    projection for a "float" one (sharing a tied embedding's weight)."""
    for layer in model.layers:
        named = [(n, m) for n, m in layer.named_modules() if isinstance(m, Linear)]
        for name, linear in named:
            if linear.bias is not None or linear.in_features % spec.group_size:
                raise ValueError(
                    f"cannot quantize {name} ({linear.in_features} inputs, bias "
                    f"{linear.bias is not None}) in groups of {spec.group_size}"
                )
            parent_name, _, child = name.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            setattr(parent, child, quantized(linear, spec))
    if model.last_stage:
        source = model.lm_head if model.lm_head is not None else model.embed_tokens
        assert source is not None
        model.lm_head = QuantLinear(source.weight, QuantSpec("float", spec.group_size))
        model.lm_head.batch_invariant = model.batch_invariant
        model.packed_logits = None


def quantized(linear: Linear, spec: QuantSpec) -> QuantLinear:
    """`linear` as a `QuantLinear` of `spec`, keeping its batch invariance."""
    layer = QuantLinear(linear.weight, spec)
    layer.batch_invariant = linear.batch_invariant
    return layer
