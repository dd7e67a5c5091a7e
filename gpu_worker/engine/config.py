"""An engine's configuration: one frozen dataclass, identical on every rank of its world."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.model.config import resolve_dtype
from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.scheduler.scheduler import SchedulerConfig
from gpu_worker.scheduler.spec_config import SpecConfig


@dataclass(frozen=True, slots=True)
class DebugHooks:
    """Test hooks; part of the config, so identical on every rank."""

    disable_agreement: str = "none"  # "pp_sync", "tp_min", "all": ranks use their own counts
    rank_raise: tuple[int, int] | None = None  # (rank, token): that rank raises on admission
    perturb_sampler: bool = False  # every request's 3rd output token becomes (token + 1) % vocab
    silent_flush: bool = False  # a flush drops the cache without KV events (a stale index)
    layer_delay_s: float = 0.0  # every decoder layer first sleeps this long (a slow forward)
    # attention reads the device pool by slot gathers only, never runs in place (the path a
    # sharded pool takes; in place sums in another order): a CP1 engine so configured is the
    # bit-exact reference of a sharded CP engine
    gather_reads: bool = False
    poison_kv: bool = False  # a sharded pool's unwritten rows and fresh gathers are NaN
    # every decoder layer of every rank first sleeps a random time in [0, this), drawn per
    # rank (seeded by it): ranks reach each layer's gather at different, changing times
    rank_layer_delay_max_s: float = 0.0
    # this world rank starts each request's new pages one owner class off its prefix's
    # cycle (`scheduler/admission.py`): the consensus checker must name that entry
    perturb_owner_rotation_rank: int | None = None
    # speculative decoding: a request's prefix hit (device, host or L3) finds the draft's
    # rows of the hit zeroed (a lost draft restore: the restored-state tests must fail)
    spec_zero_draft_hits: bool = False
    # speculative decoding: when every proposal is accepted, the last one is not fed through
    # the draft (its KV stays missing: acceptance must fall below 100% with the self draft)
    spec_skip_final_draft_feed: bool = False
    # speculative decoding on a TP/PP engine: this world rank applies one accepted proposal
    # fewer than each verify decision (to its draft and its outputs): the consensus checker
    # must name that verify round
    spec_perturb_accept_rank: int | None = None

    def __post_init__(self) -> None:
        if not self.layer_delay_s >= 0:
            raise ValueError(f"layer_delay_s must be >= 0, got {self.layer_delay_s}")
        if not self.rank_layer_delay_max_s >= 0:
            raise ValueError(
                f"rank_layer_delay_max_s must be >= 0, got {self.rank_layer_delay_max_s}"
            )

    def layer_delay(self, rank: int) -> Callable[[], float] | None:
        """How long world rank `rank` sleeps before each decoder layer, drawn anew per
        layer; None for no delay."""
        if not self.layer_delay_s and not self.rank_layer_delay_max_s:
            return None
        fixed, spread = self.layer_delay_s, self.rank_layer_delay_max_s
        rng = random.Random(7919 * rank + 1)
        return lambda: fixed + spread * rng.random()


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
    spec: SpecConfig = field(default_factory=SpecConfig)  # speculative decoding, off by default
    debug: DebugHooks = field(default_factory=DebugHooks)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype, self.model, self.device))
        if self.spec.enabled:
            _refuse_spec_with(self)


def _refuse_spec_with(config: EngineConfig) -> None:
    """What speculative decoding does not support yet (issue 23): the draft's KV over CP
    ranks. TP and PP engines speculate (the verify decided once and broadcast,
    `scheduler/spec_step.py`); the host tier and L3 carry the draft's KV (`PoolGroup`,
    `storage_setup`: packed or sidecar)."""
    if config.parallel.cp_size > 1:
        raise ValueError(
            f"--speculative-algorithm does not support {config.parallel.describe()} yet (CP > "
            "1: the draft's KV over CP ranks; TP and PP engines speculate). Leave speculation "
            "off, or run without --cp-size"
        )
