"""What one forward pass reads: the ragged batch and the KV cache it attends over (through
`KVCache`, whose `KVReader` part is the per-layer hook and the in-place capability)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class KVReader(Protocol):
    """How attention reads KV beyond writes and slot gathers: a hook before each layer's
    attention, and whether slots may be read as runs of pool rows in place.

    `before_attention` is where a pool makes a layer's KV readable: a context-parallel pool
    gathers the pages other ranks own, a layer-wise load waits for that layer's copy. The
    model calls it once per layer of every forward pass, before the layer runs, and
    `after_layers` once after its last layer.
    """

    @property
    def contiguous_slices(self) -> bool:
        """Whether consecutive slots are consecutive rows of the pool, so `kv_slice` may
        read a run of them in place (decode attention's fast path)."""
        ...

    def before_attention(self, layer: int, batch: ForwardBatch) -> None:
        """Make `layer`'s KV of `batch`'s sequences readable (no-op where it always is)."""
        ...

    def after_layers(self, batch: ForwardBatch) -> None:
        """The pass's last layer has attended (a CP pool ends its reads of peers' rows)."""
        ...

    def kv_slice(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of slots `start..end-1` as views of the pool ((n, num_kv_heads, head_dim)
        each, no copy); only where `contiguous_slices`."""
        ...


class KVCache(KVReader, Protocol):
    """The model's only view of KV memory: slots in, tensors out.

    Slots are token-granular row indices into the device pool (page `p` covers slots
    `[p * page_size, (p + 1) * page_size)`). A pool may translate slots (CP sharding does).
    MHA/GQA models use `set_kv`/`get_kv`; MLA models (one latent row per token, no separate
    K and V) use `set_latent`/`get_latent`.
    """

    def set_kv(self, layer: int, slot_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V of shape (n, num_kv_heads, head_dim) into `slot_ids` (n,) int64."""
        ...

    def get_kv(self, layer: int, slot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Read K/V of shape (n, num_kv_heads, head_dim) from `slot_ids` (n,) int64."""
        ...

    def set_latent(self, layer: int, slot_ids: torch.Tensor, latent: torch.Tensor) -> None:
        """MLA: write latent rows of shape (n, 1, latent_dim) into `slot_ids` (n,) int64."""
        ...

    def get_latent(self, layer: int, slot_ids: torch.Tensor) -> torch.Tensor:
        """MLA: read latent rows of shape (n, 1, latent_dim) from `slot_ids` (n,) int64."""
        ...


@dataclass(slots=True)
class ForwardBatch:
    """One forward pass over a ragged batch of requests (prefill chunks and decode steps).

    Request `i` already has `seq_lens[i] - extend_lens[i]` tokens of KV in the cache (its
    prefix) and adds `extend_lens[i]` new tokens in this pass. Its new K/V go to
    `slot_ids[i][seq_lens[i] - extend_lens[i]:]`, and its attention reads all of
    `slot_ids[i]` causally.
    """

    input_ids: torch.Tensor  # (T,) int64: new tokens of every request, concatenated
    positions: torch.Tensor  # (T,) int64: their positions within their request
    seq_lens: list[int]  # per request: prefix + new tokens after this pass
    extend_lens: list[int]  # per request: new tokens in this pass; sum == T
    slot_ids: list[torch.Tensor]  # per request: (seq_lens[i],) int64 slots of positions 0..
    # rows of the batch whose logits the model returns, in this order (speculative decoding's
    # verify reads every new position); None: each request's last new token
    logit_rows: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @classmethod
    def build(
        cls, seqs: list[tuple[list[int], int, torch.Tensor]], device: torch.device
    ) -> ForwardBatch:
        """From `(new_token_ids, prefix_len, slot_ids)` per request."""
        ids: list[int] = []
        pos: list[int] = []
        seq_lens, extend_lens, slots = [], [], []
        for new_ids, prefix_len, slot_ids in seqs:
            ids.extend(new_ids)
            pos.extend(range(prefix_len, prefix_len + len(new_ids)))
            seq_lens.append(prefix_len + len(new_ids))
            extend_lens.append(len(new_ids))
            slots.append(slot_ids)
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.tensor(pos, dtype=torch.int64, device=device),
            seq_lens=seq_lens,
            extend_lens=extend_lens,
            slot_ids=slots,
        )
