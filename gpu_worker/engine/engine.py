"""The in-process engine API: generate, flush_cache, cache statistics.

An engine is one model replica in one `torch.distributed` world. Rank 0 takes new requests
(`submit`), broadcasts them at the start of each step, and every rank runs the same
scheduler step. Only world size 1 exists so far; the broadcast path is already the real one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bus_schemas.page_hash import make_namespace
from bus_schemas.token_ids import as_token_ids
from gpu_worker.cache.hicache import CacheConfig, PrefixCache
from gpu_worker.engine.world import broadcast_work, init_single_rank_world
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.model.config import parse_dtype
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.model.tokenizer import load_tokenizer
from gpu_worker.model.weights import build_model
from gpu_worker.scheduler.request import GenerateOutput, RemoteKV, Req, ReqState
from gpu_worker.scheduler.scheduler import Scheduler, SchedulerConfig


class InvalidRequestError(ValueError):
    """A request the engine refuses before it touches any state."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "tiny"  # a preset name or a Hugging Face checkpoint directory
    dtype: str = "float64"
    device: str = "cpu"
    seed: int = 0  # random weights of a preset
    context_len: int | None = None  # defaults to the model's
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        init_single_rank_world()
        self.config = config
        self.device = torch.device(config.device)
        self.model_config, self.model = build_model(
            config.model,
            self.device,
            parse_dtype(config.dtype),
            seed=config.seed,
            context_len=config.context_len,
        )
        self.tokenizer = load_tokenizer(config.model)
        mc = self.model_config
        self.context_len = min(config.context_len or mc.context_len, mc.context_len)
        self.kv_spec = KVSpec(
            mc.num_layers,
            mc.num_kv_heads,
            mc.head_dim,
            config.cache.page_size,
            parse_dtype(config.dtype),
        )
        self.namespace = make_namespace(config.model, config.dtype, config.cache.page_size)
        self.cache = PrefixCache(config.cache, self.kv_spec, self.device, self.namespace)
        self.scheduler = Scheduler(
            config.scheduler, self.model, self.cache, mc.eos_token_ids, self.device
        )
        self._inbox: list[Req] = []
        self._next_rid = 0

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
                f"exceeds the context length {self.context_len}"
            )
        pages = self.kv_spec.pages_for(total)
        if pages > self.cache.device_pool.num_pages:
            raise InvalidRequestError(
                f"the request needs {pages} KV pages, the device pool has "
                f"{self.cache.device_pool.num_pages}"
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
        req = Req(self._next_rid, as_token_ids(ids), sampling, cache_salt)
        self._next_rid += 1
        self._inbox.append(req)
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
        `export_from` on (`req.export` when it finishes)."""
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
    ) -> int:
        """Write a received KV chunk (page_first bytes) into decode request `rid`; returns the
        bytes written. Raises ValueError when the chunk does not fit the request."""
        req = next((r for r in self.scheduler.running if r.rid == rid), None)
        if req is None or req.remote is None:
            raise ValueError(f"no P/D decode request {rid} is waiting for KV")
        spec, ps = self.kv_spec, self.kv_spec.page_size
        num_pages = -(-(token_end - token_start) // ps)
        shape = (num_pages, spec.num_layers, 2, ps, spec.num_kv_heads, spec.head_dim)
        elem = torch.empty((), dtype=spec.dtype).element_size()
        if len(payload) != math.prod(shape) * elem:
            raise ValueError(
                f"KV chunk has {len(payload)} bytes, expected {math.prod(shape) * elem}"
            )
        staging = torch.frombuffer(bytearray(payload), dtype=spec.dtype).view(shape)
        self.scheduler.write_remote_kv(req, token_start, token_end, staging)
        req.remote.received_bytes += len(payload)
        if first_token is not None:
            if not 0 <= first_token < self.model_config.vocab_size:
                raise ValueError(f"first token {first_token} is outside the vocabulary")
            req.remote.first_token = first_token
        return len(payload)

    def abort(self, rid: int) -> None:
        """Stop request `rid`; it finishes with reason "abort" and keeps what it computed."""
        for req in self._inbox:
            if req.rid == rid:
                self._inbox.remove(req)
                req.state, req.finish_reason = ReqState.FINISHED, "abort"
                return
        self.scheduler.abort(rid)

    @property
    def has_pending(self) -> bool:
        """Submitted requests not yet handed to the scheduler."""
        return bool(self._inbox)

    def step(self) -> list[Req]:
        """One scheduler step on every rank; returns the requests that finished."""
        for req in broadcast_work(self._inbox):
            self.scheduler.add(req)
        self._inbox = []
        return self.scheduler.step()

    def run(self, reqs: list[Req]) -> list[GenerateOutput]:
        """Step until every request in `reqs` has finished."""
        while any(r.finish_reason is None for r in reqs):
            self.step()
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
        """Drop all cached KV; refused (False) while requests are running."""
        if not self.scheduler.idle or self._inbox:
            return False
        self.cache.flush()
        return True

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
        }
        return stats

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def close(self) -> None:
        self.cache.close()


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
