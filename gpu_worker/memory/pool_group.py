"""Every KV-like pool of one engine, as one group over one logical slot mapping.

The group is what the cache tiers move: a backup, a load or a storage read of a set of
pages moves every member's rows of those pages in one operation that completes in one
event (`PoolGroup.tier_views` gives the view pairs a copy walks). The device page ids are
the group's: one allocator (the target pool's) hands them out, and every member reads a
page id as the same tokens.

The group has the target model's pool, and with speculative decoding a draft's. DESIGN
section 4 declares how the draft model's KV (and any indexer or recurrent state) joins it,
as `HostRows` says:
- `SAME_SLOTS`: the member has its own device and host pools, indexed by the group's page
  ids as they are (the target itself);
- `PACKED`: the member's layers are appended to the target's host rows (one host pool, the
  shared slot mapping): a host page holds both, and storage objects carry both;
- `SIDECAR`: the member has its own host pool and layout; its host indices are derived
  from those of a named source pool (`PoolMember.source`).
A draft (`DRAFT`) has its own device pool over the group's page ids (`PoolGroup.draft`: a
device prefix hit holds its KV too), and host rows `PACKED` or `SIDECAR` (source: the
target), chosen from the shapes by `draft_host_rows` (`--speculative-draft-host-mode`): a
host page of the target is one of the draft's, so a backup, load or storage read of the
target's pages moves the draft's rows of the same pages in the same transfer, with one
completion event (DESIGN invariant 3: no draft row is read before it landed). A draft of
`SAME_SLOTS` (device only) refuses a host tier; indexer members are refused
(`UnsupportedMember`).

Context parallelism with `--enable-kv-cache-sharding` (`KVSharding`): the target's device
pool is this CP rank's `ShardedDeviceKVPool` (its owned rows of the same logical pages and
page ids), and its host pool holds this rank's host pages only (`HostKVPool.owned_by`).
Host page ids are owner-classed like device page ids and a path's host pages continue its
owner cycle, so a device page and the host page it is backed up to or loaded from have one
owner: each rank copies the pairs it owns, local rows to local rows (`local_pairs`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gpu_worker.kernels.moves import PoolView, layer_range
from gpu_worker.kernels.relayout import RunView
from gpu_worker.memory.allocator import PageId
from gpu_worker.memory.device_pool import DeviceKVPool
from gpu_worker.memory.host_pool import HostKVPool, HostLayout
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.memory.sharded_pool import ShardedDeviceKVPool

TARGET = "target"  # the name of the target model's member
DRAFT = "draft"  # a speculative draft model's member (packed or sidecar host rows)
DRAFT_HOST_MODES = ("auto", "packed", "sidecar")  # how a draft's host rows are kept (DESIGN 4)


class HostRows(enum.Enum):
    """How a member's host rows relate to the target's (DESIGN section 4, speculative
    decoding: `packed` and `sidecar`)."""

    SAME_SLOTS = "same_slots"
    PACKED = "packed"
    SIDECAR = "sidecar"


class UnsupportedMember(ValueError):
    """A member the group cannot move yet (a draft or indexer pool), or a move a CP-sharded
    device pool does not support yet (P/D)."""


@dataclass(frozen=True, slots=True)
class PoolMember:
    """One KV-like pool of the group: its name, its shape, and how its host rows relate to
    the target's."""

    name: str
    spec: KVSpec
    host_rows: HostRows = HostRows.SAME_SLOTS
    source: str | None = None  # SIDECAR: the pool its host indices derive from

    def __post_init__(self) -> None:
        if (self.host_rows is HostRows.SIDECAR) != (self.source is not None):
            raise ValueError(f"a sidecar member, and only one, names its source pool: {self}")


@dataclass(frozen=True, slots=True)
class KVSharding:
    """This rank's place among the CP ranks that shard the device pool's pages."""

    cp_rank: int
    cp_size: int
    group: dist.ProcessGroup | None  # the CP group of the gathers
    poison: bool = False  # tests: rows no rank wrote read as NaN (`ShardedDeviceKVPool`)
    transport: str = "auto"  # --cp-gather-transport: all-gather or shared memory


@dataclass(frozen=True, slots=True)
class TierViews:
    """One member's device and host pools as views for page copies between the tiers, of
    one kind: runs of head groups for a `page_unified` host pool, whole blocks otherwise."""

    device: PoolView
    host: PoolView

    def backup(self) -> tuple[PoolView, PoolView]:
        """(source, destination) of a device -> host copy."""
        return self.device, self.host

    def load(self) -> tuple[PoolView, PoolView]:
        """(source, destination) of a host -> device copy."""
        return self.host, self.device


class PoolGroup:
    """The engine's KV pools over one slot mapping; see the module docstring.

    `device` is the target's device pool: the pool the model reads and writes, and whose
    allocator hands out the group's page ids. `host` is the target's host pool once
    `attach_host` made one (the host tier), else None.
    """

    def __init__(
        self,
        members: Sequence[PoolMember],
        num_pages: int,
        device: torch.device,
        check_reads: bool = False,
        num_owners: int = 1,
        sharding: KVSharding | None = None,
    ) -> None:
        """Device pools of `num_pages` pages for `members` (the target, maybe a draft);
        `check_reads`: fail any read of a page whose load is not consumed; `num_owners`: the
        owner classes (CP ranks) of the page ids the device allocator hands out; `sharding`:
        the target's pool holds only this CP rank's pages (its owner classes are the CP
        ranks)."""
        names = [m.name for m in members]
        draft_rows = members[1].host_rows if len(members) > 1 else None
        if (
            names not in ([TARGET], [TARGET, DRAFT])
            or members[0].host_rows is not HostRows.SAME_SLOTS
            or (draft_rows is HostRows.SIDECAR and members[1].source != TARGET)
            or (len(members) > 1 and sharding is not None)
        ):
            raise UnsupportedMember(
                f"a pool group holds the target pool ({TARGET!r}, same slots) and maybe a "
                f"draft's ({DRAFT!r}: packed, or sidecar of {TARGET!r}; unsharded); "
                f"indexer pools are not supported yet (a CP-sharded target is "
                f"`sharding`): {list(members)}"
            )
        if draft_rows is HostRows.PACKED:
            _check_packable(members[0].spec, members[1].spec)
        self.members = tuple(members)
        spec = members[0].spec
        self.device: DeviceKVPool | ShardedDeviceKVPool
        if sharding is None:
            self.device = DeviceKVPool(spec, num_pages, device, check_reads, num_owners)
        else:
            s = sharding
            if num_owners not in (1, s.cp_size):
                raise ValueError(f"a pool sharded over {s.cp_size} ranks has as many owners")
            self.device = ShardedDeviceKVPool(
                spec,
                num_pages,
                device,
                s.cp_rank,
                s.cp_size,
                s.group,
                poison=s.poison,
                transport=s.transport,
            )
        self.host: HostKVPool | None = None
        # a sidecar draft's own host pool (its pages are the target host pool's page ids)
        self.draft_host: HostKVPool | None = None
        # the draft's device pool, read and written by the group's page ids (its allocator
        # is unused): a device prefix hit of the target is one of the draft too
        self.draft: DeviceKVPool | None = None
        if len(members) > 1:
            self.draft = DeviceKVPool(members[1].spec, num_pages, device)

    @classmethod
    def target_only(
        cls,
        spec: KVSpec,
        num_pages: int,
        device: torch.device,
        check_reads: bool = False,
        num_owners: int = 1,
        sharding: KVSharding | None = None,
    ) -> PoolGroup:
        """The group of an engine without draft state: the target pool alone."""
        members = [PoolMember(TARGET, spec)]
        return cls(members, num_pages, device, check_reads, num_owners, sharding)

    def replicated_device(self, what: str) -> DeviceKVPool:
        """The target's device pool where `what` needs every page's rows on this rank."""
        if not isinstance(self.device, DeviceKVPool):
            raise UnsupportedMember(f"{what} does not support a CP-sharded device pool yet")
        return self.device

    @property
    def draft_member(self) -> PoolMember | None:
        """The draft's member (its shape and host rows), if the group has one."""
        return self.members[1] if len(self.members) > 1 else None

    @property
    def spec(self) -> KVSpec:
        """The target's KV shape."""
        return self.members[0].spec

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page across every member (what a copy between the tiers moves)."""
        return sum(m.spec.bytes_per_page for m in self.members)

    def attach_host(
        self, num_pages: int, layout: HostLayout, group_heads: int | None = None
    ) -> HostKVPool:
        """Make the host pools (the host tier) of `num_pages` pages in `layout`; returns the
        target's. `group_heads`: KV heads per group of a `page_unified` layout."""
        if self.host is not None:
            raise RuntimeError("the group has its host pools already")
        draft = self.members[1] if self.draft is not None else None
        if draft is not None and draft.host_rows is HostRows.SAME_SLOTS:
            raise UnsupportedMember(
                "a draft without host rows (same slots, device only) has no host tier: "
                "declare it packed or sidecar"
            )
        device = self.device
        owners = device.allocator.num_owners
        owned_by = device.cp_rank if isinstance(device, ShardedDeviceKVPool) else None
        spec = self.spec
        if draft is not None and draft.host_rows is HostRows.PACKED:
            # one host row carries the target's layers, then the draft's
            layers = spec.num_layers + draft.spec.num_layers
            spec = dataclasses.replace(spec, num_layers=layers)
        self.host = HostKVPool(
            spec, num_pages, layout, device.device, group_heads, owners, owned_by
        )
        if draft is not None and draft.host_rows is HostRows.SIDECAR:
            # its own layout's pool, every head one group (its heads need not divide like
            # the target's); its page ids are the target host pool's, its allocator unused
            heads = None if group_heads is None else draft.spec.num_kv_heads
            self.draft_host = HostKVPool(
                draft.spec, num_pages, layout, device.device, heads, owners, owned_by
            )
            self.host.sidecar = self.draft_host
        return self.host

    def tier_views(self) -> list[TierViews]:
        """Every member's (device, host) views of their local pages, target first: a copy
        between the tiers moves the same local page ids (`local_pairs`) through each pair,
        in one operation. A packed draft's host view is the draft's layer range of the
        target's host rows (and the target's its own range); a sidecar's is its own pool,
        at the same page ids (1:1 with its source, the target's)."""
        if self.host is None:
            raise RuntimeError("the group has no host pools")
        device, host = self.device, self.host.page_view()
        if isinstance(device, ShardedDeviceKVPool):
            ps = self.spec.page_size
            if isinstance(host, RunView):  # the local pages as runs of head groups
                return [TierViews(RunView.pool(device.kv, ps, self.host.group_heads), host)]
            return [TierViews(device.local_page_view(), host)]
        views = [_pair(device, host, self.host.group_heads)]
        if self.draft is None:
            return views
        draft = self.members[1]
        if draft.host_rows is HostRows.PACKED:
            nt = self.spec.num_layers
            total = nt + draft.spec.num_layers
            views = [_pair(device, layer_range(host, 0, nt), self.host.group_heads)]
            views.append(_pair(self.draft, layer_range(host, nt, total), self.host.group_heads))
        else:
            assert self.draft_host is not None
            d_host = self.draft_host
            views.append(_pair(self.draft, d_host.page_view(), d_host.group_heads))
        return views

    def local_pairs(
        self, device_page_ids: Sequence[int], host_page_ids: Sequence[int]
    ) -> tuple[list[int], list[int]]:
        """The (device page, host page) pairs of a copy between the tiers that this rank
        moves, as the local pages of `tier_views`: every pair as it is, or with a sharded
        pool the pairs this CP rank owns. A pair whose two pages have different owners is a
        bug upstream (the host allocation broke the owner cycle): ValueError."""
        if len(device_page_ids) != len(host_page_ids):
            raise ValueError("device and host page lists differ in length")
        device = self.device
        if not isinstance(device, ShardedDeviceKVPool):
            return list(device_page_ids), list(host_page_ids)
        n, rank = device.cp_size, device.cp_rank
        local_device, local_host = [], []
        for q, h in zip(device_page_ids, host_page_ids, strict=True):
            if q % n != h % n:
                raise ValueError(f"device page {q} and host page {h} have different CP owners")
            if q % n == rank:
                local_device.append(q // n)
                local_host.append(h // n)
        return local_device, local_host

    def mark_loading(self, page_ids: list[PageId], loading: bool) -> None:
        """Device pages a load writes, until its ACK is consumed (`check_reads` fails a
        read of them). A sharded pool has no such marks: its gather of a layer waits for
        the rank's loads in flight instead (`wait_for_restores`)."""
        if isinstance(self.device, DeviceKVPool):
            self.device.mark_pending(page_ids, loading)

    def wait_for_restores(self, wait: Callable[[int, torch.Tensor], None]) -> None:
        """A sharded pool calls `wait(layer, page_ids)` before it packs a layer's owned rows
        of logical pages `page_ids` for the gather (restore local pages -> gather ->
        attend): the host tier waits there for its loads in flight into those pages.
        Nothing to do for a replicated pool, which is read in place only after the loads
        of a batch's pages were consumed (`check_reads` enforces it)."""
        if isinstance(self.device, ShardedDeviceKVPool):
            self.device.wait_layer = wait


def _pair(device: DeviceKVPool, host: PoolView, group_heads: int) -> TierViews:
    """A replicated device pool's view of the host view's kind, paired with it."""
    if isinstance(host, RunView):
        return TierViews(device.run_view(group_heads), host)
    return TierViews(device.page_view(), host)


def _packing_mismatch(target: KVSpec, draft: KVSpec) -> list[str]:
    """What keeps `draft`'s rows out of `target`'s host rows (empty: they pack)."""
    fields = ("num_kv_heads", "head_dim", "dtype", "num_kv", "page_size")
    return [
        f"{f} {getattr(draft, f)} vs {getattr(target, f)}"
        for f in fields
        if getattr(draft, f) != getattr(target, f)
    ]


def _check_packable(target: KVSpec, draft: KVSpec) -> None:
    if wrong := _packing_mismatch(target, draft):
        raise ValueError(
            "a packed draft needs the target's row shape and dtype (draft vs target: "
            + ", ".join(wrong)
            + "): use --speculative-draft-host-mode sidecar (or auto)"
        )


def draft_host_rows(mode: str, target: KVSpec, draft: KVSpec) -> HostRows:
    """How the draft's host rows join the target's (`--speculative-draft-host-mode`):
    `auto` packs them where the row shapes and dtypes match (one host row, one storage
    object carry both; no second pool to size) and puts them beside otherwise; `packed`
    where they do not match is a clear error."""
    if mode not in DRAFT_HOST_MODES:
        raise ValueError(f"unknown draft host mode {mode!r}; choose one of {DRAFT_HOST_MODES}")
    if mode == "packed":
        _check_packable(target, draft)
        return HostRows.PACKED
    if mode == "auto" and not _packing_mismatch(target, draft):
        return HostRows.PACKED
    return HostRows.SIDECAR
