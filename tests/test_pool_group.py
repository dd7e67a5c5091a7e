"""The pool group: today the target pool alone; other members are declared, and refused."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels.page_transfer import PageView
from gpu_worker.kernels.relayout import RunView
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.memory.pool_group import (
    TARGET,
    HostRows,
    KVSharding,
    PoolGroup,
    PoolMember,
    UnsupportedMember,
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
        [PoolMember(TARGET, SPEC), PoolMember("draft", DRAFT, HostRows.PACKED)],
        [PoolMember(TARGET, SPEC), PoolMember("draft", DRAFT, HostRows.SIDECAR, TARGET)],
        [PoolMember("draft", DRAFT)],
        [PoolMember(TARGET, SPEC, HostRows.PACKED)],
        [],
    ],
)
def test_a_group_refuses_members_other_than_the_target(members: list[PoolMember]) -> None:
    """Draft, indexer and CP-sharded pools have a declared place, and no code that moves
    them yet: a group with one refuses to be built rather than leave it behind."""
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
