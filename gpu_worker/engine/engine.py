"""The engine API: generate, flush_cache, cache statistics, on rank 0 of the engine's world.

An engine is one model replica in one `torch.distributed` world of TP x CP x PP ranks, built by
the launcher (`gpu_worker/engine/rank.py`) and passed in as `ParallelGroups`; a world of one
needs no process group at all. Rank 0 takes every input (`submit`, `abort`, `flush_cache`,
`write_kv`, ...) as a typed command (`commands.py`); at the start of each step it hands the
list to every rank with the agreed count of ready transfer ACKs (`parallel/sync.py`), and
every rank consumes those ACKs, applies the commands in order and runs the same scheduler
step. The other ranks run `follow()` until rank 0 sends `Stop`.

Its parts, one job each: `config.py` (the frozen config), `pending.py` (rank 0's command
list), `apply.py` (a step's commands on a rank), `kv_import.py` (P/D KV received from a
prefill engine), `storage_setup.py` (the L3 backend and object layout of a rank) and
`driver.py` (when a loop on rank 0 steps and when it sleeps: `run`, and the service's
runner, drive the engine through a `StepLoop`; the engine only answers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import secrets
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from bus_schemas.page_hash import make_namespace
from bus_schemas.token_ids import as_token_ids
from gpu_worker.cache.hicache import PrefixCache
from gpu_worker.consensus import checker as consensus
from gpu_worker.engine.apply import CommandApplier
from gpu_worker.engine.commands import Abort, AddRequest, Drain, EvictDevice, Flush, Stop, WriteKV
from gpu_worker.engine.config import DebugHooks as DebugHooks
from gpu_worker.engine.config import EngineConfig
from gpu_worker.engine.draft import pool_group, spec_decoder
from gpu_worker.engine.driver import KEEPALIVE_S, Outlook, StepLoop, StepResult, Wake
from gpu_worker.engine.executor import ModelExecutor
from gpu_worker.engine.kv_import import KVImport, draft_of
from gpu_worker.engine.pending import PendingCommands
from gpu_worker.engine.storage_setup import storage_backend, storage_layout
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.memory.pool_group import KVSharding
from gpu_worker.model.config import PRESETS, parse_dtype
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.model.tokenizer import load_tokenizer
from gpu_worker.model.weights import build_model, weights_digest
from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.parallel.groups import ParallelGroups, rank_device
from gpu_worker.parallel.sync import StepSync, agree_min
from gpu_worker.scheduler.request import GenerateOutput, RemoteKV, Req, ReqState
from gpu_worker.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)


class InvalidRequestError(ValueError):
    """A request the engine refuses before it touches any state."""


class Engine:
    def __init__(self, config: EngineConfig, groups: ParallelGroups | None = None) -> None:
        """`groups`: this rank's place in the engine's world, from the launcher; None for a
        world of one."""
        groups = groups or ParallelGroups.single()
        if groups.config != config.parallel:
            raise ValueError(
                f"the world is {groups.config.describe()}, the config asks for "
                f"{config.parallel.describe()}"
            )
        self.config = config
        self.groups = groups
        self.rank = groups.rank
        self.device = rank_device(config.device, groups.local_index)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dtype = parse_dtype(config.dtype)
        self.model_config, self.model = build_model(
            config.model,
            self.device,
            dtype,
            seed=config.seed,
            batch_invariant=config.batch_invariant,
            context_len=config.context_len,
            parallel=config.parallel,
            rank=self.rank,
        )
        if self.rank == 0 and str(config.model) in PRESETS:
            log.info("serving random weights (preset %s): outputs are noise", config.model)
        if groups.tp is not None:
            tp = groups.tp
            self.model.set_tp_reduce(lambda t: _all_reduce(t, tp))
        self.tokenizer = load_tokenizer(config.model)
        mc, local = self.model_config, self.model.config  # the whole model, this rank's shard
        self.context_len = min(config.context_len or mc.context_len, mc.context_len)
        self.kv_spec = KVSpec(
            local.num_layers,
            local.num_kv_heads,
            local.kv_head_dim,
            config.cache.page_size,
            dtype,
            local.num_kv,
        )
        # the weights digest: KV of other weights under the same --model name never matches
        weights = weights_digest(config.model, config.seed)
        self.namespace = make_namespace(config.model, config.dtype, config.cache.page_size, weights)
        host_pages = None
        if config.cache.enable_hierarchical_cache:  # bytes per page differ between stages
            shards = config.parallel.cp_size if config.parallel.kv_sharding else 1
            host_pages = agree_min(groups, config.cache.num_host_pages(self.kv_spec, shards))
        # the engine's KV pools over one slot mapping: a draft model's would join the group.
        # Sharded CP: --max-total-tokens is the logical pool; this rank holds 1/N of its rows,
        # and the tree and allocator keep every path's pages on the owner cycle
        sharding = _sharding(config, groups)
        owners = 1 if sharding is None else sharding.cp_size
        pools, self.draft_model, draft_len = pool_group(
            config, mc, self.kv_spec, self.device, owners, sharding, self.rank
        )
        self.context_len = min(self.context_len, draft_len)
        if host_pages is not None and config.cache.hicache_size_gb > 0:  # a draft's rows too
            host_pages = max(1, host_pages * self.kv_spec.bytes_per_page // pools.bytes_per_page)
        if config.debug.gather_reads:
            pools.device.contiguous_slices = False
        self.cache = PrefixCache(
            config.cache,
            self.kv_spec,
            self.device,
            self.namespace,
            num_host_pages=host_pages,
            delay_seed=7919 * self.rank,
            record_events=self.rank == 0,  # rank 0 publishes the KV events
            storage=storage_backend(config.cache),
            storage_layout=storage_layout(config, mc, self.rank, pools.draft_member)
            if config.cache.hicache_storage_backend is not None
            else None,
            storage_groups=(groups.storage_hit, groups.storage_progress, groups.storage_write),
            rank=self.rank,
            pools=pools,
            cp_size=owners,
        )
        # a request reserves pages for every token it may write, so the longest one this
        # engine serves is also bounded by its device pool (SGLang's max request length)
        pool_len = self.cache.device_pool.num_pages * config.cache.page_size
        self._context_bound = ""  # what bounds the context length, when it is not the model
        if pool_len < self.context_len:
            self.context_len = pool_len
            self._context_bound = (
                f" (its device pool: {self.cache.device_pool.num_pages} pages of "
                f"{config.cache.page_size} tokens)"
            )
        self.consensus = consensus.recorder_for(groups)  # None unless HICACHE_RANK_CONSENSUS
        consensus.attach(self.consensus)
        self.sync = StepSync(groups, config.debug.disable_agreement)
        self.executor = ModelExecutor(
            self.model, groups, self.device, mc, guard_tp=self.consensus is not None
        )
        self.spec = spec_decoder(config, self.draft_model, pools, self.executor, groups)
        self.scheduler = Scheduler(
            config.scheduler,
            self.executor,
            self.cache,
            mc.eos_token_ids,
            self.device,
            perturb_sampler=config.debug.perturb_sampler,
            perturb_rotation=config.debug.perturb_owner_rotation_rank == self.rank,
            spec=self.spec,
        )
        delay = config.debug.layer_delay(self.rank)
        if delay is not None:
            for layer in self.model.layers:
                layer.register_forward_pre_hook(lambda _m, _a: time.sleep(delay()))
        self._commands = PendingCommands(self.cache, config.cache, self.kv_spec)  # rank 0
        # P/D with a draft: its KV crosses the wire with the target's, of the same draft
        self.draft_id, draft = draft_of(config)
        self.scheduler.handoff.draft_config, self.scheduler.handoff.draft_id = draft, self.draft_id
        queue = self._commands.put
        self.kv_import = KVImport(
            mc, self.kv_spec, config.parallel, self.rank, queue, draft, self.draft_id
        )
        self._applier = CommandApplier(
            self.scheduler, self.cache, self.kv_import, self.rank, config.debug
        )
        self._next_rid = 0
        self.wake = Wake()  # rung by transfer and storage workers when an ACK's work is done
        self.cache.acks.set_listener(self.wake.ring)

    # ----------------------------------------------------------------- requests

    def validate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> list[int]:
        """Check a request; raises InvalidRequestError with a clear message, changes nothing."""
        if not isinstance(sampling, SamplingParams):
            raise InvalidRequestError("sampling must be a SamplingParams")
        ids = list(prompt_ids)
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(
                    f"prompt token {i} is {t!r}: token ids must be integers in [0, {vocab})"
                )
        total = len(ids) + sampling.max_new_tokens
        if total > self.context_len:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) "
                f"exceeds the context length {self.context_len}{self._context_bound}"
            )
        return ids

    def submit(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        cache_salt: str = "",
    ) -> Req:
        sampling = sampling or SamplingParams()
        ids = self.validate(prompt_ids, sampling)
        if not isinstance(cache_salt, str):
            raise InvalidRequestError("cache_salt must be a string")
        if sampling.seed is None:  # drawn once here, so every rank samples the same token
            sampling = dataclasses.replace(sampling, seed=secrets.randbits(63))
        req = Req(self._next_rid, as_token_ids(ids), sampling, cache_salt)
        self._next_rid += 1
        self._commands.put(AddRequest(req))
        return req

    # ----------------------------------------------------------------- P/D

    def submit_decode(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        cache_salt: str = "",
        reuse: bool = True,
    ) -> Req:
        """A P/D decode request: its prompt KV comes from a prefill engine (`write_kv`);
        with speculative decoding, the draft's KV of the prompt with it."""
        req = self.submit(prompt_ids, sampling, cache_salt)
        req.remote = RemoteKV(reuse=reuse and self.config.cache.enable_radix_cache)
        return req

    def submit_prefill(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, cache_salt: str, export_from: int
    ) -> Req:
        """A P/D prefill request: compute the prompt, sample one token, and pack the KV from
        `export_from` on (`req.export` when it finishes; every rank's shard on rank 0, a
        CP-sharded rank's holding the pages it owns; with a draft, the draft's KV of the
        same pages, `KVExport.draft_stagings`)."""
        ps = self.kv_spec.page_size
        ids = self.validate(prompt_ids, sampling)
        if not 0 <= export_from < len(ids) or export_from % ps:
            raise InvalidRequestError(
                f"decode_prefix_len {export_from} must be page-aligned and below the prompt "
                f"length {len(ids)}"
            )
        one = dataclasses.replace(sampling, max_new_tokens=1)
        req = self.submit(ids, one, cache_salt)
        req.export_from = export_from
        return req

    def write_kv(
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
        """Queue a received KV chunk for decode request `rid`: world rank `rank`'s shard of
        it from a prefill engine of layout `sender` (this engine's own when None), in the
        unified order with one KV head per group; from a CP-sharded sender, the shard holds
        the chunk's pages its CP rank owns, page 0 being CP rank `rotation`'s. Once every
        sender rank's shard arrived, the chunk is cut into this engine's ranks' heads and
        layers (nothing to cut when the layouts are the same) and written on every rank at
        the start of the next step (a CP-sharded rank writes the pages it owns); the
        returned command (one per chunk) then holds the bytes written or why it did not fit
        (`applied`). A payload of the wrong size, a duplicate shard, an unknown rank, a rank
        that owns none of the chunk's pages or a layout that does not split the model
        raises ValueError now, and so does a chunk from an engine whose speculative draft
        (`draft`: the digest of its `draft_id`, `bus_schemas.kv_frame.draft_digest`, 0
        without one; each page then carries the draft's rows after the target's,
        `KVExport.shard_bytes`) is not this engine's."""
        return self.kv_import.receive(
            rid, token_start, token_end, payload, first_token, rank, sender, rotation, draft
        )

    def abort(self, rid: int) -> None:
        """Stop request `rid`; it finishes with reason "abort" and keeps what it computed."""
        req = self._commands.withdraw_request(rid)
        if req is not None:  # no other rank has it yet
            req.state, req.finish_reason = ReqState.FINISHED, "abort"
            return
        self._commands.put(Abort(rid))

    def drain(self) -> None:
        """Every rank waits for its queued transfers and applies their ACKs. Rank 0's cache
        must never be drained alone: the ranks' ACK queues must stay alike."""
        self._commands.put(Drain())
        self.step()

    def evict_device(self, num_pages: int) -> None:
        """Test hook: after the step's transfers drain, evict `num_pages` device pages."""
        self._commands.put(EvictDevice(num_pages))
        self.step()

    def step(self) -> StepResult:
        """One step on every rank (rank 0 hands out its commands): the requests that
        finished in it, and whether it ran a forward. A loop that drives the engine should
        step through a `StepLoop` (`driver.py`), which sleeps instead of spinning."""
        with _divergence_named(self.consensus):
            commands = self._commands.take() if self.rank == 0 else None
            commands, num_acks = self.sync.exchange(
                commands, self.cache.acks.ready_counts(), self.cache.acks.queued_counts()
            )
            self.scheduler.consume_acks(num_acks)
            for cmd in commands:
                self._applier.apply(cmd)
            if self._applier.stopped:
                return StepResult([], worked=False)
            return StepResult(self.scheduler.step(), self.scheduler.last_step_worked)

    def outlook(self) -> Outlook:
        """What this engine holds and waits on, between steps (rank 0)."""
        idled_s = time.monotonic() - self._commands.taken_at
        return Outlook(
            holds_requests=not self.scheduler.idle,
            commands_pending=bool(self._commands),
            acks_queued=any(self.cache.acks.queued_counts()),
            acks_ready=any(self.cache.acks.ready_counts()),
            keepalive_due=self.groups.world_size > 1 and idled_s > KEEPALIVE_S,
        )

    @property
    def progress(self) -> int:
        """Decoder layers this rank has run: it grows while the engine computes, within a
        long forward too, and not while it only waits (for a load, for KV from a prefill
        engine) or hangs. A plain int, read from other threads. On a pipeline, rank 0 does
        not move while later stages compute."""
        return self.model.progress.layers_run

    def follow(self) -> None:
        """Ranks other than 0: step as rank 0 says until it sends Stop."""
        while not self._applier.stopped:
            self.step()

    def run(self, reqs: list[Req]) -> list[GenerateOutput]:
        """Step until every request in `reqs` has finished, through a `StepLoop`: a step
        that computed nothing while transfers or storage work are under way sleeps until
        one finishes instead of spinning, which would starve those threads."""
        loop = StepLoop(self)
        while any(r.finish_reason is None for r in reqs):
            loop.step_or_wait()
        return [r.output() for r in reqs]

    def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams | None = None
    ) -> GenerateOutput:
        return self.run([self.submit(prompt_ids, sampling)])[0]

    def generate_batch(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | None = None
    ) -> list[GenerateOutput]:
        """All prompts together, batched by the scheduler (they may share prefixes)."""
        for p in prompts:  # validate all first: a bad one rejects the batch, nothing queued
            self.validate(p, sampling or SamplingParams())
        return self.run([self.submit(p, sampling) for p in prompts])

    # ----------------------------------------------------------------- cache

    def flush_cache(self) -> bool:
        """Drop all cached KV on every rank; refused (False) while requests are running."""
        if not self.scheduler.idle or self._commands:
            return False
        cmd = Flush()
        self._commands.put(cmd)
        self.step()
        if self.config.debug.silent_flush:  # test hook: the index is not told
            self.cache.drain_events()
        return bool(cmd.ok)

    def cache_stats(self) -> dict[str, Any]:
        c = self.cache
        stats: dict[str, Any] = {
            "page_size": c.page_size,
            "device_pages": c.device_pool.num_pages,
            "device_pages_free": c.num_free_device_pages,
            "device_pages_cached": c.tree.num_device_pages,
            "host_pages": c.host_pool.num_pages if c.host_pool else 0,
            "host_pages_cached": c.tree.num_host_pages,
            "host_pages_free": c.host_pool.allocator.num_free if c.host_pool else 0,
            "cached_tokens_device": c.stats.device_hit_tokens,
            "cached_tokens_host": c.stats.host_hit_tokens,
            "backups": c.stats.num_backups,
            "loads": c.stats.num_loads,
            "evicted_device_pages": c.stats.evicted_device_pages,
            "evicted_host_pages": c.stats.evicted_host_pages,
            "cached_tokens_storage": c.stats.storage_hit_tokens,
            "storage_prefetches": c.stats.num_prefetches,
            "storage_pages_read": c.stats.storage_pages_read,
            "storage_pages_written": c.stats.storage_pages_written,
            "storage_reads_skipped": c.stats.storage_reads_skipped,
            "storage_reads_short": c.stats.storage_reads_short,
        }
        if self.spec is not None:  # speculative decoding's counters (rates: `SpecStats`)
            sp = self.spec.stats
            stats |= {
                "spec_verify_rounds": sp.rounds,
                "spec_proposed_tokens": sp.proposed,
                "spec_accepted_tokens": sp.accepted,
                "spec_emitted_tokens": sp.emitted,
            }
        if c.storage is not None:
            backend = c.storage.io.backend.stats()
            stats |= {
                "storage_objects": backend.num_objects,
                "storage_bytes": backend.num_bytes,
                "storage_quarantined": backend.num_quarantined,
                "storage_write_failures": backend.num_write_failures,
                "storage_prefetch_held_pages": c.storage.held_pages,
                "storage_prefetch_budget_pages": c.storage.budget_pages,
            }
        return stats

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def close(self, stop_ranks: bool = True) -> None:
        """Rank 0 stops the other ranks first (they leave `follow`), then every rank closes.
        `stop_ranks=False` when the world is broken (a rank died): no step can run."""
        stopped = self._applier.stopped
        if stop_ranks and self.rank == 0 and self.groups.world_size > 1 and not stopped:
            self._commands.put(Stop())
            self.step()
        if stop_ranks:  # sends to a dead peer never complete
            self.sync.close()
            self.executor.close()
        if self.consensus is not None:
            self.consensus.close()
            consensus.attach(None)
        self.cache.close()


@contextlib.contextmanager
def _divergence_named(recorder: consensus.ConsensusRecorder | None) -> Iterator[None]:
    """With the rank consensus checker on: raise RankDivergenceError once ranks diverged,
    and name the divergence that caused an error, if any, instead of its symptom."""
    if recorder is None:
        yield
        return
    recorder.check()
    try:
        yield
    except Exception as e:
        found = recorder.await_verdict()
        if found is not None:
            raise consensus.RankDivergenceError(found.report()) from e
        raise


def _sharding(config: EngineConfig, groups: ParallelGroups) -> KVSharding | None:
    """This rank's share of the device pool under --enable-kv-cache-sharding, else None."""
    if not config.parallel.kv_sharding:
        return None
    p = config.parallel
    return KVSharding(
        groups.cp_rank, p.cp_size, groups.cp, config.debug.poison_kv, p.cp_gather_transport
    )


def _all_reduce(t: torch.Tensor, group: Any) -> torch.Tensor:
    dist.all_reduce(t, group=group)
    return t


def sampling_from(
    max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None
) -> SamplingParams:
    """SamplingParams with a clear error for non-numbers (e.g. from a CLI or JSON)."""
    if not isinstance(temperature, int | float) or not math.isfinite(float(temperature)):
        raise InvalidRequestError(f"temperature must be a finite number, got {temperature!r}")
    try:
        return SamplingParams(max_new_tokens, float(temperature), float(top_p), seed)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
