"""The shape of one engine's KV: what every pool, layout and kernel agrees on."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVSpec:
    """MHA/GQA KV of `num_layers` layers, cut into pages of `page_size` tokens."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.page_size) <= 0:
            raise ValueError(f"KVSpec sizes must be positive: {self}")

    @property
    def page_numel(self) -> int:
        """Elements of one (page, layer, K or V) block."""
        return self.page_size * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page across all layers, K and V."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.page_numel * elem

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)
