"""GQA self-attention over the KV cache: per request for prefill chunks, grouped (or in
place, over runs of consecutive slots) for decode rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.model.attention_plan import AttentionPlan, DecodeGroup
from gpu_worker.model.config import ModelConfig
from gpu_worker.model.forward_batch import KVCache
from gpu_worker.model.layers import INVARIANT_ROWS, Linear, TPReduce, apply_rope


def batch_invariant_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Like `causal_attention` (q (n, H, D), k/v (S, H, D) with heads already repeated, mask
    (n, S)), each query row on its own: the result of a row does not depend on n."""
    scale = q.shape[-1] ** -0.5
    rows = []
    for i in range(0, q.shape[0], INVARIANT_ROWS):
        qb, mb = q[i : i + INVARIANT_ROWS], mask[i : i + INVARIANT_ROWS]
        scores = (qb[:, None] * k[None]).sum(-1) * scale  # (b, S, H)
        scores = scores.masked_fill(~mb[:, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=1)  # (b, S, H)
        rows.append((probs[..., None] * v[None]).sum(1))  # (b, H, D)
    return torch.cat(rows)  # (n, H, D)


def lower_right_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q (n, n_heads, D), the queries of the last n of S positions, each over the keys up to
    its own of k/v (S, n_kv_heads, D) -> (n, n_heads, D): causal attention aligned at the
    bottom right (a CP split's chunk of a request, `AttentionPlan`). SDPA's `is_causal`
    aligns at the top left, and an explicit (n, S) mask makes torch's CPU kernel twice as
    slow per score (5 -> 10 ns on one thread here) as a call without. So the keys before the
    queries (all visible: no mask) and the square diagonal block (`is_causal`) run apart;
    their softmaxes are joined by their log-sum-exps (the CPU flash kernel's second output,
    which takes the KV heads unrepeated as SDPA's `enable_gqa` does). CPU only."""
    n, seq_len = q.shape[0], k.shape[0]
    first = seq_len - n  # the queries' first position
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    qh = q.transpose(0, 1)[None]  # (1, n_heads, n, D)
    kh, vh = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # (1, n_kv_heads, S, D)
    before, lse_before = flash(qh, kh[:, :, :first], vh[:, :, :first], 0.0, False)
    diag, lse_diag = flash(qh, kh[:, :, first:], vh[:, :, first:], 0.0, True)
    top = torch.maximum(lse_before, lse_diag)  # (1, n_heads, n), float32 or float64
    w_before, w_diag = (lse_before - top).exp()[..., None], (lse_diag - top).exp()[..., None]
    out = (before * w_before + diag * w_diag) / (w_before + w_diag)  # (1, n_heads, n, D)
    return out[0].transpose(0, 1).to(q.dtype)  # (n, n_heads, D)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    batch_invariant: bool = False,
    lower_right: bool = False,
) -> torch.Tensor:
    """One request: q (n, n_heads, D), k/v (S, n_kv_heads, D), mask (n, S) -> (n, n_heads, D).

    `mask` is the causal mask of the last n of S positions (`AttentionPlan`'s). SDPA gets
    4-D inputs (torch's fused CPU kernel takes only those; 3-D ones run the math kernel),
    the KV heads unrepeated (`enable_gqa`: no copy of K and V per call), and no mask where
    the shape says what it is: all ones for one query, `is_causal` (which skips the masked
    blocks) for a prompt with no cached prefix; on the CPU both gave the masked call's
    results bit for bit in every shape checked (float32 and float64). On SmolLM2-135M's
    shapes on one CPU thread: a decode row over 576 keys 960 -> 98 us, a 512-token prefill
    32 -> 6 ms (BENCHMARKS.md, issue 11 acceptance 6). `lower_right`: the queries are the
    last n of S positions, in order (the mask is the causal one aligned at the bottom
    right): on the CPU they run without the mask (`lower_right_attention`)."""
    if batch_invariant:
        group_size = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group_size, dim=1)  # (S, n_heads, D)
        v = v.repeat_interleave(group_size, dim=1)  # (S, n_heads, D)
        return batch_invariant_attention(q, k, v, mask)
    n, seq_len = q.shape[0], k.shape[0]
    if lower_right and 1 < n < seq_len and q.device.type == "cpu":
        return lower_right_attention(q, k, v)
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
        """x (T, hidden) -> (T, hidden); writes this layer's new K/V into `kv_cache` first
        (under a CP split: x holds this rank's rows, and the K/V written are every rank's)."""
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)  # (T, n_heads, head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)  # (T, n_kv_heads, head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)  # (T, n_kv_heads, head_dim)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if plan.split is not None:  # this rank's rows -> every new token's, on every rank
            kv = plan.all_new(torch.stack([k, v], dim=1))  # (T_all, 2, n_kv_heads, head_dim)
            k, v = kv[:, 0], kv[:, 1]
        kv_cache.set_kv(self.layer_id, plan.new_slot_ids, k, v)
        out = torch.empty_like(q)  # (T, n_heads, head_dim)
        if plan.decode is not None:
            out[plan.decode.rows] = self._decode_attention(q, plan.decode, kv_cache)
        for span in plan.spans:
            k_seq, v_seq = kv_cache.get_kv(self.layer_id, span.slot_ids)  # (S, n_kv_heads, D)
            out[span.start : span.end] = causal_attention(
                q[span.start : span.end],
                k_seq,
                v_seq,
                span.mask,
                self.batch_invariant,
                span.lower_right,
            )
        out = self.o_proj(out.view(T, self.num_heads * self.head_dim))  # (T, hidden)
        return out if self.tp_reduce is None else self.tp_reduce(out)

    def _decode_attention(
        self, q: torch.Tensor, group: DecodeGroup, kv_cache: KVCache
    ) -> torch.Tensor:
        """The decode rows' attention, all at once -> (B, n_heads, head_dim)."""
        if group.runs is not None and kv_cache.contiguous_slices:
            return self._decode_in_place(q[group.rows], group.runs, kv_cache)
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
        kv_cache: KVCache,
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
            kv = [kv_cache.kv_slice(self.layer_id, first, first + n) for first, n in row_runs]
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
