"""The pool group: the target pool, maybe a draft's (packed or sidecar host rows); other
members are declared, and refused."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels.moves import move_pages
from gpu_worker.kernels.page_transfer import PageView
from gpu_worker.kernels.relayout import RunView
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.memory.pool_group import (
    DRAFT as DRAFT_NAME,
)
from gpu_worker.memory.pool_group import (
    TARGET,
    HostRows,
    KVSharding,
    PoolGroup,
    PoolMember,
    UnsupportedMember,
    draft_host_rows,
)
from gpu_worker.memory.sharded_pool import ShardedDeviceKVPool

CPU = torch.device("cpu")
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, dtype=torch.float64)
DRAFT = KVSpec(num_layers=1, num_kv_heads=2, head_dim=4, page_size=4, dtype=torch.float64)


def test_target_only_group_holds_the_device_pool_and_its_host_pool() -> None:
    group = PoolGroup.target_only(SPEC, 8, CPU, check_reads=True)
    assert [m.name for m in group.members] == [TARGET]
    assert group.members[0].host_rows is HostRows.SAME_SLOTS
    assert group.spec == SPEC and group.device.num_pages == 8 and group.device.check_reads
    assert group.bytes_per_page == SPEC.bytes_per_page
    assert group.host is None
    with pytest.raises(RuntimeError, match="no host pools"):
        group.tier_views()
    host = group.attach_host(5, "page_first")
    assert group.host is host and host.num_pages == 5 and host.layout == "page_first"
    (views,) = group.tier_views()
    assert isinstance(views.device, PageView) and isinstance(views.host, PageView)
    assert views.backup() == (views.device, views.host)
    assert views.load() == (views.host, views.device)
    with pytest.raises(RuntimeError, match="already"):
        group.attach_host(5, "page_first")


def test_unified_host_pool_pairs_with_runs_of_the_device_pool() -> None:
    group = PoolGroup.target_only(SPEC, 8, CPU)
    group.attach_host(4, "page_unified", group_heads=1)
    (views,) = group.tier_views()
    assert isinstance(views.device, RunView) and isinstance(views.host, RunView)


@pytest.mark.parametrize(
    "members",
    [
        [PoolMember(TARGET, SPEC), PoolMember("indexer", DRAFT, HostRows.PACKED)],
        [PoolMember(TARGET, SPEC), PoolMember("draft", DRAFT, HostRows.SIDECAR, "draft")],
        [PoolMember("draft", DRAFT)],
        [PoolMember(TARGET, SPEC, HostRows.PACKED)],
        [],
    ],
)
def test_a_group_refuses_members_other_than_the_target(members: list[PoolMember]) -> None:
    """Indexer pools (and a sidecar of anything but the target) have a declared place, and
    no code that moves them yet: a group with one refuses to be built rather than leave it
    behind."""
    with pytest.raises(UnsupportedMember, match="not supported yet"):
        PoolGroup(members, 8, CPU)


def test_only_a_sidecar_names_its_source_pool() -> None:
    with pytest.raises(ValueError, match="names its source"):
        PoolMember("draft", DRAFT, HostRows.SIDECAR)
    with pytest.raises(ValueError, match="names its source"):
        PoolMember("draft", DRAFT, HostRows.PACKED, TARGET)
    assert PoolMember("draft", DRAFT, HostRows.SIDECAR, TARGET).source == TARGET


def test_a_sharded_group_holds_a_sharded_device_pool_and_its_own_host_rows() -> None:
    """`--enable-kv-cache-sharding`: the target's device pool is this CP rank's share (one
    rank here: the gathers and host rows of CP worlds are tests/test_cp_engine.py's and
    tests/test_cp_host.py's), its host pool the rank's host pages; P/D, which needs every
    page's rows, refuses it by name."""
    group = PoolGroup.target_only(SPEC, 8, CPU, sharding=KVSharding(0, 1, None, poison=True))
    assert isinstance(group.device, ShardedDeviceKVPool) and group.device.num_pages == 8
    assert not group.device.contiguous_slices and group.device.kv.isnan().all()
    assert group.device.allocator.num_owners == 1
    host = group.attach_host(5, "page_first")
    assert host.sharded and host.owned_by == 0 and host.num_local_pages == 5
    assert group.local_pairs([3, 1], [0, 4]) == ([3, 1], [0, 4])  # one rank owns every pair
    with pytest.raises(UnsupportedMember, match="P/D KV transfer does not support"):
        group.replicated_device("P/D KV transfer")
    plain = PoolGroup.target_only(SPEC, 8, CPU)
    assert plain.replicated_device("the host tier") is plain.device


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_unified"])
@pytest.mark.parametrize("rows", [HostRows.PACKED, HostRows.SIDECAR])
def test_a_draft_moves_with_the_target_through_one_set_of_host_pages(
    layout: str, rows: HostRows
) -> None:
    """Packed: the draft's layers follow the target's in each host row; sidecar: its own
    host pool at the same page ids. Either way a backup and a load through `tier_views`
    move both models' rows of the same pages, and nothing else."""
    source = TARGET if rows is HostRows.SIDECAR else None
    group = PoolGroup(
        [PoolMember(TARGET, SPEC), PoolMember(DRAFT_NAME, DRAFT, rows, source)], 8, CPU
    )
    host = group.attach_host(6, layout, group_heads=1 if layout == "page_unified" else None)  # type: ignore[arg-type]
    assert group.draft is not None
    packed = rows is HostRows.PACKED
    assert host.spec.num_layers == (3 if packed else 2)
    assert (group.draft_host is None) == packed
    assert group.bytes_per_page == SPEC.bytes_per_page + DRAFT.bytes_per_page
    group.device.kv.copy_(torch.rand_like(group.device.kv))
    group.draft.kv.copy_(torch.rand_like(group.draft.kv))
    want_t, want_d = group.device.kv.clone(), group.draft.kv.clone()
    src, dst = torch.tensor([1, 5]), torch.tensor([4, 0])
    for pair in group.tier_views():
        move_pages(*pair.backup(), src, dst)
    group.device.kv.zero_()
    group.draft.kv.zero_()
    for pair in group.tier_views():
        move_pages(*pair.load(), dst, torch.tensor([2, 7]))
    ps = SPEC.page_size
    for got, want in ((group.device.kv, want_t), (group.draft.kv, want_d)):
        for a, b in ((2, 1), (7, 5)):
            assert torch.equal(got[:, :, a * ps : (a + 1) * ps], want[:, :, b * ps : (b + 1) * ps])
        assert torch.count_nonzero(got[:, :, : 2 * ps]) == 0  # pages 0, 1 untouched


def test_draft_host_rows_are_chosen_from_the_shapes() -> None:
    narrow = KVSpec(num_layers=1, num_kv_heads=1, head_dim=4, page_size=4, dtype=torch.float64)
    assert draft_host_rows("auto", SPEC, DRAFT) is HostRows.PACKED
    assert draft_host_rows("auto", SPEC, narrow) is HostRows.SIDECAR
    assert draft_host_rows("sidecar", SPEC, DRAFT) is HostRows.SIDECAR
    with pytest.raises(ValueError, match="num_kv_heads 1 vs 2"):
        draft_host_rows("packed", SPEC, narrow)
    with pytest.raises(ValueError, match="unknown draft host mode"):
        draft_host_rows("beside", SPEC, DRAFT)
    device_only = PoolGroup([PoolMember(TARGET, SPEC), PoolMember("draft", DRAFT)], 8, CPU)
    with pytest.raises(UnsupportedMember, match="packed or sidecar"):
        device_only.attach_host(4, "layer_first")
