"""Which stored objects hold a rank's part of a page: the two key schemes (DESIGN.md 5).

- `rank-suffix`: one object per page per rank shard, named `{page_hash}_tp{t}of{T}pp{p}of{P}`
  (`shard_names`) and laid out as the rank's own page (`page_first`: layers, K/V, tokens, its heads, dim).
  Only an engine of the same layout can read it.
- `unified`: each page is cut on a fixed grid of layer ranges (`--hicache-storage-layer-
  partition` layers each) x KV-head groups (`--hicache-storage-head-partition` heads each)
  shared by every deployment of the model; object `{page_hash}_{namespace}_L{a}-{b}_H{g}`
  holds layers a..b (inclusive) of head group g in the order (layer, K/V, token_in_page,
  head_in_group, head_dim), so a TP4/PP2 writer and a TP2/PP1 reader use the same objects:
  each rank reads and writes exactly the cells its layers x heads cover. MLA's latent KV is
  replicated across TP: one head group, no `_H`, (layer, token_in_page, dim), and only TP
  rank 0 writes it.

The namespace (`StorageNamespace`) is a versioned, strict, frozen description hashed
canonically: schema version, model id, logical KV dtype, page size, replication mode, total
KV heads and head size, the layer and head partitions and the object layout; nothing about
TP or PP. Deployments that share objects must agree on all of it, so any other setting
(dtype, page size, grid, model) never hits.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Literal

from gpu_worker.parallel.config import ParallelConfig

SCHEMA_VERSION = 1
KeyScheme = Literal["rank-suffix", "unified"]
KEY_SCHEMES: tuple[KeyScheme, ...] = ("rank-suffix", "unified")
Replication = Literal["mha_sharded", "mla_replicated"]
MHA_LAYOUT = "head_group,layer,kv,token,head,dim"
MLA_LAYOUT = "layer,token,dim"


@dataclass(frozen=True, slots=True)
class StorageNamespace:
    """The identity of a stored page's objects; see the module docstring."""

    model: str
    kv_dtype: str  # logical KV dtype ("float32", "bfloat16", ...)
    page_size: int
    replication: Replication
    num_kv_heads: int  # the whole model's (MLA: 1)
    head_dim: int  # elements per head per token (MLA: the latent row)
    num_layers: int  # the whole model's
    layer_partition: int  # layers per object
    head_partition: int  # KV heads per object (MLA: 1)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.replication not in ("mha_sharded", "mla_replicated"):
            raise ValueError(f"unknown replication mode {self.replication!r}")
        for name in (
            "page_size",
            "num_kv_heads",
            "head_dim",
            "num_layers",
            "layer_partition",
            "head_partition",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"StorageNamespace.{name} must be a positive int, got {value!r}")
        if self.num_layers % self.layer_partition:
            raise ValueError(
                f"--hicache-storage-layer-partition {self.layer_partition} does not divide the "
                f"model's {self.num_layers} layers"
            )
        if self.num_kv_heads % self.head_partition:
            raise ValueError(
                f"--hicache-storage-head-partition {self.head_partition} does not divide the "
                f"model's {self.num_kv_heads} KV heads"
            )
        if self.replication == "mla_replicated" and (self.num_kv_heads, self.head_partition) != (
            1,
            1,
        ):
            raise ValueError("MLA's latent KV has one head and no head partition")

    @property
    def object_layout(self) -> str:
        return MHA_LAYOUT if self.replication == "mha_sharded" else MLA_LAYOUT

    @property
    def num_groups(self) -> int:
        return self.num_kv_heads // self.head_partition

    @property
    def num_layer_ranges(self) -> int:
        return self.num_layers // self.layer_partition

    @property
    def digest(self) -> str:
        """16 hex chars of blake2b over the canonical JSON (sorted keys, no spaces)."""
        fields = asdict(self) | {"object_layout": self.object_layout}
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


@dataclass(frozen=True, slots=True)
class Cell:
    """One object of a page: layers [layer_start, layer_end] of head group `group`."""

    layer_start: int  # global layer index, inclusive
    layer_end: int  # inclusive
    group: int  # global head group; -1: MLA (no head groups)

    def suffix(self, namespace_digest: str) -> str:
        head = "" if self.group < 0 else f"_H{self.group}"
        return f"_{namespace_digest}_L{self.layer_start}-{self.layer_end}{head}"


@dataclass(frozen=True, slots=True)
class ShardCells:
    """The cells of one rank's shard, in its local order: head group outer, layer range
    inner (so one local head group's layer ranges are consecutive, as in `page_unified`).

    `local_layer_start`/`local_group_start` map a cell to the rank's own page: the cell of
    layers [a, b] and group g is local layers [a - layer_offset, b - layer_offset] of local
    head group g - group_offset."""

    cells: tuple[Cell, ...]
    layer_offset: int  # the shard's first global layer
    group_offset: int  # the shard's first global head group (0 for MLA)
    writes: bool  # False for a TP rank > 0 of a replicated (MLA) pool

    @property
    def per_page(self) -> int:
        return len(self.cells)

    def suffixes(self, namespace_digest: str) -> list[str]:
        return [c.suffix(namespace_digest) for c in self.cells]


def shard_cells(
    ns: StorageNamespace,
    layers: tuple[int, int],
    heads: tuple[int, int],
    tp_rank: int,
) -> ShardCells:
    """The cells a rank holding global layers [layers[0], layers[1]) and KV heads
    [heads[0], heads[1]) reads and writes. Raises ValueError, naming the flag to change,
    when the shard does not lie on the grid."""
    (l0, l1), (h0, h1) = layers, heads
    lp, hp = ns.layer_partition, ns.head_partition
    if l0 % lp or l1 % lp:
        raise ValueError(
            f"this rank holds layers {l0}-{l1 - 1}, which do not start and end on the storage "
            f"grid of {lp} layers: choose a --hicache-storage-layer-partition that divides "
            "every pipeline stage's layer count"
        )
    ranges = [(a, a + lp - 1) for a in range(l0, l1, lp)]
    if ns.replication == "mla_replicated":
        cells = tuple(Cell(a, b, -1) for a, b in ranges)
        return ShardCells(cells, l0, 0, writes=tp_rank == 0)
    if h0 % hp or h1 % hp:
        raise ValueError(
            f"this rank holds KV heads {h0}-{h1 - 1}, which do not start and end on the "
            f"storage grid of {hp} heads: choose a --hicache-storage-head-partition that "
            "divides every tensor-parallel rank's KV head count"
        )
    groups = range(h0 // hp, h1 // hp)
    cells = tuple(Cell(a, b, g) for g in groups for a, b in ranges)
    return ShardCells(cells, l0, h0 // hp, writes=True)


@dataclass(frozen=True, slots=True)
class ShardNames:
    """The rank-suffix scheme's names for one rank of an engine layout."""

    shard: str  # the object suffix of this rank's part, e.g. "tp0of2pp1of2"
    layout: str  # the engine layout, e.g. "tp2pp2" (only engines of the same one share)


def shard_names(parallel: ParallelConfig, rank: int, replicated: bool) -> ShardNames:
    """The rank-suffix names of world rank `rank` of an engine of layout `parallel`.

    `replicated`: KV is the same on every TP rank of a stage (MLA's latent), so every TP
    rank names TP rank 0's objects. A CP size above 1 appears in both names
    (`..cp{c}of{C}..`); at CP 1 the names are the ones stored objects have always had."""
    where = parallel.coords(rank)
    tp, pp, cp = parallel.tp_size, parallel.pp_size, parallel.cp_size
    cp_tag = f"cp{where.cp}of{cp}" if cp > 1 else ""
    shard = f"tp{0 if replicated else where.tp}of{tp}{cp_tag}pp{where.pp}of{pp}"
    layout = f"tp{tp}{f'cp{cp}' if cp > 1 else ''}pp{pp}"
    return ShardNames(shard, layout)
