"""P/D decode: KV chunks received from a prefill engine, regrouped for this engine's ranks.

A prefill engine sends each chunk of a request's prompt KV as one shard per sending rank, in
the unified order with one KV head per group (`KVImport.receive`, rank 0). A CP-sharded
prefill engine sends each page from its owner only (page `i` of a chunk on CP rank
`(rotation + i) % cp_size`), so a chunk's shards are those of the ranks owning one of its
pages, each holding its pages: how many shards make a chunk is derived from the sender's
layout, the chunk's size and its rotation, as the sender derives how many it sends. Once
every expected shard of a chunk arrived, rank 0 assembles the whole chunk and cuts it into
this engine's ranks' head and layer ranges and queues one `WriteKV` command; at the start
of the next step every rank writes its own shard into the request's pages
(`KVImport.write`): a CP-sharded rank the pages it owns, the others none, yet every rank
takes part, so their states and the chunk's ACK stay agreed.

With speculative decoding each page of a shard carries the draft model's rows after the
target's (`KVExport.shard_bytes`): the sizes, the regrouping and the write cover both
models, each cut by its own heads and layers, and the draft's rows land in the draft pool
at the same page ids, so the request decodes with the draft's state of the whole prompt
(and a later decode-side reuse hit holds it, as a colocated hit does). Both engines must
run the same draft: a chunk naming another one (`draft`: the digest of the sender's
`draft_of` its frames carry) is refused, naming this engine's draft and the other's
digest.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from bus_schemas.kv_frame import chunk_senders, draft_digest, owned_pages
from gpu_worker.engine.commands import WriteKV
from gpu_worker.engine.config import EngineConfig
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.model.config import ModelConfig
from gpu_worker.model.shard import ModelShard
from gpu_worker.model.weights import model_config_of, weights_digest
from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.scheduler.scheduler import Scheduler
from gpu_worker.scheduler.spec_config import SELF_DRAFT


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
        draft_config: ModelConfig | None = None,
        draft_id: str = "",
    ) -> None:
        """`parallel`: this engine's layout; `queue`: hands a complete chunk's command to
        every rank at the next step; `draft_config`, `draft_id`: the speculative draft's
        whole config and identity (None, "" without one)."""
        self.draft_config = draft_config
        self.draft_id = draft_id
        self.model_config = model_config
        self.kv_spec = kv_spec
        self.parallel = parallel
        self.rank = rank
        self._queue = queue
        # rank 0: the shards of each chunk so far, and the rotation its first shard named
        self._partial: dict[tuple[int, int, int], tuple[WriteKV, int]] = {}

    def receive(
        self,
        rid: int,
        token_start: int,
        token_end: int,
        payload: bytes | memoryview,
        first_token: int | None,
        rank: int = 0,
        sender: ParallelConfig | None = None,
        rotation: int = 0,
        draft: int = 0,
    ) -> WriteKV:
        """Rank 0: take world rank `rank`'s shard of a chunk from a prefill engine of layout
        `sender` (this engine's own when None), whose first page CP rank `rotation` owns
        (a sharded sender's; 0 otherwise); see `Engine.write_kv`. Queues the chunk's
        command once every sender rank's shard is here (`_senders`: under sharded CP, the
        ranks that own a page of it); raises ValueError for a payload of the wrong size, a
        duplicate shard, an unknown rank, a rank that owns none of the chunk's pages, a
        rotation other shards disagree with or a layout that does not split the model,
        changing nothing; and for a chunk whose `draft` (the digest of the sender's draft,
        `draft_digest`, 0 without one) is not this engine's, naming both."""
        mine = draft_digest(self.draft_id)
        if draft != mine:
            theirs = f"digest {draft:016x}" if draft else "none"
            raise ValueError(
                f"KV chunk [{token_start}, {token_end}) comes from a prefill engine whose "
                f"speculative draft is {theirs}; this decode engine's is "
                f"{self.draft_id or 'none'!r} (digest {mine:016x}): both engines must run "
                "the same draft (--speculative-draft-model-path, its quantization and weights)"
            )
        sender = sender or self.parallel
        world = sender.world_size
        if not 0 <= rank < world:
            raise ValueError(f"KV shard of rank {rank}: the sending engine has {world} ranks")
        if token_end <= token_start:
            raise ValueError(f"KV chunk [{token_start}, {token_end}) holds no token")
        cp = sender.cp_size if sender.kv_sharding else 1
        if not 0 <= rotation < cp:
            raise ValueError(f"KV chunk rotation {rotation} is not a CP rank of {cp}")
        num_pages = -(-(token_end - token_start) // self.kv_spec.page_size)
        senders = self._senders(sender, num_pages, rotation)
        if rank not in senders:
            if rank in sender.kv_ranks(self.model_config.mla):
                raise ValueError(
                    f"KV shard of rank {rank}: its CP rank {sender.coords(rank).cp} owns none "
                    f"of the {num_pages} pages of [{token_start}, {token_end}) (page 0 is CP "
                    f"rank {rotation}'s of {cp}), so it sends none"
                )
            raise ValueError(
                f"KV shard of rank {rank}: its latent is TP rank 0's of its stage, which "
                f"sends it once (ranks {list(senders)} send)"
            )
        pages = len(self._sender_pages(sender, rank, num_pages, rotation))
        expected = self._shard_bytes(sender, rank, pages)
        if len(payload) != expected:
            raise ValueError(
                f"KV chunk [{token_start}, {token_end}) of rank {rank} has {len(payload)} "
                f"bytes, expected {max(0, expected)}"
            )
        if first_token is not None and not 0 <= first_token < self.model_config.vocab_size:
            raise ValueError(f"first token {first_token} is outside the vocabulary")
        key = (rid, token_start, token_end)
        cmd, first_rotation = self._partial.get(key, (None, rotation))
        if cmd is None:
            cmd = WriteKV(rid, token_start, token_end, (), first_token)
            cmd.sender = sender
        first = cmd.sender or sender
        if first != sender or first_rotation != rotation:
            raise ValueError(
                f"KV chunk [{token_start}, {token_end}) came from {sender.describe()} (page 0 "
                f"on CP rank {rotation}) and {first.describe()} (on {first_rotation})"
            )
        if rank in cmd.parts:
            raise ValueError(f"KV chunk [{token_start}, {token_end}) of rank {rank} came twice")
        self._partial[key] = cmd, rotation
        cmd.parts[rank] = bytes(payload)
        if first_token is not None:
            cmd.first_token = first_token
        if len(cmd.parts) == len(senders):  # every shard is here: hand it to all ranks
            parts = {r: cmd.parts.pop(r) for r in senders}
            cmd.payloads = self._regroup_kv(parts, sender, num_pages, rotation)
            del self._partial[key]
            self._queue(cmd)
        return cmd

    def _senders(self, sender: ParallelConfig, num_pages: int, rotation: int) -> tuple[int, ...]:
        """The world ranks of `sender` whose shards make a chunk of `num_pages` pages whole:
        `kv_ranks`, and under sharded CP only those whose CP rank owns one of its pages (a
        chunk of fewer pages than CP ranks has no page on the others). Derived, like the
        sender's count of frames, from the layout, the chunk's size and its rotation."""
        ranks = sender.kv_ranks(self.model_config.mla)
        if not sender.kv_sharding:
            return ranks
        owners = set(chunk_senders(num_pages, sender.cp_size, rotation))
        return tuple(r for r in ranks if sender.coords(r).cp in owners)

    def _sender_pages(
        self, sender: ParallelConfig, rank: int, num_pages: int, rotation: int
    ) -> range:
        """The pages of a chunk that world rank `rank` of `sender` sends, in its shard's
        order: every page, or under sharded CP those its CP rank owns."""
        if not sender.kv_sharding:
            return range(num_pages)
        return owned_pages(num_pages, sender.cp_size, rotation, sender.coords(rank).cp)

    def _unified_shape(
        self, parallel: ParallelConfig, rank: int, pages: int, model: ModelConfig | None = None
    ) -> tuple[int, ...]:
        """The shape of rank `rank`'s shard of `pages` pages of KV in the unified order with
        one head per group: (pages, its KV heads, its layers, K/V, token in page, 1,
        head_dim); MLA: (pages, 1, its layers, 1, token in page, 1, latent). `model`: the
        target (None) or the draft."""
        model = model or self.model_config
        local = ModelShard.of(model, parallel, rank).local_config(model)
        return (
            pages,
            local.num_kv_heads,
            local.num_layers,
            local.num_kv,
            self.kv_spec.page_size,
            1,
            local.kv_head_dim,
        )

    def _shard_bytes(self, parallel: ParallelConfig, rank: int, pages: int) -> int:
        """Bytes of rank `rank`'s shard (of an engine of layout `parallel`) of `pages`
        pages of KV, the draft's rows included."""
        size = torch.empty((), dtype=self.kv_spec.dtype).element_size()
        return sum(
            math.prod(self._unified_shape(parallel, rank, pages, m)) * size for m in self._models()
        )

    def _models(self) -> list[ModelConfig]:
        """The models whose KV a shard carries, in its order: the target, maybe the draft."""
        return [self.model_config] + ([self.draft_config] if self.draft_config else [])

    def _split(
        self, data: bytes, parallel: ParallelConfig, rank: int, pages: int
    ) -> list[torch.Tensor]:
        """A shard as sent (page by page, the target's rows then the draft's), cut into one
        tensor per model of `_models`, each in its unified shape."""
        flat = torch.frombuffer(bytearray(data), dtype=self.kv_spec.dtype).view(pages, -1)
        shapes = [self._unified_shape(parallel, rank, pages, m) for m in self._models()]
        widths = [math.prod(s[1:]) for s in shapes]
        return [
            part.reshape(shape).contiguous()
            for part, shape in zip(flat.split(widths, dim=1), shapes, strict=True)
        ]

    def _join(self, parts: list[torch.Tensor]) -> bytes:
        """`_split`'s inverse: the models' tensors of one shard, page by page."""
        n = parts[0].shape[0]
        return torch.cat([p.reshape(n, -1) for p in parts], dim=1).contiguous().numpy().tobytes()

    def _regroup_kv(
        self, parts: dict[int, bytes], sender: ParallelConfig, num_pages: int, rotation: int
    ) -> tuple[bytes, ...]:
        """The sender's shards of a chunk (by world rank: `_senders`), cut into this
        engine's ranks' shards: the whole chunk's (pages, KV heads, layers, ...) is
        assembled from the sender's head and layer ranges (and under sharded CP from each
        CP rank's pages), then each own rank takes its own ranges of every page (a sharded
        rank writes the pages it owns of them). MLA's latent is every TP rank's one head: a
        stage's one shard fills it, and each own TP rank takes all of it."""
        own = self.parallel
        if sender == own and own.cp_size == 1:  # the same cut: r's shard, or its TP rank 0's
            return tuple(
                parts[r] if r in parts else parts[r - r % own.tp_size]
                for r in range(own.world_size)
            )
        dtype = self.kv_spec.dtype
        models = self._models()
        wholes = [
            torch.empty(self._unified_shape(ParallelConfig(), 0, num_pages, m), dtype=dtype)
            for m in models
        ]
        for r, part in parts.items():
            pages = self._sender_pages(sender, r, num_pages, rotation)
            pieces = self._split(part, sender, r, len(pages))
            for m, whole, piece in zip(models, wholes, pieces, strict=True):
                shard = ModelShard.of(m, sender, r)
                heads, layers = _slice(shard.kv_heads(m)), _slice(shard.layers)
                whole[_slice(pages), heads, layers] = piece
        out = []
        for r in range(own.world_size):
            mine = []
            for m, whole in zip(models, wholes, strict=True):
                shard = ModelShard.of(m, own, r)
                mine.append(whole[:, _slice(shard.kv_heads(m)), _slice(shard.layers)])
            out.append(self._join(mine))
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
        pages = -(-(cmd.token_end - cmd.token_start) // self.kv_spec.page_size)
        staging, *draft = self._split(payload, self.parallel, self.rank, pages)
        try:
            scheduler.write_remote_kv(
                req, cmd.token_start, cmd.token_end, staging, draft[0] if draft else None
            )
        except ValueError as e:
            cmd.error = str(e)
            return
        req.remote.received_bytes += len(payload)
        if cmd.first_token is not None:
            req.remote.first_token = cmd.first_token
        cmd.written = len(payload)


def draft_of(config: EngineConfig) -> tuple[str, ModelConfig | None]:
    """The speculative draft's identity and whole config (its shards' KV shapes); "" and
    None without one. The identity is its model (`self` resolved to the target's name: the
    same weights are one draft), re-quantization and weights digest: P/D engines compare it
    on every KV chunk (as a digest, `draft_digest`), since a decode engine must decode with
    the draft whose KV the prefill engine sent."""
    spec = config.spec
    if not spec.enabled or spec.draft_model is None:
        return "", None
    name = config.model if spec.draft_model == SELF_DRAFT else spec.draft_model
    quant = "" if spec.draft_quantization == "none" else f" {spec.draft_quantization}"
    digest = weights_digest(name, config.seed)
    return f"{name}{quant} (weights {digest})", model_config_of(name, config.context_len)


def _slice(r: range) -> slice:
    return slice(r.start, r.stop, r.step)
