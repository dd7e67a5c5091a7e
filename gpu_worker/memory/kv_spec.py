"""The shape of one engine's KV: what every pool, layout and kernel agrees on."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVSpec:
    """KV of `num_layers` layers, cut into pages of `page_size` tokens.

    MHA/GQA (`num_kv` 2): per layer a K and a V plane of `num_kv_heads` heads of `head_dim`.
    MLA (`num_kv` 1): per layer one plane of one "head", the latent row (`head_dim` is its
    width), which every TP rank holds whole.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    num_kv: int = 2  # KV planes per layer: 2 (K, V) or 1 (MLA's latent)

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.page_size) <= 0:
            raise ValueError(f"KVSpec sizes must be positive: {self}")
        if self.num_kv not in (1, 2) or (self.num_kv == 1 and self.num_kv_heads != 1):
            raise ValueError(f"KVSpec.num_kv is 2 (K, V) or 1 (one latent head): {self}")

    @property
    def mla(self) -> bool:
        return self.num_kv == 1

    @property
    def page_numel(self) -> int:
        """Elements of one (page, layer, K/V or latent) block."""
        return self.page_size * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page across all layers and KV planes."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.num_kv * self.page_numel * elem

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)
