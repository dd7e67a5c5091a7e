"""The building blocks of the decoder: linear layers (batch-invariant or oneDNN-prepacked),
embedding, RMSNorm, rotary embedding and the SwiGLU MLP."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

TPReduce = Callable[[torch.Tensor], torch.Tensor]

INVARIANT_ROWS = 64  # rows per block in the batch-invariant ops: bounds their temporaries
# Float32 CPU weights are reordered once into oneDNN's blocked layout, tuned for this many
# rows (`prepack_weights`): torch's default CPU matmul (MKL) takes a slow path on AMD CPUs,
# where oneDNN's is 2-3x faster at every row count (benchmarks/bench_linear.py).
PACK_ROWS = 8


def can_prepack(weight: torch.Tensor) -> bool:
    """Whether `weight` (out, in) can run as a oneDNN prepacked float32 CPU matmul."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and not weight.is_mkldnn
        and torch.backends.mkldnn.is_available()
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) float32 CPU -> an opaque oneDNN tensor for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with `packed = pack_weight(weight)`; x (..., in)."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


def batch_invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x (T, in) @ weight (out, in).T + bias, each output row reduced on its own, in a fixed
    order, so it does not depend on T (an elementwise product and a last-dim sum per row)."""
    out = torch.cat(
        [
            (x[i : i + INVARIANT_ROWS, None, :] * weight).sum(-1)
            for i in range(0, len(x), INVARIANT_ROWS)
        ]
    )  # (T, out)
    return out if bias is None else out + bias


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and names) that can run batch-invariantly, or with its
    weight prepacked for oneDNN (`prepack`: the parameter then holds the packed tensor, not
    a second copy; `to_dense()` gives the plain one back)."""

    batch_invariant: bool = False

    def prepack(self) -> bool:
        """Reorder a float32 CPU weight for oneDNN in place; False where it cannot be."""
        if self.batch_invariant or not can_prepack(self.weight):
            return False
        self.weight = nn.Parameter(pack_weight(self.weight), requires_grad=False)
        return True

    def unpack(self) -> None:
        if self.weight.is_mkldnn:
            self.weight = nn.Parameter(self.weight.to_dense(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.is_mkldnn:
            return packed_linear(x, self.weight, self.bias)
        if self.batch_invariant:
            return batch_invariant_linear(x, self.weight, self.bias)
        return super().forward(x)


class Embedding(nn.Module):
    """Token embedding (`weight`: (vocab, hidden)) with no initialiser of its own: the
    weights are always filled afterwards, and `nn.Embedding`'s `normal_` on a meta tensor
    imports torch._dynamo (1.6 s of every process start)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (T,) int64 -> (T, embedding_dim)."""
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., dim) -> (..., dim); the mean square is taken in at least float32."""
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (max_len, head_dim) float64 on the CPU, halves repeated (rotate-half
    layout). Always computed on the CPU: under a meta device context (`create_model`) the
    meta kernels would import torch._dynamo, a second of every process start."""
    cpu = torch.device("cpu")
    steps = torch.arange(0, head_dim, 2, dtype=torch.float64, device=cpu)
    inv_freq = 1.0 / theta ** (steps / head_dim)
    positions = torch.arange(max_len, dtype=torch.float64, device=cpu)
    freqs = torch.outer(positions, inv_freq)  # (max_len, D/2)
    angles = torch.cat([freqs, freqs], dim=-1)  # (max_len, head_dim)
    return angles.cos(), angles.sin()


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables up to the context length, cast with the model's dtype."""

    cos: torch.Tensor  # (max_len, head_dim)
    sin: torch.Tensor  # (max_len, head_dim)

    def __init__(self, head_dim: int, max_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_len, self.theta = head_dim, max_len, theta
        self.register_buffer("cos", torch.empty(max_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_len, head_dim), persistent=False)
        self.reset_tables()

    def reset_tables(self) -> None:
        """Recompute the tables (needed after `to_empty`), keeping their device and dtype."""
        cos, sin = rope_tables(self.head_dim, self.max_len, self.theta)
        self.cos = cos.to(device=self.cos.device, dtype=self.cos.dtype)
        self.sin = sin.to(device=self.sin.device, dtype=self.sin.dtype)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) int64 -> cos, sin each (T, 1, head_dim), broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (T, n_heads, head_dim) by cos/sin (T, 1, head_dim), HF rotate-half layout."""
    x1, x2 = x.chunk(2, dim=-1)  # each (T, n_heads, head_dim / 2)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    tp_reduce: TPReduce | None = None  # sums the row-parallel down_proj over the TP group

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out if self.tp_reduce is None else self.tp_reduce(out)
