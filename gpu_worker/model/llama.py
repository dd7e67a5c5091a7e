"""A Llama/Qwen2-style decoder that reads and writes KV through a `KVCache`.

All linear layers run once over the concatenated new tokens of the batch (T, hidden);
attention runs per request, its new queries over the request's whole cached sequence.

With `batch_invariant` (SGLang's `--enable-deterministic-inference`), every row's result is
bit-identical whatever else is in the batch: torch's CPU matmul and SDPA pick kernels by
shape, so a token computed in a 1-row decode step and in a 64-row prefill chunk differ in
the last bits. The float64 cache oracle needs that invariance to demand identical logits
from a cache hit and a cold run; it costs speed and is off by default.
Module names follow Hugging Face (`layers.{i}.self_attn.q_proj`, ...) so that a checkpoint
maps onto this model by dropping the `model.` prefix.

A tensor- or pipeline-parallel rank runs a shard of this model (`gpu_worker/model/shard.py`):
its `ModelConfig` has the rank's own head counts and MLP width, `layers` are its stage's
(numbered from 0 locally: the KV pool holds only them), only the first stage embeds and only
the last one normalises and computes logits; the row-parallel outputs (`o_proj`,
`down_proj`) are partial sums that `tp_reduce` (an all_reduce over the TP group) completes.

A config with `kv_lora_rank > 0` swaps GQA for `MLAttention`, a simplified multi-head latent
attention (DeepSeek-V2 style, without query compression or weight absorption).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.model.config import ModelConfig
from gpu_worker.model.forward_batch import ForwardBatch, KVCache

TPReduce = Callable[[torch.Tensor], torch.Tensor]

_INVARIANT_ROWS = 64  # rows per block in the batch-invariant ops: bounds their temporaries
# Decode rows whose slots form at most this many runs of consecutive slots attend over the
# pool in place (one attention call per run); more fragmented ones are gathered first.
MAX_DECODE_RUNS = 4
IN_PLACE_MAX_THREADS = 1  # several rows attend in place only at up to this many torch threads
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
            (x[i : i + _INVARIANT_ROWS, None, :] * weight).sum(-1)
            for i in range(0, len(x), _INVARIANT_ROWS)
        ]
    )  # (T, out)
    return out if bias is None else out + bias


def batch_invariant_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Like `causal_attention` (q (n, H, D), k/v (S, H, D) with heads already repeated, mask
    (n, S)), each query row on its own: the result of a row does not depend on n."""
    scale = q.shape[-1] ** -0.5
    rows = []
    for i in range(0, q.shape[0], _INVARIANT_ROWS):
        qb, mb = q[i : i + _INVARIANT_ROWS], mask[i : i + _INVARIANT_ROWS]
        scores = (qb[:, None] * k[None]).sum(-1) * scale  # (b, S, H)
        scores = scores.masked_fill(~mb[:, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=1)  # (b, S, H)
        rows.append((probs[..., None] * v[None]).sum(1))  # (b, H, D)
    return torch.cat(rows)  # (n, H, D)


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


@dataclass(frozen=True, slots=True)
class RequestSpan:
    """Where one request's new tokens sit in the batch, and what its attention reads."""

    start: int  # first row of its new tokens in the (T, ...) batch tensors
    end: int  # one past its last row
    slot_ids: torch.Tensor  # (seq_len,) int64: slots of its positions 0..seq_len-1
    mask: torch.Tensor  # (extend_len, seq_len) bool: True where a query may see a key


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """The requests of a batch that feed one token each (decode steps), attended together:
    one gather of every row's keys into a padded (B, S_max) block and one attention call per
    layer, instead of a gather and a call per request.

    `runs`: when every row's slots form at most `MAX_DECODE_RUNS` runs of consecutive slots
    (fresh pages are handed out in order; a cached prefix adds a run or two), GQA attention
    reads those runs in place from a pool that offers `kv_slice`, with no gather, one call
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
    with one new token each attend together (`decode`)."""

    spans: list[RequestSpan]
    new_slot_ids: torch.Tensor  # (T,) int64: the slots the new tokens' K/V go to
    last_rows: torch.Tensor  # (batch_size,) int64: row of each request's last new token
    decode: DecodeGroup | None = None

    @classmethod
    def build(
        cls, batch: ForwardBatch, context_len: int, group_decode: bool = False
    ) -> AttentionPlan:
        spans: list[RequestSpan] = []
        new_slots: list[torch.Tensor] = []
        start, device = 0, batch.input_ids.device
        for seq_len, extend_len, slot_ids in zip(
            batch.seq_lens, batch.extend_lens, batch.slot_ids, strict=True
        ):
            if not 0 < extend_len <= seq_len <= context_len:
                raise ValueError(
                    f"need 0 < extend_len ({extend_len}) <= seq_len ({seq_len})"
                    f" <= context_len ({context_len})"
                )
            if slot_ids.shape != (seq_len,):
                raise ValueError(f"slot_ids shape {tuple(slot_ids.shape)} != ({seq_len},)")
            prefix_len = seq_len - extend_len
            query_pos = torch.arange(prefix_len, seq_len, device=device)  # (extend_len,)
            key_pos = torch.arange(seq_len, device=device)  # (seq_len,)
            mask = key_pos[None, :] <= query_pos[:, None]  # (extend_len, seq_len)
            spans.append(RequestSpan(start, start + extend_len, slot_ids, mask))
            new_slots.append(slot_ids[prefix_len:])
            start += extend_len
        if not spans:
            raise ValueError("empty batch")
        if start != batch.input_ids.shape[0]:
            raise ValueError(f"sum(extend_lens) = {start} != {batch.input_ids.shape[0]} tokens")
        last_rows = torch.tensor([s.end - 1 for s in spans], device=device)
        single = [s for s in spans if s.end - s.start == 1]
        if not group_decode or not single:
            return cls(spans, torch.cat(new_slots), last_rows)
        others = [s for s in spans if s.end - s.start > 1]
        return cls(others, torch.cat(new_slots), last_rows, DecodeGroup.build(single, device))


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """One request: q (n, n_heads, D), k/v (S, n_kv_heads, D), mask (n, S) -> (n, n_heads, D).

    `mask` is the causal mask of the last n of S positions (`AttentionPlan`'s). SDPA gets
    4-D inputs (torch's fused CPU kernel takes only those; 3-D ones run the math kernel),
    the KV heads unrepeated (`enable_gqa`: no copy of K and V per call), and no mask where
    the shape says what it is: all ones for one query, `is_causal` (which skips the masked
    blocks) for a prompt with no cached prefix; on the CPU both gave the masked call's
    results bit for bit in every shape checked (float32 and float64). On SmolLM2-135M's
    shapes on one CPU thread: a decode row over 576 keys 960 -> 98 us, a 512-token prefill
    32 -> 6 ms (BENCHMARKS.md, issue 11 acceptance 6)."""
    if batch_invariant:
        group_size = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group_size, dim=1)  # (S, n_heads, D)
        v = v.repeat_interleave(group_size, dim=1)  # (S, n_heads, D)
        return batch_invariant_attention(q, k, v, mask)
    n, seq_len = q.shape[0], k.shape[0]
    causal = 1 < n == seq_len
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # (1, n_heads, n, D)
        k.transpose(0, 1)[None],  # (1, n_kv_heads, S, D)
        v.transpose(0, 1)[None],  # (1, n_kv_heads, S, D)
        attn_mask=None if causal or n == 1 else mask,
        is_causal=causal,
        enable_gqa=True,
    )  # (1, n_heads, n, D)
    return out[0].transpose(0, 1)  # (n, n_heads, D)


class Attention(nn.Module):
    """GQA self-attention. Head counts are this module's own (local), so a tensor-parallel
    shard only needs to construct it with fewer heads and slice the weights."""

    batch_invariant: bool = False
    tp_reduce: TPReduce | None = None  # sums the row-parallel o_proj over the TP group

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = config.attention_bias
        self.q_proj = Linear(config.hidden_size, q_size, bias=bias)
        self.k_proj = Linear(config.hidden_size, kv_size, bias=bias)
        self.v_proj = Linear(config.hidden_size, kv_size, bias=bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        plan: AttentionPlan,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden); writes this layer's new K/V into `kv_cache` first."""
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)  # (T, n_heads, head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)  # (T, n_kv_heads, head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)  # (T, n_kv_heads, head_dim)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        kv_cache.set_kv(self.layer_id, plan.new_slot_ids, k, v)
        out = torch.empty_like(q)  # (T, n_heads, head_dim)
        if plan.decode is not None:
            out[plan.decode.rows] = self._decode_attention(q, plan.decode, kv_cache)
        for span in plan.spans:
            k_seq, v_seq = kv_cache.get_kv(self.layer_id, span.slot_ids)  # (S, n_kv_heads, D)
            out[span.start : span.end] = causal_attention(
                q[span.start : span.end], k_seq, v_seq, span.mask, self.batch_invariant
            )
        out = self.o_proj(out.view(T, self.num_heads * self.head_dim))  # (T, hidden)
        return out if self.tp_reduce is None else self.tp_reduce(out)

    def _decode_attention(
        self, q: torch.Tensor, group: DecodeGroup, kv_cache: KVCache
    ) -> torch.Tensor:
        """The decode rows' attention, all at once -> (B, n_heads, head_dim)."""
        kv_slice = getattr(kv_cache, "kv_slice", None)
        if group.runs is not None and kv_slice is not None:
            return self._decode_in_place(q[group.rows], group.runs, kv_slice)
        b, s, h, d = len(group.rows), group.max_len, self.num_kv_heads, self.head_dim
        k, v = kv_cache.get_kv(self.layer_id, group.slot_ids)  # (B * S_max, n_kv_heads, D)
        out = F.scaled_dot_product_attention(
            q[group.rows][:, :, None],  # (B, n_heads, 1, D)
            k.view(b, s, h, d).transpose(1, 2),  # (B, n_kv_heads, S_max, D)
            v.view(b, s, h, d).transpose(1, 2),
            attn_mask=group.mask,
            enable_gqa=True,
        )  # (B, n_heads, 1, D)
        return out[:, :, 0]

    def _decode_in_place(
        self,
        q: torch.Tensor,
        runs: list[list[tuple[int, int]]],
        kv_slice: Callable[[int, int, int], tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """q (B, n_heads, D) of decode rows over their runs of slots, read in place ->
        (B, n_heads, D). The query heads that share a KV head are the rows of one query
        block against it (one query each, no mask: GQA without repeating K and V); a row
        of several runs joins their softmax exactly, from their scores."""
        kvh, d = self.num_kv_heads, self.head_dim
        group = self.num_heads // kvh
        outs = []
        for qi, row_runs in zip(q, runs, strict=True):
            qg = qi.view(1, kvh, group, d)
            kv = [kv_slice(self.layer_id, first, first + n) for first, n in row_runs]
            if len(kv) == 1:
                k, v = kv[0]  # (S, kvh, D) each
                out = F.scaled_dot_product_attention(
                    qg, k.transpose(0, 1)[None], v.transpose(0, 1)[None]
                )  # (1, kvh, group, D)
            else:
                scores = torch.cat([qg[0] @ k.permute(1, 2, 0) for k, _ in kv], dim=-1)
                p = torch.softmax(scores * d**-0.5, dim=-1)  # (kvh, group, S)
                out = torch.zeros_like(qg[0])
                at = 0
                for _, v in kv:
                    n = v.shape[0]
                    out += p[..., at : at + n] @ v.transpose(0, 1)  # (kvh, group, D)
                    at += n
            outs.append(out.reshape(self.num_heads, d))
        return torch.stack(outs)


class MLAttention(nn.Module):
    """Multi-head latent attention, simplified from DeepSeek-V2. Per token:

        c, k_r = split(kv_a_proj(x))                       # (kv_lora_rank,), (rope,)
        latent = [kv_a_layernorm(c), rope(k_r)]            # what the cache holds: one row
        q_h = [q_nope_h, rope(q_rope_h)] = q_proj(x)[h]    # (head_dim + rope,) per head
        k_h = [k_b_proj(c)[h], rope(k_r)]                  # the rotary key part is shared
        v_h = v_b_proj(c)[h]                               # (head_dim,)

    and attention per head as usual over the cached latents, up-projected on every read (no
    weight absorption: simple, and bit-identical whether a latent was just computed or read
    back from any tier). The latent depends on no head, so under TP every rank computes the
    same rows and its query heads' slices of `q_proj`, `k_b_proj`, `v_b_proj` (column-
    parallel) and `o_proj` (row-parallel, completed by `tp_reduce`)."""

    batch_invariant: bool = False
    tp_reduce: TPReduce | None = None

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.kv_lora_rank, self.rope_dim = config.kv_lora_rank, config.qk_rope_head_dim
        h, d, r, c = self.num_heads, self.head_dim, self.rope_dim, self.kv_lora_rank
        self.q_proj = Linear(config.hidden_size, h * (d + r), bias=False)
        self.kv_a_proj = Linear(config.hidden_size, c + r, bias=False)
        self.kv_a_layernorm = RMSNorm(c, config.rms_norm_eps)
        self.k_b_proj = Linear(c, h * d, bias=False)
        self.v_b_proj = Linear(c, h * d, bias=False)
        self.o_proj = Linear(h * d, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        plan: AttentionPlan,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden); writes this layer's new latent rows first."""
        T, h, d, r = x.shape[0], self.num_heads, self.head_dim, self.rope_dim
        q = self.q_proj(x).view(T, h, d + r)  # (T, n_heads, head_dim + rope)
        q = torch.cat([q[..., :d], apply_rope(q[..., d:], *rope)], dim=-1)
        c, k_rope = self.kv_a_proj(x).split([self.kv_lora_rank, r], dim=-1)  # (T, c), (T, r)
        latent = torch.cat(
            [self.kv_a_layernorm(c)[:, None], apply_rope(k_rope[:, None], *rope)], dim=-1
        )  # (T, 1, kv_lora_rank + rope)
        kv_cache.set_latent(self.layer_id, plan.new_slot_ids, latent)
        out = q.new_empty(T, h, d)  # (T, n_heads, head_dim)
        if plan.decode is not None:
            out[plan.decode.rows] = self._decode_attention(q, plan.decode, kv_cache)
        for span in plan.spans:
            k_seq, v_seq = self._expand(kv_cache.get_latent(self.layer_id, span.slot_ids))
            out[span.start : span.end] = causal_attention(
                q[span.start : span.end], k_seq, v_seq, span.mask, self.batch_invariant
            )
        out = self.o_proj(out.view(T, h * d))  # (T, hidden)
        return out if self.tp_reduce is None else self.tp_reduce(out)

    def _expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached latents (S, 1, kv_lora_rank + rope) -> this rank's heads' K (S, n_heads,
        head_dim + rope) and V (S, n_heads, head_dim)."""
        S, h, d = latent.shape[0], self.num_heads, self.head_dim
        c, k_rope = latent[:, 0, : self.kv_lora_rank], latent[:, :, self.kv_lora_rank :]
        k = torch.cat([self.k_b_proj(c).view(S, h, d), k_rope.expand(S, h, self.rope_dim)], dim=-1)
        return k, self.v_b_proj(c).view(S, h, d)

    def _decode_attention(
        self, q: torch.Tensor, group: DecodeGroup, kv_cache: KVCache
    ) -> torch.Tensor:
        """The decode rows' attention, all at once -> (B, n_heads, head_dim)."""
        b, s = len(group.rows), group.max_len
        k, v = self._expand(kv_cache.get_latent(self.layer_id, group.slot_ids))
        out = F.scaled_dot_product_attention(
            q[group.rows][:, :, None],  # (B, n_heads, 1, head_dim + rope)
            k.view(b, s, *k.shape[1:]).transpose(1, 2),  # (B, n_heads, S_max, head_dim + rope)
            v.view(b, s, *v.shape[1:]).transpose(1, 2),  # (B, n_heads, S_max, head_dim)
            attn_mask=group.mask,
        )  # (B, n_heads, 1, head_dim)
        return out[:, :, 0]


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


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = (MLAttention if config.mla else Attention)(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        plan: AttentionPlan,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """h (T, hidden) -> (T, hidden)."""
        h = h + self.self_attn(self.input_layernorm(h), rope, plan, kv_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and lm_head (maybe tied).

    `first_stage` / `last_stage`: which ends of the model this instance holds. A middle or
    last pipeline stage takes hidden states instead of token ids; a first or middle stage
    returns hidden states instead of logits. A whole model is both.
    """

    def __init__(
        self, config: ModelConfig, first_stage: bool = True, last_stage: bool = True
    ) -> None:
        super().__init__()
        self.config = config
        self.first_stage, self.last_stage = first_stage, last_stage
        tied = config.tie_word_embeddings
        self.embed_tokens: Embedding | None = None
        if first_stage or (last_stage and tied):
            self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm: RMSNorm | None = None
        # Tied: the logits reuse `embed_tokens.weight`, so there is no second parameter
        # whose sharing a device move or `to_empty` could silently break.
        self.lm_head: Linear | None = None
        if last_stage:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            if not tied:
                self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.rope_dim, config.context_len, config.rope_theta)
        self.batch_invariant = False  # set_batch_invariant()
        # prepack_weights(): a packed copy of the tied embedding for the logits (the lookup
        # needs the plain one); not a parameter, so checkpoints and shards never see it.
        self.packed_logits: torch.Tensor | None = None
        # decoder layers run so far: grows within a long forward, so a watcher on another
        # thread (the engine service) tells a slow prefill from a hung one
        self.layers_run = 0

    @property
    def num_layers(self) -> int:
        """Layers this instance runs (its stage's, under pipeline parallelism)."""
        return self.config.num_layers

    def set_batch_invariant(self, enabled: bool) -> None:
        """Make every row's result independent of the batch around it (see the module doc)."""
        self.batch_invariant = enabled
        if enabled:
            self.unpack_weights()
        for module in self.modules():
            if isinstance(module, Linear | Attention | MLAttention):
                module.batch_invariant = enabled

    def prepack_weights(self) -> int:
        """Reorder every float32 CPU linear weight (and a tied LM head's) for oneDNN, once
        the weights are final: loaded, sharded and not batch-invariant. Returns how many
        were packed (0 on a GPU, in float64 or without oneDNN)."""
        packed = sum(m.prepack() for m in self.modules() if isinstance(m, Linear))
        embed = self.embed_tokens if self.last_stage and self.lm_head is None else None
        if embed is not None and not self.batch_invariant and can_prepack(embed.weight):
            self.packed_logits = pack_weight(embed.weight)  # the tied LM head
            packed += 1
        return packed

    def unpack_weights(self) -> None:
        """Undo `prepack_weights` (the batch-invariant path needs plain weights)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.unpack()
        self.packed_logits = None

    def set_tp_reduce(self, reduce: TPReduce | None) -> None:
        """Complete the row-parallel outputs with `reduce` (an all_reduce over TP)."""
        for module in self.modules():
            if isinstance(module, Attention | MLAttention | MLP):
                module.tp_reduce = reduce

    @property
    def num_kv_heads(self) -> int:
        """KV heads this model instance stores per layer (what the KV pool must hold)."""
        return self.config.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    def forward(
        self, batch: ForwardBatch, kv_cache: KVCache, hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run the batch's new tokens through this instance's layers, writing their K/V.

        The first stage embeds `batch.input_ids`; a later one starts from `hidden` (T,
        hidden_size), the previous stage's output. Returns hidden states (T, hidden_size) on
        a stage that is not the last, else logits (batch_size, vocab_size) of each request's
        last new token, in the model dtype."""
        plan = AttentionPlan.build(
            batch, self.config.context_len, group_decode=not self.batch_invariant
        )
        rope = self.rotary(batch.positions)  # cos, sin: (T, 1, rope_dim)
        if self.first_stage:
            assert self.embed_tokens is not None
            h = self.embed_tokens(batch.input_ids)  # (T, hidden)
        else:
            if hidden is None or hidden.shape != (len(batch.input_ids), self.config.hidden_size):
                raise ValueError("a later pipeline stage needs the previous stage's hidden states")
            h = hidden
        for layer in self.layers:
            h = layer(h, rope, plan, kv_cache)
            self.layers_run += 1
        if not self.last_stage:
            return h  # (T, hidden)
        assert self.norm is not None
        h = self.norm(h[plan.last_rows])  # (batch_size, hidden)
        return self.compute_logits(h)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Normed hidden states (n, hidden) -> logits (n, vocab_size)."""
        if self.lm_head is None:
            assert self.embed_tokens is not None
            if self.batch_invariant:
                return batch_invariant_linear(h, self.embed_tokens.weight, None)
            if self.packed_logits is not None:
                return packed_linear(h, self.packed_logits, None)
            return F.linear(h, self.embed_tokens.weight)
        return self.lm_head(h)


def _materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give every meta parameter and buffer uninitialised storage on `device` in `dtype`
    (what `.to(dtype).to_empty(device)` does, without the meta-tensor reference kernels that
    import torch's symbolic-shape machinery: most of a second at every process start)."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                data = torch.empty(param.shape, dtype=dtype, device=device)
                module._parameters[name] = nn.Parameter(data, requires_grad=False)
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = torch.empty(buf.shape, dtype=dtype, device=device)


def create_model(
    config: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    batch_invariant: bool = False,
    first_stage: bool = True,
    last_stage: bool = True,
) -> LlamaModel:
    """An inference-only model on `device` in `dtype` whose parameters are NOT initialised:
    the caller must fill every parameter (see `weights.py`). Nothing is allocated twice."""
    with torch.device("meta"):
        model = LlamaModel(config, first_stage, last_stage)
    _materialize(model, torch.device(device), dtype)
    model.rotary.reset_tables()
    model.set_batch_invariant(batch_invariant)
    return model.eval().requires_grad_(False)
