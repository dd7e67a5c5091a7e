"""How one rank's part of a KV page maps to stored objects (`gpu_worker/storage/layout.py`),
and how the objects move between the store and the rank's host pages.

- `RankSuffixCodec`: one object per page, the rank's own page in `page_first` order; the
  host pages are packed into (or unpacked from) a staging buffer by the page-transfer
  kernel, whatever the host layout. MLA's latent is the same on every TP rank of a stage,
  so all of them name TP rank 0's object (`tp0of{T}pp{p}of{P}`) and only rank 0 writes it.
- `UnifiedCodec`: `per_page` objects per page, one per cell of the storage grid that the
  rank's layers x heads cover; the host pool is `page_unified`, where every cell of a page
  is one contiguous span, so objects are read into and written from host memory in place.

Both are called from the storage I/O threads (`StorageIO`) on host pages that the scheduler
reserved or pinned for them; they touch no other state. A write is two steps: `stage` copies
the pages out of the host pool (the pin can go once it returns), `put` stores the copy.

A speculative draft's KV (DESIGN section 4) rides the same objects or sits beside them:
- packed (the draft's layers appended to the target's host rows): the target's objects
  carry both models' layers, under a name that names the draft (`storage_setup`), so an
  engine without that draft never reads them;
- sidecar (the draft's own host pool at the target's host pages, `HostKVPool.sidecar`):
  `PairedCodec` gives each page the target's objects and then the draft's own
  (`DraftObjects`: keys with a `.draft-{id}` tag, or in the draft's own namespace with a
  `.draft` suffix; both name the draft), read, looked up and
  written in the same batch. A page counts as stored only when both models' objects are
  whole: a missing or damaged draft object cuts the hit there, exactly as a missing target
  object does, and both models recompute the pages from there (the draft's state stays
  exact: what was read is what was written, and the rest is computed as a cold run does).

CP page sharding (`PageShare`): a page is whole on its owner rank, so its objects are the
ones a CP1 engine of the same TP x PP layout names (no rank suffix for CP) and only the
owner reads, writes or looks them up; the codecs then see the rank's local host pages.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from gpu_worker.kernels.page_transfer import PageView, transfer_pages
from gpu_worker.memory.host_pool import HostKVPool
from gpu_worker.storage import StorageBackend
from gpu_worker.storage.layout import ShardCells, StorageNamespace

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class PageShare:
    """The pages a CP rank of a sharded engine holds: page `h` (a host page id, or a path
    page when no host page is chosen yet) is rank `h % cp_size`'s, at its local host page
    `h // cp_size` (`HostKVPool.owned_by`). Host pages continue their path's owner cycle,
    so a host page and its path page have one owner."""

    cp_rank: int
    cp_size: int

    def __post_init__(self) -> None:
        if not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(f"no CP rank {self.cp_rank} of {self.cp_size}")

    def select(self, page_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """The positions in `page_ids` of this rank's pages, and their local pages."""
        n, rank = self.cp_size, self.cp_rank
        where = [i for i, h in enumerate(page_ids) if h % n == rank]
        return where, [page_ids[i] // n for i in where]


def first_missing(where: Sequence[int], num_done: int, num_pages: int) -> int:
    """The rank's view of how many leading pages of `num_pages` are whole: it checked the
    pages at positions `where` (in order) and the first `num_done` of them were whole; the
    others are other ranks' to check. The MIN of this over the ranks is the agreed count."""
    return where[num_done] if num_done < len(where) else num_pages


@dataclass(frozen=True, slots=True)
class DraftObjects:
    """Where a sidecar draft's objects are (`StorageLayout.draft`): the rank-suffix tag of
    its keys, or its own unified namespace and cells; both name the draft."""

    shard: str
    namespace: StorageNamespace | None = None
    cells: ShardCells | None = None


@dataclass(frozen=True, slots=True)
class StorageLayout:
    """How this rank names and lays out its objects: the rank-suffix scheme (`cells` None)
    or the unified one (the namespace and the cells of the rank's shard)."""

    shard: str  # the rank-suffix tag, e.g. "tp0of2pp1of2"
    namespace: StorageNamespace | None = None
    cells: ShardCells | None = None
    layout: str = ""  # the rank-suffix scheme's engine layout, e.g. "tp2pp2"
    writes: bool = True  # rank-suffix: False where another rank writes the object (MLA)
    share: PageShare | None = None  # CP sharding: the pages this rank holds (None: all)
    draft: DraftObjects | None = None  # a sidecar draft's objects beside each page's

    @property
    def scope(self) -> str:
        """Which engines can read each other's objects in one store: the same namespace
        (unified), or the same TP x PP layout and model (rank-suffix)."""
        if self.namespace is not None:
            return f"unified:{self.namespace.digest}"
        return f"rank-suffix:{self.layout}"

    @property
    def unified(self) -> bool:
        return self.cells is not None

    @property
    def group_heads(self) -> int | None:
        """KV heads per group of the `page_unified` host pool the unified scheme needs."""
        return None if self.namespace is None else self.namespace.head_partition

    def codec(self, host: HostKVPool) -> ObjectCodec:
        """The codec of `host`'s pages: the target's objects, and with a sidecar draft
        (`host.sidecar`) the draft's beside them (`PairedCodec`)."""
        codec = _codec(host, self.shard, self.namespace, self.cells, self.writes)
        if (self.draft is None) != (host.sidecar is None):
            raise ValueError(
                f"storage objects for a sidecar draft {self.draft} and a host pool with "
                f"{'a' if host.sidecar else 'no'} sidecar"
            )
        if self.draft is not None and host.sidecar is not None:
            d = self.draft
            if self.share is not None:
                raise ValueError("a sidecar draft's objects on a CP-sharded engine")
            draft = _codec(host.sidecar, d.shard, d.namespace, d.cells, self.writes, ".draft")
            codec = PairedCodec(codec, draft)
        if (self.share is None) != (host.owned_by is None) or (
            self.share is not None and self.share.cp_rank != host.owned_by
        ):
            raise ValueError(f"storage share {self.share} for a host pool of {host.owned_by}")
        codec.share = self.share
        return codec


def _codec(
    host: HostKVPool,
    shard: str,
    namespace: StorageNamespace | None,
    cells: ShardCells | None,
    writes: bool,
    tag: str = "",
) -> ObjectCodec:
    """One pool's codec: rank-suffix objects tagged `shard`, or the unified `cells` (keys
    ending in `tag`)."""
    if cells is None or namespace is None:
        spec = host.spec
        shape = (spec.num_layers, spec.num_kv, spec.page_size, spec.num_kv_heads, spec.head_dim)
        view = host.page_view()
        if not isinstance(view, PageView):
            raise ValueError(
                "the rank-suffix key scheme needs a layer_first or page_first host pool"
            )
        return RankSuffixCodec(view, shape, spec.dtype, shard, writes)
    if host.layout != "page_unified":
        raise ValueError("the unified key scheme needs the page_unified host layout")
    return UnifiedCodec(host.kv, cells, namespace.digest, tag)


class ObjectCodec(abc.ABC):
    per_page: int  # objects per page of this rank
    writes: bool  # False: this rank's objects are written by another (replicated KV)
    # CP sharding: the pages whose objects this rank moves; host ids given to `read`,
    # `stage` and `write` are then local pages (`PageShare.select`). None: every page.
    share: PageShare | None = None

    @abc.abstractmethod
    def keys(self, page_hashes: Sequence[bytes]) -> list[str]:
        """`per_page` object keys per page, page by page."""

    @abc.abstractmethod
    def read(self, backend: StorageBackend, keys: list[str], host_ids: list[int]) -> int:
        """Read the objects of pages `host_ids` (keys: `per_page` each) into those host pages;
        how many leading objects arrived whole."""

    @property
    @abc.abstractmethod
    def page_nbytes(self) -> int:
        """Bytes of one page of this rank (what `stage` copies per page)."""

    @abc.abstractmethod
    def stage(self, host_ids: list[int]) -> list[memoryview]:
        """A copy of the objects of host pages `host_ids` (`per_page` each, page by page):
        afterwards the host pages may change."""

    def put(self, backend: StorageBackend, keys: list[str], staged: list[memoryview]) -> int:
        """Store `staged` (from `stage`) under `keys`; how many leading objects are stored."""
        if not self.writes:  # another rank writes these objects: nothing is missing
            return len(keys)
        return backend.put(keys, staged)

    def write(self, backend: StorageBackend, keys: list[str], host_ids: list[int]) -> int:
        """Write the objects of host pages `host_ids`; how many leading ones are stored."""
        return self.put(backend, keys, self.stage(host_ids) if self.writes else [])


class RankSuffixCodec(ObjectCodec):
    """`{page_hash}_{shard}`: the rank's whole page, (num_layers, num_kv, page_size, heads,
    dim). With `writes` False the object is another rank's copy of the same KV (MLA)."""

    per_page = 1

    def __init__(
        self,
        host: PageView,
        page_shape: tuple[int, ...],
        dtype: torch.dtype,
        shard: str,
        writes: bool = True,
    ) -> None:
        self.host, self.page_shape, self.dtype, self.shard = host, page_shape, dtype, shard
        self.writes = writes

    def keys(self, page_hashes: Sequence[bytes]) -> list[str]:
        return [f"{h.hex()}_{self.shard}" for h in page_hashes]

    def read(self, backend: StorageBackend, keys: list[str], host_ids: list[int]) -> int:
        staging = torch.empty((len(keys), *self.page_shape), dtype=self.dtype)
        n = backend.get(keys, _rows_as_bytes(staging))
        if n:
            dst = torch.tensor(host_ids[:n], dtype=torch.int64)
            transfer_pages(PageView.page_first(staging), self.host, torch.arange(n), dst)
        return n

    @property
    def page_nbytes(self) -> int:
        return math.prod(self.page_shape) * self.dtype.itemsize

    def stage(self, host_ids: list[int]) -> list[memoryview]:
        staging = torch.empty((len(host_ids), *self.page_shape), dtype=self.dtype)
        src = torch.tensor(host_ids, dtype=torch.int64)
        transfer_pages(self.host, PageView.page_first(staging), src, torch.arange(len(host_ids)))
        return _rows_as_bytes(staging)


class UnifiedCodec(ObjectCodec):
    """`{page_hash}_{namespace}_L{a}-{b}[_H{g}]`: the cells of the rank's shard, read and
    written in place in a `page_unified` host pool (num_pages, groups, layers, kv, page_size,
    group_heads, dim); for MLA (one group, kv 1, one head) a cell is (layers, token, dim)."""

    def __init__(
        self, host_kv: torch.Tensor, cells: ShardCells, namespace_digest: str, tag: str = ""
    ) -> None:
        """`tag`: appended to every key (a sidecar draft's `.draft`)."""
        self.host_kv = host_kv
        self.cells = cells
        self.per_page = cells.per_page
        self.writes = cells.writes
        self._suffixes = [x + tag for x in cells.suffixes(namespace_digest)]

    def keys(self, page_hashes: Sequence[bytes]) -> list[str]:
        return [h.hex() + s for h in page_hashes for s in self._suffixes]

    def read(self, backend: StorageBackend, keys: list[str], host_ids: list[int]) -> int:
        return backend.get(keys, self._views(host_ids))

    @property
    def page_nbytes(self) -> int:
        return self.host_kv[0].numel() * self.host_kv.element_size()

    def stage(self, host_ids: list[int]) -> list[memoryview]:
        return [memoryview(bytes(view)) for view in self._views(host_ids)]

    def _views(self, host_ids: list[int]) -> list[memoryview]:
        """The byte span of every cell of every page, in key order."""
        out = []
        cells = self.cells
        for page in host_ids:
            for cell in cells.cells:
                group = cell.group - cells.group_offset if cell.group >= 0 else 0
                a = cell.layer_start - cells.layer_offset
                b = cell.layer_end - cells.layer_offset + 1
                span = self.host_kv[page, group, a:b]  # contiguous: (layers, kv, ps, H, D)
                out.append(span.reshape(-1).view(torch.uint8).numpy().data)
        return out


class PairedCodec(ObjectCodec):
    """A page's target objects, then its sidecar draft's (at the same host page ids of the
    draft's own host pool), as one codec: every key list, read, lookup and write has
    `per_page` = both counts per page, page by page, so the storage tier's batches, ACKs
    and leading-page counts cover both models alike. A page is whole only when all its
    objects are (see the module docstring)."""

    def __init__(self, target: ObjectCodec, draft: ObjectCodec) -> None:
        self.target, self.draft = target, draft
        self.per_page = target.per_page + draft.per_page
        self.writes = target.writes

    def _split(self, items: Sequence[_T]) -> tuple[list[_T], list[_T]]:
        """Page-by-page `items` (keys, staged objects) as the target's and the draft's."""
        k, a = self.per_page, self.target.per_page
        pages = [items[i : i + k] for i in range(0, len(items), k)]
        return [x for p in pages for x in p[:a]], [x for p in pages for x in p[a:]]

    def keys(self, page_hashes: Sequence[bytes]) -> list[str]:
        out: list[str] = []
        for h in page_hashes:
            out += self.target.keys([h]) + self.draft.keys([h])
        return out

    def read(self, backend: StorageBackend, keys: list[str], host_ids: list[int]) -> int:
        target_keys, draft_keys = self._split(keys)
        n = self.target.read(backend, target_keys, host_ids) // self.target.per_page
        k = self.draft.per_page
        if n:  # the draft's objects of the pages whose target objects arrived whole
            n = self.draft.read(backend, draft_keys[: n * k], host_ids[:n]) // k
        return n * self.per_page

    @property
    def page_nbytes(self) -> int:
        return self.target.page_nbytes + self.draft.page_nbytes

    def stage(self, host_ids: list[int]) -> list[memoryview]:
        a, b = self.target.per_page, self.draft.per_page
        target, draft = self.target.stage(host_ids), self.draft.stage(host_ids)
        out: list[memoryview] = []
        for i in range(len(host_ids)):
            out += target[i * a : (i + 1) * a] + draft[i * b : (i + 1) * b]
        return out


def _rows_as_bytes(staging: torch.Tensor) -> list[memoryview]:
    """Writable byte views of each page of a staging tensor (any dtype, bf16 too)."""
    raw = staging.view(torch.uint8).reshape(staging.shape[0], -1).numpy()
    return [raw[i].data for i in range(raw.shape[0])]
