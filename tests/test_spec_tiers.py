"""The draft's state through the host tier (and L3): packed and sidecar host rows.

The float64 oracle of `test_spec_engine.py` on hits restored from the host tier: a request
whose prefix was backed up (under each write policy), evicted from the device and loaded
back must give speculation-off's tokens and target logits bit for bit, and every verify
round must accept what the same request's cold speculative run accepted: the draft's rows
came back with the target's, in the same transfer. `self` (the target's shape) packs its
layers into the target's host rows; `tiny-draft` (1 KV head) keeps a sidecar host pool, and
`self` may be forced into one. The zero switch (`spec_zero_draft_hits`) wipes the draft's
restored rows: the accepted counts must then fall.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import DebugHooks, Engine, EngineConfig
from gpu_worker.memory.pool_group import DRAFT, HostRows
from gpu_worker.scheduler.request import Req
from gpu_worker.scheduler.scheduler import SchedulerConfig
from gpu_worker.scheduler.spec_config import SpecConfig
from tests.test_spec_engine import PAGE, assert_same, make_prompts, rounds, run_traced, second_turn

POLICIES = ("write_through", "write_through_selective", "write_back")


def tiered_engine(
    draft: str | None,
    policy: str = "write_through",
    layout: str = "layer_first",
    mode: str = "auto",
    debug: DebugHooks | None = None,
) -> Engine:
    spec = SpecConfig() if draft is None else SpecConfig("standalone", draft, 4, "none", mode)
    cache = CacheConfig(
        page_size=PAGE,
        num_device_pages=256,
        enable_hierarchical_cache=True,
        hicache_write_policy=policy,  # type: ignore[arg-type]
        hicache_mem_layout=layout,  # type: ignore[arg-type]
        write_through_threshold=1,
        check_reads=True,
    )
    return Engine(
        EngineConfig(
            cache=cache,
            scheduler=SchedulerConfig(chunked_prefill_size=8),
            batch_invariant=True,
            spec=spec,
            debug=debug or DebugHooks(),
        )
    )


def cold_engine(draft: str | None) -> Engine:
    spec = SpecConfig() if draft is None else SpecConfig("standalone", draft, 4)
    return Engine(
        EngineConfig(
            cache=CacheConfig(page_size=PAGE, num_device_pages=256, enable_radix_cache=False),
            scheduler=SchedulerConfig(chunked_prefill_size=8),
            batch_invariant=True,
            spec=spec,
        )
    )


Turns = tuple[list[list[int]], list[Req], list[Req]]


def two_turns(eng: Engine, prompts: list[list[int]]) -> tuple[list[Req], list[Req]]:
    first = run_traced(eng, prompts)
    return first, run_traced(eng, second_turn(prompts, first))


@pytest.fixture(scope="module")
def off() -> Turns:
    """Speculation off, no reuse: both turns' reference tokens and logits."""
    prompts = make_prompts()
    eng = cold_engine(None)
    first, second = two_turns(eng, prompts)
    eng.close()
    return prompts, first, second


@pytest.fixture(scope="module")
def spec_cold() -> dict[str, Turns]:
    """Speculation on, no reuse, per draft: the accepted counts a restore must reproduce."""
    prompts = make_prompts()
    out = {}
    for draft in ("self", "tiny-draft"):
        eng = cold_engine(draft)
        out[draft] = (prompts, *two_turns(eng, prompts))
        eng.close()
    return out


def host_hit_turns(
    eng: Engine, prompts: list[list[int]], repeat: bool = True
) -> tuple[list[Req], list[Req]]:
    """The first turn (twice with `repeat`: the repeat is a device hit, which makes the
    selective policy back the paths up), then the device cache emptied, then the second
    turn: its prefix (the first turn's prompt and outputs, decoded speculatively) comes
    from the host."""
    first = run_traced(eng, prompts)
    if repeat:
        run_traced(eng, prompts)
    eng.cache.drain()
    eng.cache.evict_device(eng.cache.tree.num_device_pages)
    assert eng.cache.tree.num_device_pages == 0 and eng.cache.tree.num_host_pages > 0
    eng.check_integrity()
    second = run_traced(eng, second_turn(prompts, first))
    eng.cache.drain()
    eng.check_integrity()
    return first, second


def check_restored(
    first: Sequence[Req], second: Sequence[Req], off: Turns, cold: Turns, draft: str
) -> None:
    _, want1, want2 = off
    _, ref1, ref2 = cold
    assert_same(first, want1)
    assert_same(second, want2)
    assert all(r.cached.host > 0 for r in second), [r.cached for r in second]
    assert rounds(first) == rounds(ref1) and rounds(second) == rounds(ref2)
    proposed = sum(r.spec_proposed for r in second)
    accepted = sum(r.spec_accepted for r in second)
    assert proposed > 0
    assert (accepted == proposed) == (draft == "self")


@pytest.mark.parametrize(
    ("draft", "mode", "rows"),
    [
        ("self", "auto", HostRows.PACKED),
        ("tiny-draft", "auto", HostRows.SIDECAR),
        ("self", "sidecar", HostRows.SIDECAR),
    ],
)
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_host_hits_restore_the_draft_under_every_write_policy(
    draft: str, mode: str, rows: HostRows, layout: str, off: Turns, spec_cold: dict[str, Turns]
) -> None:
    for policy in POLICIES:
        eng = tiered_engine(draft, policy, layout, mode)
        members = eng.cache.pools.members
        assert members[1].name == DRAFT and members[1].host_rows is rows
        host = eng.cache.host_pool
        assert host is not None
        packed = eng.cache.spec.num_layers + members[1].spec.num_layers
        want = packed if rows is HostRows.PACKED else eng.cache.spec.num_layers
        assert host.spec.num_layers == want  # packed: one host row carries both models
        assert (eng.cache.pools.draft_host is None) == (rows is HostRows.PACKED)
        first, second = host_hit_turns(eng, spec_cold[draft][0])
        eng.close()
        check_restored(first, second, off, spec_cold[draft], draft)


def test_zeroed_draft_rows_of_a_host_hit_lose_acceptance(off: Turns) -> None:
    """The switch the restored-state test must catch, on host hits: the draft's rows that
    came back from the host read as zeros. Outputs stay the target's; acceptance falls.
    (No device hit before: write-through backs the first turn up as it is inserted.)"""
    eng = tiered_engine("self", debug=DebugHooks(spec_zero_draft_hits=True))
    first, second = host_hit_turns(eng, off[0], repeat=False)
    eng.close()
    assert_same(first, off[1])
    assert_same(second, off[2])
    assert all(r.cached.host > 0 and r.cached.device == 0 for r in second)
    assert sum(r.spec_accepted for r in first) == sum(r.spec_proposed for r in first)
    assert sum(r.spec_accepted for r in second) < sum(r.spec_proposed for r in second)


def test_a_packed_draft_needs_the_target_row_shape() -> None:
    with pytest.raises(ValueError, match=r"num_kv_heads 1 vs 2.*sidecar"):
        tiered_engine("tiny-draft", mode="packed")
