"""Multi-head latent attention (MLA), simplified from DeepSeek-V2."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.model.attention import causal_attention
from gpu_worker.model.attention_plan import AttentionPlan, DecodeGroup
from gpu_worker.model.config import ModelConfig
from gpu_worker.model.forward_batch import KVCache
from gpu_worker.model.layers import Linear, RMSNorm, TPReduce, apply_rope


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
        kv_cache.set_latent(self.layer_id, plan.new_slot_ids, plan.all_new(latent))
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
