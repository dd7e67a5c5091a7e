"""The draft's state through the host tier (and L3): packed and sidecar host rows.

The float64 oracle of `test_spec_engine.py` on hits restored from the host tier: a request
whose prefix was backed up (under each write policy), evicted from the device and loaded
back must give speculation-off's tokens and target logits bit for bit, and every verify
round must accept what the same request's cold speculative run accepted: the draft's rows
came back with the target's, in the same transfer. `self` (the target's shape) packs its
layers into the target's host rows; `tiny-draft` (1 KV head) keeps a sidecar host pool, and
`self` may be forced into one. The zero switch (`spec_zero_draft_hits`) wipes the draft's
restored rows: the accepted counts must then fall.

L3 (a real `file` store): the first turn is written, device and host are flushed, and the
second turn's prefix is read back, under both key schemes and both storage write policies;
packed objects carry both models under a name an engine without that draft never reads,
sidecar objects sit beside the target's (which such an engine does read). A sidecar draft
object missing or damaged cuts the hit before its page: still lossless, still the cold
run's accepted counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from bus_schemas.page_hash import chain_hashes, root_hash
from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import DebugHooks, Engine, EngineConfig
from gpu_worker.memory.pool_group import DRAFT, HostRows
from gpu_worker.scheduler.request import CachedTokens, Req
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
    storage: dict[str, object] | None = None,
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
        **(storage or {}),  # type: ignore[arg-type]
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
    first: Sequence[Req],
    second: Sequence[Req],
    off: Turns,
    cold: Turns,
    draft: str,
    tier: str = "host",
) -> None:
    _, want1, want2 = off
    _, ref1, ref2 = cold
    assert_same(first, want1)
    assert_same(second, want2)
    assert all(getattr(r.cached, tier) > 0 for r in second), [r.cached for r in second]
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


@pytest.mark.parametrize("draft", ["self", "tiny-draft"])
def test_hicache_size_counts_the_draft_rows(draft: str) -> None:
    """--hicache-size is bytes: a host page holds both models' rows, so fewer pages fit."""
    eng = tiered_engine(draft, storage={"hicache_size_gb": 1e-4})
    host, pools = eng.cache.host_pool, eng.cache.pools
    assert host is not None and pools.draft is not None
    assert host.num_pages == 100_000 // pools.bytes_per_page < 100_000 // eng.kv_spec.bytes_per_page
    eng.close()


def test_a_packed_draft_needs_the_target_row_shape() -> None:
    with pytest.raises(ValueError, match=r"num_kv_heads 1 vs 2.*sidecar"):
        tiered_engine("tiny-draft", mode="packed")


# ------------------------------------------------------------------ L3


def l3_engine(
    draft: str | None,
    directory: Path,
    scheme: str = "rank-suffix",
    debug: DebugHooks | None = None,
    policy: str = "write_through",
    **more: object,
) -> Engine:
    storage: dict[str, object] = dict(
        hicache_storage_write_policy=policy,
        hicache_storage_write_threshold=1,
        hicache_storage_backend="file",
        hicache_storage_dir=str(directory),
        hicache_storage_prefetch_policy="wait_complete",
        hicache_storage_key_scheme=scheme,
        storage_batch_pages=4,
        **more,
    )
    return tiered_engine(draft, debug=debug, storage=storage)


def objects(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*/*") if p.is_file())


def l3_hit_turns(
    eng: Engine, prompts: list[list[int]], repeat: bool = False
) -> tuple[list[Req], list[Req]]:
    """The first turn (again with `repeat`: a hit, which the selective policy writes
    after), written to the store; then device and host flushed; then the second turn,
    whose prefix is read back from the store."""
    first = run_traced(eng, prompts)
    if repeat:
        eng.drain()
        run_traced(eng, prompts)
    eng.drain()
    assert eng.flush_cache()
    second = run_traced(eng, second_turn(prompts, first))
    eng.drain()
    eng.check_integrity()
    return first, second


@pytest.mark.parametrize("scheme", ["rank-suffix", "unified"])
@pytest.mark.parametrize("draft", ["self", "tiny-draft"])
def test_l3_hits_restore_the_draft(
    draft: str, scheme: str, tmp_path: Path, off: Turns, spec_cold: dict[str, Turns]
) -> None:
    """Packed (`self`): one object a page carries both models, named for the draft;
    sidecar (`tiny-draft`): the draft's objects sit beside the target's, which are the
    ones an engine without speculation writes."""
    eng = l3_engine(draft, tmp_path, scheme)
    first, second = l3_hit_turns(eng, spec_cold[draft][0])
    eng.close()
    names = objects(tmp_path)  # what the speculative engine wrote
    check_restored(first, second, off, spec_cold[draft], draft, tier="storage")
    # an engine without speculation reads the sidecar's target objects, never packed ones
    plain = l3_engine(None, tmp_path, scheme)
    again = run_traced(plain, second_turn(spec_cold[draft][0], first))
    plain.close()
    assert_same(again, off[2])
    assert (sum(r.cached.storage for r in again) > 0) == (draft != "self")
    drafts = [n for n in names if ".draft" in n]
    if draft == "self":
        assert not drafts
        if scheme == "rank-suffix":
            assert all(".packed-draft-" in n for n in names)
    else:
        pages = {n.split("_")[0] for n in names if ".draft" not in n}
        assert drafts and {n.split("_")[0] for n in drafts} == pages  # every page: both


def test_packed_draft_layers_are_their_own_range_on_the_unified_grid(
    tmp_path: Path, off: Turns, spec_cold: dict[str, Turns]
) -> None:
    """With the grid cut at the target's layer count, a packed page's draft layers are
    objects of their own (`_L4-7_`), read back with the target's."""
    eng = l3_engine("self", tmp_path, "unified", storage_layer_partition=4)
    assert eng.cache.spec.num_layers == 4
    first, second = l3_hit_turns(eng, spec_cold["self"][0])
    eng.close()
    check_restored(first, second, off, spec_cold["self"], "self", tier="storage")
    ranges = {n.split("_")[2] for n in objects(tmp_path)}
    assert ranges == {"L0-3", "L4-7"}


@pytest.mark.parametrize("draft", ["self", "tiny-draft"])
def test_selective_l3_writes_carry_the_draft(
    draft: str, tmp_path: Path, off: Turns, spec_cold: dict[str, Turns]
) -> None:
    """The other storage write policy: pages are written once hit, packed or sidecar alike."""
    eng = l3_engine(draft, tmp_path, policy="write_through_selective")
    first, second = l3_hit_turns(eng, spec_cold[draft][0], repeat=True)
    eng.close()
    check_restored(first, second, off, spec_cold[draft], draft, tier="storage")


@pytest.mark.parametrize("how", ["missing", "corrupt"])
def test_a_missing_or_damaged_draft_object_cuts_the_hit_there(
    how: str, tmp_path: Path, off: Turns, spec_cold: dict[str, Turns]
) -> None:
    """A sidecar draft's object of a page gone or damaged (its target object intact): the
    page is not whole, so the hit stops before it, as for a target object, and both models
    compute from there. The output is still the target's and the accepted counts still the
    cold run's: nothing restored was wrong, less was restored."""
    prompts = spec_cold["tiny-draft"][0]
    eng = l3_engine("tiny-draft", tmp_path)
    first = run_traced(eng, prompts)
    eng.drain()
    namespace = eng.namespace
    eng.close()
    seq = prompts[0] + first[0].output_ids
    page = 2
    hashes = chain_hashes(root_hash(namespace, ""), seq[: (page + 1) * PAGE], PAGE)
    key = hashes[page].hex()
    (target,) = [p for p in (tmp_path / key[:2]).glob(f"{key}_*") if ".draft" not in p.name]
    (obj,) = (tmp_path / key[:2]).glob(f"{key}_*.draft-*")
    if how == "missing":
        obj.unlink()
    else:
        data = obj.read_bytes()
        obj.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    assert target.exists()
    eng = l3_engine("tiny-draft", tmp_path)
    second = run_traced(eng, second_turn(prompts, first))
    eng.drain()
    eng.check_integrity()
    eng.close()
    assert second[0].cached == CachedTokens(0, 0, page * PAGE)  # pages 0, 1 only
    assert_same(second, off[2])
    assert rounds(second) == rounds(spec_cold["tiny-draft"][2])


def test_zeroed_draft_rows_of_an_l3_hit_lose_acceptance(tmp_path: Path, off: Turns) -> None:
    eng = l3_engine("self", tmp_path, debug=DebugHooks(spec_zero_draft_hits=True))
    first, second = l3_hit_turns(eng, off[0])
    eng.close()
    assert_same(second, off[2])
    assert all(r.cached.storage > 0 for r in second)
    assert sum(r.spec_accepted for r in first) == sum(r.spec_proposed for r in first)
    assert sum(r.spec_accepted for r in second) < sum(r.spec_proposed for r in second)
