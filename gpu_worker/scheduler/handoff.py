"""Finishing a request: its KV into the radix tree, the rest of its pages back to the pool.

`KVHandOff` is the one place that moves a request's pages to the tree (after prefill, for
requests behind it; at the end, everything it computed) or frees them, and that packs a P/D
prefill request's KV for the wire before its pages go.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bus_schemas.kv_frame import owned_pages
from bus_schemas.token_ids import TokenIds
from gpu_worker.cache.hicache import PrefixCache
from gpu_worker.cache.tree_node import owner_cycle_break
from gpu_worker.kernels.moves import move_pages
from gpu_worker.kernels.relayout import RunView
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.model.config import ModelConfig
from gpu_worker.scheduler.executor import StepExecutor
from gpu_worker.scheduler.pd_pages import rank_pages
from gpu_worker.scheduler.request import KVExport, Req, ReqState, RequestError


class KVHandOff:
    def __init__(self, cache: PrefixCache, executor: StepExecutor, device: torch.device) -> None:
        self.cache = cache
        self.executor = executor
        self.device = device
        # speculative decoding: the draft's whole config (its shards' shapes on the other
        # ranks) and identity, set by the engine; a P/D export then carries its KV too
        self.draft_config: ModelConfig | None = None
        self.draft_id = ""

    def cache_prompt(self, req: Req) -> None:
        """After prefill, share the prompt's KV through the tree for requests behind it."""
        if not self.cache.config.enable_radix_cache:
            return
        self._insert(req, req.prompt_ids)

    def _insert(self, req: Req, ids: TokenIds) -> None:
        """Insert `ids`' KV from `req`'s pages; `req` then holds the tree's node and pages
        for them (its `cached_len` grows to what the tree holds)."""
        prefix = self.cache.insert(ids, req.page_ids, req.lens.cached_len, req.cache_salt)
        self.cache.lock(prefix.last_node)
        assert req.last_node is not None
        self.cache.unlock(req.last_node)
        req.last_node = prefix.last_node
        req.page_ids[: len(prefix.page_ids)] = prefix.page_ids
        req.lens.cached_len = len(prefix.page_ids) * self.cache.page_size

    def finish(self, req: Req) -> None:
        """Insert the KV the request computed into the tree and release the rest."""
        if req.export_from is not None and req.output_ids and req.error is None:
            req.export = self._pack_export(req)
        kv_len = req.insert_len  # with a draft: only what both models' KV covers
        req.state = ReqState.FINISHED
        if self.cache.config.enable_radix_cache:
            self._insert(req, req.token_ids(kv_len))
        self._release(req)

    def fail(self, req: Req, message: str) -> None:
        """Finish `req` with an internal error; its KV goes back without entering the tree
        (what it computed may be the reason it failed)."""
        req.error = RequestError(message, 500)
        req.finish_reason = "error"
        req.state = ReqState.FINISHED
        self._release(req)

    def _release(self, req: Req) -> None:
        """Unlock the tree node `req` holds and free its own pages (past `cached_len`)."""
        assert req.last_node is not None
        self.cache.unlock(req.last_node)
        self.cache.free(req.page_ids[req.lens.cached_len // self.cache.page_size :])
        req.page_ids, req.last_node = [], None

    def _pack_export(self, req: Req) -> KVExport:
        """P/D prefill: pack the prompt's KV from `export_from` into a staging buffer in the
        unified order, one KV head per group, with the relayout kernel (the wire sends it,
        and a decode engine of any TP x CP x PP layout cuts its ranks' heads and layers from
        it; this request's pages can go). A CP-sharded rank packs only the pages it owns:
        each page leaves from its owner, and rank 0 learns from the owner cycle how many
        pages each CP rank's shard holds."""
        assert req.export_from is not None
        ps = self.cache.page_size
        first_page = req.export_from // ps
        last_page = -(-req.prompt_len // ps)
        src = req.page_ids[first_page:last_page]
        mine = rank_pages(self.cache.pools, src)
        staging = self._pack(mine.view, self.cache.spec, mine.rows)
        layout = self.executor.groups.config
        cp, rotation = 1, 0
        cp_pages: tuple[int, ...] = ()  # sharded CP: the pages of each CP rank's shard
        if layout.kv_sharding:  # page i on CP rank (rotation + i) % cp, as the tree keeps them
            cp, rotation = layout.cp_size, src[0] % layout.cp_size
            broken = owner_cycle_break(src, rotation, cp)
            if broken is not None:
                raise RuntimeError(
                    f"request {req.rid}: exported page {src[broken]} breaks the owner cycle "
                    f"of CP{cp} at page {first_page + broken}"
                )
            cp_pages = tuple(len(owned_pages(len(src), cp, rotation, c)) for c in range(cp))
        ranks, stagings = self.executor.collect_export(staging.cpu(), cp_pages)  # on rank 0
        drafts: tuple[torch.Tensor, ...] = ()
        draft = self.cache.pools.draft
        if draft is not None:  # the draft's KV of the same pages (never CP: no sharding)
            assert self.draft_config is not None and req.draft_len is not None
            if req.draft_len < req.prompt_len:
                raise RuntimeError(
                    f"request {req.rid}: the draft's KV covers {req.draft_len} of the "
                    f"{req.prompt_len} prompt tokens it exports"
                )
            spec = self.cache.pools.members[1].spec
            packed = self._pack(draft.run_view(1), spec, src).cpu()
            _, drafts = self.executor.collect_export(packed, (), self.draft_config)
        first = req.output_ids[0]
        world = layout.kv_layout().world_size  # replicated CP: CP1's
        cp_ranks = tuple(layout.coords(r).cp for r in ranks) if cp > 1 else ()
        return KVExport(
            stagings,
            req.export_from,
            req.prompt_len,
            first,
            ranks,
            world,
            cp,
            rotation,
            cp_ranks,
            drafts,
            self.draft_id,
        )

    def _pack(self, view: RunView, spec: KVSpec, rows: Sequence[int]) -> torch.Tensor:
        """Pages `rows` of a pool (`view`, runs of one KV head) of shape `spec`, packed in
        the unified order with one head per group: (pages, heads, layers, K/V, page, 1,
        head_dim)."""
        staging = torch.empty(
            (
                len(rows),
                spec.num_kv_heads,
                spec.num_layers,
                spec.num_kv,
                spec.page_size,
                1,
                spec.head_dim,
            ),
            dtype=spec.dtype,
            device=self.device,
        )
        if rows:
            move_pages(
                view,
                RunView.unified(staging),
                torch.tensor(rows, dtype=torch.int64, device=self.device),
                torch.arange(len(rows), dtype=torch.int64, device=self.device),
            )
        return staging
