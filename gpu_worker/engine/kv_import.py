"""P/D decode: KV chunks received from a prefill engine, regrouped for this engine's ranks.

A prefill engine sends each chunk of a request's prompt KV as one shard per sending rank, in
the unified order with one KV head per group (`KVImport.receive`, rank 0). Once every
sender's shard of a chunk arrived, rank 0 cuts the whole chunk into this engine's ranks'
head and layer ranges and queues one `WriteKV` command; at the start of the next step every
rank writes its own shard into the request's pages (`KVImport.write`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from gpu_worker.engine.commands import WriteKV
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.model.config import ModelConfig
from gpu_worker.model.shard import ModelShard
from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.scheduler.scheduler import Scheduler


class KVImport:
    """Rank 0 collects and regroups received KV shards (`receive`); every rank writes its
    own shard of a collected chunk (`write`)."""

    def __init__(
        self,
        model_config: ModelConfig,
        kv_spec: KVSpec,
        parallel: ParallelConfig,
        rank: int,
        queue: Callable[[WriteKV], None],
    ) -> None:
        """`parallel`: this engine's layout; `queue`: hands a complete chunk's command to
        every rank at the next step."""
        self.model_config = model_config
        self.kv_spec = kv_spec
        self.parallel = parallel
        self.rank = rank
        self._queue = queue
        self._partial: dict[tuple[int, int, int], WriteKV] = {}  # rank 0: shards so far

    def receive(
        self,
        rid: int,
        token_start: int,
        token_end: int,
        payload: bytes | memoryview,
        first_token: int | None,
        rank: int = 0,
        sender: ParallelConfig | None = None,
    ) -> WriteKV:
        """Rank 0: take world rank `rank`'s shard of a chunk from a prefill engine of layout
        `sender` (this engine's own when None); see `Engine.write_kv`. Queues the chunk's
        command once every sender rank's shard is here; raises ValueError for a payload of
        the wrong size, a duplicate shard, an unknown rank or a layout that does not split
        the model, changing nothing."""
        sender = sender or self.parallel
        world = sender.world_size
        if not 0 <= rank < world:
            raise ValueError(f"KV shard of rank {rank}: the sending engine has {world} ranks")
        senders = sender.kv_ranks(self.model_config.mla)
        if rank not in senders:
            raise ValueError(
                f"KV shard of rank {rank}: its latent is TP rank 0's of its stage, which "
                f"sends it once (ranks {list(senders)} send)"
            )
        expected = self._shard_kv_bytes(sender, rank, token_start, token_end)
        if token_end <= token_start or len(payload) != expected:
            raise ValueError(
                f"KV chunk [{token_start}, {token_end}) of rank {rank} has {len(payload)} "
                f"bytes, expected {max(0, expected)}"
            )
        if first_token is not None and not 0 <= first_token < self.model_config.vocab_size:
            raise ValueError(f"first token {first_token} is outside the vocabulary")
        key = (rid, token_start, token_end)
        cmd = self._partial.get(key)
        if cmd is None:
            cmd = self._partial[key] = WriteKV(rid, token_start, token_end, (), first_token)
            cmd.sender = sender
        first = cmd.sender or sender
        if first != sender:
            raise ValueError(
                f"KV chunk [{token_start}, {token_end}) came from TP {sender.tp_size} x PP "
                f"{sender.pp_size} and TP {first.tp_size} x PP {first.pp_size}"
            )
        if rank in cmd.parts:
            raise ValueError(f"KV chunk [{token_start}, {token_end}) of rank {rank} came twice")
        cmd.parts[rank] = bytes(payload)
        if first_token is not None:
            cmd.first_token = first_token
        if len(cmd.parts) == len(senders):  # every shard is here: hand it to all ranks
            parts = {r: cmd.parts.pop(r) for r in senders}
            cmd.payloads = self._regroup_kv(parts, sender, token_end - token_start)
            del self._partial[key]
            self._queue(cmd)
        return cmd

    def _unified_shape(
        self, parallel: ParallelConfig, rank: int, num_tokens: int
    ) -> tuple[int, ...]:
        """The shape of rank `rank`'s shard of a KV chunk of `num_tokens` tokens in the
        unified order with one head per group: (pages, its KV heads, its layers, K/V, token
        in page, 1, head_dim); MLA: (pages, 1, its layers, 1, token in page, 1, latent)."""
        local = ModelShard.of(self.model_config, parallel, rank).local_config(self.model_config)
        ps = self.kv_spec.page_size
        pages = -(-num_tokens // ps)
        return (
            pages,
            local.num_kv_heads,
            local.num_layers,
            local.num_kv,
            ps,
            1,
            local.kv_head_dim,
        )

    def _shard_kv_bytes(
        self, parallel: ParallelConfig, rank: int, token_start: int, token_end: int
    ) -> int:
        """Bytes of rank `rank`'s shard (of an engine of layout `parallel`) of the KV of
        tokens [token_start, token_end)."""
        shape = self._unified_shape(parallel, rank, token_end - token_start)
        return math.prod(shape) * torch.empty((), dtype=self.kv_spec.dtype).element_size()

    def _regroup_kv(
        self, parts: dict[int, bytes], sender: ParallelConfig, num_tokens: int
    ) -> tuple[bytes, ...]:
        """The sender's shards of a chunk (by world rank: `kv_ranks`), cut into this
        engine's ranks' shards: the whole chunk's (pages, KV heads, layers, ...) is
        assembled from the sender's head and layer ranges, then each own rank takes its own
        ranges. MLA's latent is every TP rank's one head: a stage's one shard fills it, and
        each own TP rank takes all of it."""
        own = self.parallel
        if sender == own and own.cp_size == 1:  # the same cut: r's shard, or its TP rank 0's
            return tuple(
                parts[r] if r in parts else parts[r - r % own.tp_size]
                for r in range(own.world_size)
            )
        dtype = self.kv_spec.dtype
        whole = torch.empty(self._unified_shape(ParallelConfig(), 0, num_tokens), dtype=dtype)
        for r, part in parts.items():
            shard = ModelShard.of(self.model_config, sender, r)
            heads, layers = _slice(shard.kv_heads(self.model_config)), _slice(shard.layers)
            piece = torch.frombuffer(bytearray(part), dtype=dtype)
            whole[:, heads, layers] = piece.view(self._unified_shape(sender, r, num_tokens))
        out = []
        for r in range(own.world_size):
            shard = ModelShard.of(self.model_config, own, r)
            mine = whole[:, _slice(shard.kv_heads(self.model_config)), _slice(shard.layers)]
            out.append(mine.contiguous().numpy().tobytes())
        return tuple(out)

    def write(self, cmd: WriteKV, scheduler: Scheduler) -> None:
        """Every rank: write this rank's shard of a collected chunk into its request's
        pages; the results (`applied`, `error`, `written`) land on rank 0's command."""
        cmd.applied = True
        req = next((r for r in scheduler.running if r.rid == cmd.rid), None)
        if req is None or req.remote is None:
            cmd.error = f"no P/D decode request {cmd.rid} is waiting for KV"
            return
        payload = cmd.payloads[self.rank]
        shape = self._unified_shape(self.parallel, self.rank, cmd.token_end - cmd.token_start)
        staging = torch.frombuffer(bytearray(payload), dtype=self.kv_spec.dtype).view(shape)
        try:
            scheduler.write_remote_kv(req, cmd.token_start, cmd.token_end, staging)
        except ValueError as e:
            cmd.error = str(e)
            return
        req.remote.received_bytes += len(payload)
        if cmd.first_token is not None:
            req.remote.first_token = cmd.first_token
        cmd.written = len(payload)


def _slice(r: range) -> slice:
    return slice(r.start, r.stop)
