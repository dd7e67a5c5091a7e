"""The engine API: generate, flush_cache, cache statistics, on rank 0 of the engine's world.

An engine is one model replica in one `torch.distributed` world of TP x PP ranks, built by
the launcher (`gpu_worker/engine/rank.py`) and passed in as `ParallelGroups`; a world of one
needs no process group at all. Rank 0 takes every input (`submit`, `abort`, `flush_cache`,
`write_kv`, ...) as a typed command (`commands.py`); at the start of each step it hands the
list to every rank with the agreed count of ready transfer ACKs (`parallel/sync.py`), and
every rank consumes those ACKs, applies the commands in order and runs the same scheduler
step. The other ranks run `follow()` until rank 0 sends `Stop`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bus_schemas.page_hash import make_namespace
from bus_schemas.token_ids import as_token_ids
from gpu_worker.cache.hicache import CacheConfig, PrefixCache
from gpu_worker.cache.load_cost import LoadCostEstimate
from gpu_worker.cache.storage_codec import StorageLayout
from gpu_worker.consensus import checker as consensus
from gpu_worker.engine.commands import (
    Abort,
    AddRequest,
    Command,
    Drain,
    EvictDevice,
    Flush,
    SetLoadCost,
    Stop,
    StopPrefetch,
    WriteKV,
)
from gpu_worker.engine.executor import ModelExecutor
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.memory.pool_group import PoolGroup
from gpu_worker.model.config import PRESETS, ModelConfig, parse_dtype, resolve_dtype
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.model.shard import ModelShard
from gpu_worker.model.tokenizer import load_tokenizer
from gpu_worker.model.weights import build_model, weights_digest
from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.parallel.groups import ParallelGroups, rank_device
from gpu_worker.parallel.sync import StepSync, agree_min
from gpu_worker.scheduler.request import GenerateOutput, RemoteKV, Req, ReqState
from gpu_worker.scheduler.scheduler import Scheduler, SchedulerConfig
from gpu_worker.storage import StorageBackend, StorageConfig, default_storage_dir, make_backend
from gpu_worker.storage.layout import StorageNamespace, shard_cells, shard_names

log = logging.getLogger(__name__)

KEEPALIVE_S = 5.0  # an idle multi-rank engine still steps this often (its ranks wait in it)
ACK_WAIT_S = 0.05  # `run`: the longest sleep for an ACK before stepping again anyway


class InvalidRequestError(ValueError):
    """A request the engine refuses before it touches any state."""


@dataclass(frozen=True, slots=True)
class DebugHooks:
    """Test hooks; part of the config, so identical on every rank."""

    disable_agreement: str = "none"  # "pp_sync", "tp_min", "all": ranks use their own counts
    rank_raise: tuple[int, int] | None = None  # (rank, token): that rank raises on admission
    perturb_sampler: bool = False  # every request's 3rd output token becomes (token + 1) % vocab
    silent_flush: bool = False  # a flush drops the cache without KV events (a stale index)
    layer_delay_s: float = 0.0  # every decoder layer first sleeps this long (a slow forward)

    def __post_init__(self) -> None:
        if not self.layer_delay_s >= 0:
            raise ValueError(f"layer_delay_s must be >= 0, got {self.layer_delay_s}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "tiny"  # a preset name or a Hugging Face checkpoint directory
    dtype: str = "float64"
    device: str = "cpu"
    seed: int = 0  # random weights of a preset
    context_len: int | None = None  # defaults to the model's
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # every row's result independent of its batch (SGLang's --enable-deterministic-inference)
    batch_invariant: bool = False
    debug: DebugHooks = field(default_factory=DebugHooks)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype, self.model, self.device))


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
        self.device = rank_device(config.device, self.rank)
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
            host_pages = agree_min(groups, config.cache.num_host_pages(self.kv_spec))
        # the engine's KV pools over one slot mapping: a draft model's would join the group
        pools = PoolGroup.target_only(
            self.kv_spec, config.cache.num_device_pages, self.device, config.cache.check_reads
        )
        self.cache = PrefixCache(
            config.cache,
            self.kv_spec,
            self.device,
            self.namespace,
            num_host_pages=host_pages,
            delay_seed=7919 * self.rank,
            record_events=self.rank == 0,  # rank 0 publishes the KV events
            storage=self._storage_backend(config),
            storage_layout=self.storage_layout(config, mc, self.rank)
            if config.cache.hicache_storage_backend is not None
            else None,
            storage_groups=(groups.storage_hit, groups.storage_progress, groups.storage_write),
            rank=self.rank,
            pools=pools,
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
        self.scheduler = Scheduler(
            config.scheduler, self.executor, self.cache, mc.eos_token_ids, self.device
        )
        self.scheduler.perturb_sampler = config.debug.perturb_sampler
        if config.debug.layer_delay_s:
            delay = config.debug.layer_delay_s
            for layer in self.model.layers:
                layer.register_forward_pre_hook(lambda _m, _a: time.sleep(delay))
        self._commands: list[Command] = []  # rank 0: what the next step hands to every rank
        self._partial_kv: dict[tuple[int, int, int], WriteKV] = {}  # rank 0: shards so far
        self._next_rid = 0
        self._sent_estimate = LoadCostEstimate()
        self._last_step = time.monotonic()
        self.stopped = False  # set by the Stop command
        self._acks_done = threading.Event()  # rung by transfer and storage workers (`run`)
        self.cache.acks.set_listener(self._acks_done.set)

    @staticmethod
    def storage_layout(config: EngineConfig, mc: ModelConfig, rank: int) -> StorageLayout:
        """Which stored objects hold world rank `rank`'s part of a page of model `mc` (a
        clear error, naming the flag, when the unified grid does not fit the rank's shard).

        MLA's latent is replicated over TP: under either key scheme only TP rank 0 of each
        stage writes a page's objects, and every TP rank reads those (rank-suffix: all name
        them `tp0of{T}...`; unified: `mla_replicated` cells have no `_H`)."""
        cc, par = config.cache, config.parallel
        tp_rank = par.coords(rank).tp
        names = shard_names(par, rank, replicated=mc.mla)
        if cc.hicache_storage_key_scheme != "unified":
            writes = tp_rank == 0 or not mc.mla
            return StorageLayout(names.shard, layout=names.layout, writes=writes)
        namespace = StorageNamespace(
            model=config.model,
            kv_dtype=config.dtype,
            page_size=cc.page_size,
            replication="mla_replicated" if mc.mla else "mha_sharded",
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.kv_head_dim,
            num_layers=mc.num_layers,
            layer_partition=cc.storage_layer_partition or mc.num_layers,
            head_partition=cc.storage_head_partition,
        )
        model_shard = ModelShard.of(mc, par, rank)
        heads = model_shard.kv_heads(mc)
        cells = shard_cells(
            namespace,
            (model_shard.layers.start, model_shard.layers.stop),
            (heads.start, heads.stop),
            tp_rank,
        )
        return StorageLayout(names.shard, namespace, cells, names.layout)

    @staticmethod
    def _storage_backend(config: EngineConfig) -> StorageBackend | None:
        """External storage for this rank, when a backend is configured."""
        cc = config.cache
        if cc.hicache_storage_backend is None:
            return None
        return make_backend(
            StorageConfig(
                backend=cc.hicache_storage_backend,
                directory=Path(cc.hicache_storage_dir or default_storage_dir()),
                capacity_bytes=None
                if cc.hicache_storage_size_gb is None
                else int(cc.hicache_storage_size_gb * 1e9),
                key_file=Path(cc.hicache_storage_key_file) if cc.hicache_storage_key_file else None,
            )
        )

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
        self._commands.append(AddRequest(req))
        return req

    # ----------------------------------------------------------------- P/D

    def submit_decode(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        cache_salt: str = "",
        reuse: bool = True,
    ) -> Req:
        """A P/D decode request: its prompt KV comes from a prefill engine (`write_kv`)."""
        req = self.submit(prompt_ids, sampling, cache_salt)
        req.remote = RemoteKV(reuse=reuse and self.config.cache.enable_radix_cache)
        return req

    def submit_prefill(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, cache_salt: str, export_from: int
    ) -> Req:
        """A P/D prefill request: compute the prompt, sample one token, and pack the KV from
        `export_from` on (`req.export` when it finishes; every rank's shard on rank 0)."""
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
    ) -> WriteKV:
        """Queue a received KV chunk for decode request `rid`: world rank `rank`'s shard of
        it from a prefill engine of layout `sender` (this engine's own when None), in the
        unified order with one KV head per group. Once every sender rank's shard arrived,
        the chunk is cut into this engine's ranks' heads and layers (nothing to cut when the
        layouts are the same) and written on every rank at the start of the next step; the
        returned command (one per chunk) then holds the bytes written or why it did not fit
        (`applied`). A payload of the wrong size, a duplicate shard, an unknown rank or a
        layout that does not split the model raises ValueError now."""
        sender = sender or self.config.parallel
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
        cmd = self._partial_kv.get(key)
        if cmd is None:
            cmd = self._partial_kv[key] = WriteKV(rid, token_start, token_end, (), first_token)
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
            del self._partial_kv[key]
            self._commands.append(cmd)
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
        own = self.config.parallel
        if sender == own:  # the same cut: own rank r's shard is r's, or its TP rank 0's
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

    def _write_kv(self, cmd: WriteKV) -> None:
        cmd.applied = True
        req = next((r for r in self.scheduler.running if r.rid == cmd.rid), None)
        if req is None or req.remote is None:
            cmd.error = f"no P/D decode request {cmd.rid} is waiting for KV"
            return
        payload = cmd.payloads[self.rank]
        shape = self._unified_shape(
            self.config.parallel, self.rank, cmd.token_end - cmd.token_start
        )
        staging = torch.frombuffer(bytearray(payload), dtype=self.kv_spec.dtype).view(shape)
        try:
            self.scheduler.write_remote_kv(req, cmd.token_start, cmd.token_end, staging)
        except ValueError as e:
            cmd.error = str(e)
            return
        req.remote.received_bytes += len(payload)
        if cmd.first_token is not None:
            req.remote.first_token = cmd.first_token
        cmd.written = len(payload)

    def abort(self, rid: int) -> None:
        """Stop request `rid`; it finishes with reason "abort" and keeps what it computed."""
        for cmd in self._commands:
            if isinstance(cmd, AddRequest) and cmd.req.rid == rid:  # no other rank has it yet
                self._commands.remove(cmd)
                cmd.req.state, cmd.req.finish_reason = ReqState.FINISHED, "abort"
                return
        self._commands.append(Abort(rid))

    def drain(self) -> None:
        """Every rank waits for its queued transfers and applies their ACKs. Rank 0's cache
        must never be drained alone: the ranks' ACK queues must stay alike."""
        self._commands.append(Drain())
        self.step()

    def evict_device(self, num_pages: int) -> None:
        """Test hook: after the step's transfers drain, evict `num_pages` device pages."""
        self._commands.append(EvictDevice(num_pages))
        self.step()

    @property
    def has_pending(self) -> bool:
        """Commands not yet handed to the ranks."""
        return bool(self._commands)

    @property
    def has_queued_acks(self) -> bool:
        """Transfers or storage work still to be consumed (backups to commit, writes to the
        store to start): an idle engine keeps stepping until they are."""
        return any(self.cache.acks.queued_counts())

    @property
    def keepalive_due(self) -> bool:
        """A multi-rank engine that idled for `KEEPALIVE_S` should step (its ranks wait)."""
        return self.groups.world_size > 1 and time.monotonic() - self._last_step > KEEPALIVE_S

    def step(self) -> list[Req]:
        """One step on every rank (rank 0 hands out its commands); returns the requests that
        finished in it."""
        if self.consensus is None:
            return self._step()
        self.consensus.check()  # raises RankDivergenceError once ranks diverged
        try:
            return self._step()
        except Exception as e:  # a symptom: report the divergence that caused it, if any
            found = self.consensus.await_verdict()
            if found is not None:
                raise consensus.RankDivergenceError(found.report()) from e
            raise

    @property
    def progress(self) -> int:
        """Decoder layers this rank has run: it grows while the engine computes, within a
        long forward too, and not while it only waits (for a load, for KV from a prefill
        engine) or hangs. A plain int, read from other threads. On a pipeline, rank 0 does
        not move while later stages compute."""
        return self.model.layers_run

    def _step(self) -> list[Req]:
        commands: list[Command] | None = None
        if self.rank == 0:
            self._offer_load_cost()
            self._offer_prefetch_verdicts()
            commands, self._commands = self._commands, []
            self._last_step = time.monotonic()
        commands, num_acks = self.sync.exchange(
            commands, self.cache.acks.ready_counts(), self.cache.acks.queued_counts()
        )
        self.scheduler.consume_acks(num_acks)
        for cmd in commands:
            self._apply(cmd)
        if self.stopped:
            return []
        return self.scheduler.step()

    def follow(self) -> None:
        """Ranks other than 0: step as rank 0 says until it sends Stop."""
        while not self.stopped:
            self.step()

    def _offer_load_cost(self) -> None:
        """Rank 0: send its load-cost figures when they moved (every rank decides by them)."""
        if self.config.cache.hicache_load_policy != "cost":
            return
        spec, storage = self.kv_spec, self.cache.storage
        estimate = self.cache.cost.estimate(
            spec.bytes_per_page / spec.page_size,
            None if storage is None else storage.io.seconds_per_page(),
            spec.page_size,
        )
        if estimate.differs_from(self._sent_estimate):
            self._sent_estimate = estimate
            self._commands.append(
                SetLoadCost(
                    estimate.load_s_per_token,
                    estimate.recompute_s_per_token,
                    estimate.storage_s_per_token,
                )
            )

    def _offer_prefetch_verdicts(self) -> None:
        """Rank 0: storage prefetches past their deadline (`timeout` policy) stop, on every
        rank at once; only rank 0's clock decides."""
        storage = self.cache.storage
        if storage is not None:
            self._commands += [StopPrefetch(rid) for rid in storage.timed_out(time.monotonic())]

    def _apply(self, cmd: Command) -> None:
        """Apply one command; the same on every rank (results land on rank 0's objects)."""
        if isinstance(cmd, AddRequest):
            self._debug_raise(cmd.req)
            self.scheduler.add(cmd.req)
        elif isinstance(cmd, Abort):
            self.scheduler.abort(cmd.rid)
        elif isinstance(cmd, WriteKV):
            self._write_kv(cmd)
        elif isinstance(cmd, Flush):
            cmd.ok = self.scheduler.idle
            if cmd.ok:
                self.cache.flush()
        elif isinstance(cmd, EvictDevice):
            self.cache.drain()
            self.cache.evict_device(min(cmd.num_pages, self.cache.tree.num_device_pages))
        elif isinstance(cmd, Drain):
            self.cache.drain()
        elif isinstance(cmd, SetLoadCost):
            self.cache.cost_estimate = LoadCostEstimate(
                cmd.load_s_per_token,
                cmd.recompute_s_per_token,
                storage_s_per_token=cmd.storage_s_per_token,
            )
        elif isinstance(cmd, StopPrefetch):
            self.scheduler.stop_prefetch(cmd.rid)
        elif isinstance(cmd, Stop):
            self.stopped = True

    def _debug_raise(self, req: Req) -> None:
        hook = self.config.debug.rank_raise
        if hook is not None and hook[0] == self.rank and hook[1] in req.prompt_ids:
            raise RuntimeError(f"debug: rank {self.rank} raises on prompt token {hook[1]}")

    def run(self, reqs: list[Req]) -> list[GenerateOutput]:
        """Step until every request in `reqs` has finished. A step that computed nothing
        while transfers or storage work are under way sleeps until one finishes (its worker
        rings `_acks_done`) instead of spinning, which would starve those threads of the
        interpreter."""
        while any(r.finish_reason is None for r in reqs):
            self.step_or_wait()
        return [r.output() for r in reqs]

    def step_or_wait(self) -> list[Req]:
        """`step`, then, when it computed nothing while transfers or storage work are under
        way, sleep until one of them finishes (at most `ACK_WAIT_S`). A loop that drives
        the engine itself should call this, not `step`: spinning starves the workers."""
        self._acks_done.clear()
        finished = self.step()
        waiting = not self.scheduler.last_step_worked and self.has_queued_acks
        if waiting and not any(self.cache.acks.ready_counts()):
            self._acks_done.wait(ACK_WAIT_S)
        return finished

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
        self._commands.append(cmd)
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
        if stop_ranks and self.rank == 0 and self.groups.world_size > 1 and not self.stopped:
            self._commands.append(Stop())
            self.step()
        if stop_ranks:  # sends to a dead peer never complete
            self.sync.close()
            self.executor.close()
        if self.consensus is not None:
            self.consensus.close()
            consensus.attach(None)
        self.cache.close()


def _slice(r: range) -> slice:
    return slice(r.start, r.stop)


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
