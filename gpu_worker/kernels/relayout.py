"""Relayout KV pages between the pool layouts and `page_unified`: one gather-scatter kernel.

Stored KV objects must not depend on the writer's tensor/pipeline layout (DESIGN.md section
5), so each page is cut on a grid of layer ranges x KV-head groups and stored in the
`page_unified` byte order

    MHA: (head_group, layer, K/V, token_in_page, head_in_group, head_dim)
    MLA: (layer, token_in_page, dim)        (one latent row per token: one "head", one group)

in which the layers of one head group are one contiguous byte span (one storage object).

Every tensor (the layer_first device pool, the host page_first pool and P/D staging, the
page_unified staging buffer) is seen through a `RunView`: for page `p`, layer `l`, `c` (0 = K,
1 = V; MLA has only `c = 0`), token `t` of the page and head group `g`, the run of
`run_numel = group_heads * head_dim` contiguous elements starts at element

    p * page_stride + l * layer_stride + c * kv_stride + t * token_stride + g * group_stride

of the tensor's memory. A relayout copies, for every `i`, all
`num_layers * num_kv * page_size * num_groups` runs of page `src_page_ids[i]` of `src` into
page `dst_page_ids[i]` of `dst`. It is a bit-exact copy; both sides must have the same dtype
and the same page geometry (num_layers, num_kv, page_size, num_groups, run_numel).

Backends:
- `relayout_pages_triton`: one kernel launch; `src` and `dst` must be on the same device
  (pack into a device staging buffer, then move it with one contiguous `copy_`). On CPU it
  runs only under TRITON_INTERPRET=1 (tests).
- `relayout_pages_torch`: the PyTorch reference; any devices, cross-device included.
- `relayout_pages(..., backend="auto")`: Triton when both tensors are on the same CUDA
  device, the reference otherwise.

Destination page ids should be distinct: with duplicates, which source wins is unspecified.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpu_worker.kernels.page_transfer import _BITS_DTYPES, _INDEX_DTYPES, _check_in_range

# Bytes copied by one program at most (when a page has enough tokens): the same budget as
# page_transfer's blocks. Untuned; see the benchmark.
_MAX_TILE_BYTES = 16 * 1024


@dataclass(frozen=True, slots=True, eq=False)
class RunView:
    """A KV tensor seen as `(num_pages, num_layers, num_kv, page_size, num_groups, run_numel)`.

    Run `(p, l, c, t, g)` is the `run_numel` contiguous elements starting at element
    `p * page_stride + l * layer_stride + c * kv_stride + t * token_stride + g * group_stride`
    of `tensor` (counted from `tensor.data_ptr()`). Strides are in elements. Use `pool`,
    `page_first` or `unified` rather than building one by hand; `__post_init__` checks that
    every run of every page lies inside `tensor`.
    """

    tensor: torch.Tensor  # contiguous; any dtype
    page_stride: int  # elements from page p to page p + 1
    layer_stride: int  # elements from layer l to layer l + 1
    kv_stride: int  # elements from K (c = 0) to V (c = 1)
    token_stride: int  # elements from token t of a page to token t + 1
    group_stride: int  # elements from head group g to group g + 1
    num_layers: int
    num_kv: int  # 2 (K and V) for MHA, 1 for MLA
    page_size: int  # tokens per page
    num_groups: int  # KV-head groups per token
    run_numel: int  # group_heads * head_dim

    def __post_init__(self) -> None:
        if not self.tensor.is_contiguous():
            raise ValueError("RunView.tensor must be contiguous")
        for name in (
            "page_stride",
            "layer_stride",
            "kv_stride",
            "token_stride",
            "group_stride",
            "num_layers",
            "num_kv",
            "page_size",
            "num_groups",
            "run_numel",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"RunView.{name} must be positive, got {getattr(self, name)}")
        if self._page_extent() > self.tensor.numel():
            raise ValueError(
                f"one page spans {self._page_extent()} elements but the tensor holds "
                f"only {self.tensor.numel()}"
            )

    @classmethod
    def pool(cls, tensor: torch.Tensor, page_size: int, group_heads: int) -> RunView:
        """View a `(num_layers, num_kv, num_slots, num_kv_heads, head_dim)` contiguous pool.

        This is the device pool's layout (and the host `layer_first` layout): num_kv is 2
        for MHA, 1 for MLA (`num_kv_heads = 1`, `head_dim = latent_dim`). Page `p` covers
        slots `[p * page_size, (p + 1) * page_size)`; `group_heads` consecutive heads form
        one group and must divide num_kv_heads.
        """
        if tensor.dim() != 5 or tensor.shape[1] not in (1, 2):
            raise ValueError(
                "pool expects (num_layers, num_kv, num_slots, num_kv_heads, head_dim) with "
                f"num_kv 1 or 2, got shape {tuple(tensor.shape)}"
            )
        num_layers, num_kv, num_slots, num_kv_heads, head_dim = tensor.shape
        if page_size <= 0 or num_slots % page_size:
            raise ValueError(f"num_slots={num_slots} is not a multiple of page_size={page_size}")
        _check_group_heads(num_kv_heads, group_heads)
        slot_numel = num_kv_heads * head_dim
        return cls(
            tensor=tensor,
            page_stride=page_size * slot_numel,
            layer_stride=num_kv * num_slots * slot_numel,
            kv_stride=num_slots * slot_numel,
            token_stride=slot_numel,
            group_stride=group_heads * head_dim,
            num_layers=num_layers,
            num_kv=num_kv,
            page_size=page_size,
            num_groups=num_kv_heads // group_heads,
            run_numel=group_heads * head_dim,
        )

    @classmethod
    def page_first(cls, tensor: torch.Tensor, group_heads: int) -> RunView:
        """View a `(num_pages, num_layers, num_kv, page_size, num_kv_heads, head_dim)`
        contiguous tensor: the host `page_first` layout and P/D staging."""
        if tensor.dim() != 6 or tensor.shape[2] not in (1, 2):
            raise ValueError(
                "page_first expects (num_pages, num_layers, num_kv, page_size, num_kv_heads, "
                f"head_dim) with num_kv 1 or 2, got shape {tuple(tensor.shape)}"
            )
        _, num_layers, num_kv, page_size, num_kv_heads, head_dim = tensor.shape
        _check_group_heads(num_kv_heads, group_heads)
        slot_numel = num_kv_heads * head_dim
        return cls(
            tensor=tensor,
            page_stride=num_layers * num_kv * page_size * slot_numel,
            layer_stride=num_kv * page_size * slot_numel,
            kv_stride=page_size * slot_numel,
            token_stride=slot_numel,
            group_stride=group_heads * head_dim,
            num_layers=num_layers,
            num_kv=num_kv,
            page_size=page_size,
            num_groups=num_kv_heads // group_heads,
            run_numel=group_heads * head_dim,
        )

    @classmethod
    def unified(cls, tensor: torch.Tensor) -> RunView:
        """View a `(num_pages, num_groups, num_layers, num_kv, page_size, group_heads,
        head_dim)` contiguous tensor: the `page_unified` layout.

        `tensor[p, g, l0:l1]` is the storage object of layers `[l0, l1)` of head group `g`
        of page `p`. With num_kv, num_groups and group_heads all 1 it is the MLA object
        order `(layer, token_in_page, dim)`.
        """
        if tensor.dim() != 7 or tensor.shape[3] not in (1, 2):
            raise ValueError(
                "unified expects (num_pages, num_groups, num_layers, num_kv, page_size, "
                f"group_heads, head_dim) with num_kv 1 or 2, got shape {tuple(tensor.shape)}"
            )
        _, num_groups, num_layers, num_kv, page_size, group_heads, head_dim = tensor.shape
        run_numel = group_heads * head_dim
        group_numel = num_layers * num_kv * page_size * run_numel
        return cls(
            tensor=tensor,
            page_stride=num_groups * group_numel,
            layer_stride=num_kv * page_size * run_numel,
            kv_stride=page_size * run_numel,
            token_stride=run_numel,
            group_stride=group_numel,
            num_layers=num_layers,
            num_kv=num_kv,
            page_size=page_size,
            num_groups=num_groups,
            run_numel=run_numel,
        )

    @property
    def num_pages(self) -> int:
        """How many whole pages fit in `tensor`."""
        return (self.tensor.numel() - self._page_extent()) // self.page_stride + 1

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def geometry(self) -> tuple[int, int, int, int, int]:
        """`(num_layers, num_kv, page_size, num_groups, run_numel)`: what must match."""
        return (self.num_layers, self.num_kv, self.page_size, self.num_groups, self.run_numel)

    def runs(self) -> torch.Tensor:
        """`tensor` as a `(num_pages, num_layers, num_kv, page_size, num_groups, run_numel)`
        strided view (no copy)."""
        return torch.as_strided(
            self.tensor,
            (self.num_pages, *self.geometry),
            (
                self.page_stride,
                self.layer_stride,
                self.kv_stride,
                self.token_stride,
                self.group_stride,
                1,
            ),
        )

    def _page_extent(self) -> int:
        """Elements from the start of page 0 to the end of its last run."""
        return (
            (self.num_layers - 1) * self.layer_stride
            + (self.num_kv - 1) * self.kv_stride
            + (self.page_size - 1) * self.token_stride
            + (self.num_groups - 1) * self.group_stride
            + self.run_numel
        )


def _check_group_heads(num_kv_heads: int, group_heads: int) -> None:
    if group_heads <= 0 or num_kv_heads % group_heads:
        raise ValueError(
            f"group_heads={group_heads} must be positive and divide num_kv_heads={num_kv_heads}"
        )


# ---------------------------------------------------------------------------------------
# Input checks shared by both backends
# ---------------------------------------------------------------------------------------


def _check_relayout(
    src: RunView, dst: RunView, src_page_ids: torch.Tensor, dst_page_ids: torch.Tensor
) -> None:
    """Raise ValueError unless `src -> dst` with these ids is a valid relayout.

    The range check reads the ids' min and max: one host sync per CUDA index tensor.
    """
    if src.dtype != dst.dtype:
        raise ValueError(f"dtype mismatch: src {src.dtype}, dst {dst.dtype}")
    if src.geometry != dst.geometry:
        raise ValueError(
            "page geometry mismatch (num_layers, num_kv, page_size, num_groups, run_numel): "
            f"src {src.geometry}, dst {dst.geometry}"
        )
    for name, ids in (("src_page_ids", src_page_ids), ("dst_page_ids", dst_page_ids)):
        if ids.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
        if ids.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{name} must be int32 or int64, got {ids.dtype}")
    if src_page_ids.numel() != dst_page_ids.numel():
        raise ValueError(
            f"src_page_ids has {src_page_ids.numel()} ids, dst_page_ids {dst_page_ids.numel()}"
        )
    _check_in_range("src_page_ids", src_page_ids, src.num_pages)
    _check_in_range("dst_page_ids", dst_page_ids, dst.num_pages)


# ---------------------------------------------------------------------------------------
# PyTorch reference
# ---------------------------------------------------------------------------------------


def relayout_pages_torch(
    src: RunView, dst: RunView, src_page_ids: torch.Tensor, dst_page_ids: torch.Tensor
) -> None:
    """Reference: copy page `src_page_ids[i]` of `src` to page `dst_page_ids[i]` of `dst`.

    src_page_ids, dst_page_ids: (n,) int32 or int64, on any device.
    `src` and `dst` may be on different devices: the runs are gathered on the source
    device into a `(n, num_layers, num_kv, page_size, num_groups, run_numel)` buffer, moved,
    and scattered on the destination device. A move to the GPU is stream-ordered
    (non-blocking); a move to the host is blocking, so the pages are in `dst` when this
    returns.
    """
    _check_relayout(src, dst, src_page_ids, dst_page_ids)
    if src_page_ids.numel() == 0:
        return
    src_ids = src_page_ids.to(src.device, torch.int64)
    dst_ids = dst_page_ids.to(dst.device, torch.int64)
    pages = src.runs()[src_ids]  # (n, num_layers, num_kv, page_size, num_groups, run_numel)
    if src.device != dst.device:
        pages = pages.to(dst.device, non_blocking=dst.device.type == "cuda")
    dst.runs()[dst_ids] = pages


# ---------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------


@triton.jit
def _relayout_kernel(
    src_ptr,  # *T: element 0 of the source tensor
    dst_ptr,  # *T: element 0 of the destination tensor
    src_page_ids_ptr,  # *int32|int64 (n,): source page of transfer i
    dst_page_ids_ptr,  # *int32|int64 (n,): destination page of transfer i
    src_page_stride,  # source strides, in elements
    src_layer_stride,
    src_kv_stride,
    src_token_stride,
    src_group_stride,
    dst_page_stride,  # destination strides, in elements
    dst_layer_stride,
    dst_kv_stride,
    dst_token_stride,
    dst_group_stride,
    num_kv,  # 2 (MHA) or 1 (MLA)
    num_groups,  # head groups per token
    page_size,  # tokens per page
    run_numel,  # contiguous elements of one (page, layer, kv, token, group) run
    BLOCK_T: tl.constexpr,  # tokens copied by one program; a power of two
    BLOCK_R: tl.constexpr,  # next power of two >= run_numel
    EVEN: tl.constexpr,  # page_size % BLOCK_T == 0 and run_numel == BLOCK_R: no mask
):
    """Program (i, (l * num_kv + c) * num_groups + g, j) copies the runs of tokens
    [j * BLOCK_T, (j + 1) * BLOCK_T) of (layer l, kv c, group g) from page src_page_ids[i]
    to page dst_page_ids[i]: a (BLOCK_T, BLOCK_R) tile."""
    transfer = tl.program_id(0)
    layer_kv_group = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    group = layer_kv_group % num_groups
    layer_kv = layer_kv_group // num_groups
    layer = layer_kv // num_kv
    kv = layer_kv % num_kv
    # Offsets in int64: a host pool easily holds more than 2**31 elements.
    src_page = tl.load(src_page_ids_ptr + transfer).to(tl.int64)
    dst_page = tl.load(dst_page_ids_ptr + transfer).to(tl.int64)
    src_start = (
        src_page * src_page_stride
        + layer * src_layer_stride
        + kv * src_kv_stride
        + group * src_group_stride
    )
    dst_start = (
        dst_page * dst_page_stride
        + layer * dst_layer_stride
        + kv * dst_kv_stride
        + group * dst_group_stride
    )

    tokens = (chunk * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # (BLOCK_T,) in the page
    elems = tl.arange(0, BLOCK_R)  # (BLOCK_R,) within a run
    src_offs = src_start + tokens[:, None] * src_token_stride + elems[None, :]  # (T, R)
    dst_offs = dst_start + tokens[:, None] * dst_token_stride + elems[None, :]  # (T, R)
    if EVEN:
        values = tl.load(src_ptr + src_offs)
        tl.store(dst_ptr + dst_offs, values)
    else:
        mask = (tokens[:, None] < page_size) & (elems[None, :] < run_numel)
        values = tl.load(src_ptr + src_offs, mask=mask)
        tl.store(dst_ptr + dst_offs, values, mask=mask)


def relayout_pages_triton(
    src: RunView,
    dst: RunView,
    src_page_ids: torch.Tensor,
    dst_page_ids: torch.Tensor,
    *,
    block_tokens: int | None = None,
) -> None:
    """Copy page `src_page_ids[i]` of `src` to page `dst_page_ids[i]` of `dst` in one launch.

    src, dst: on the same device, same dtype, same page geometry.
    src_page_ids, dst_page_ids: (n,) int32 or int64, on that device.
    block_tokens: tokens per program, a power of two; by default as many as fit in 16 KiB
    of runs (at least one), or the whole page when smaller. Asynchronous on CUDA
    (stream-ordered), apart from the range check's host sync.
    """
    _check_relayout(src, dst, src_page_ids, dst_page_ids)
    device = src.device
    if dst.device != device:
        raise ValueError(
            f"the Triton path needs src and dst on one device, got {device} and {dst.device}; "
            "use relayout_pages_torch or a device staging buffer"
        )
    for name, ids in (("src_page_ids", src_page_ids), ("dst_page_ids", dst_page_ids)):
        if ids.device != device:
            raise ValueError(f"{name} is on {ids.device}, the tensors on {device}")
    num_transfers = src_page_ids.numel()
    if num_transfers == 0:
        return
    itemsize = src.tensor.element_size()
    if itemsize not in _BITS_DTYPES:
        raise ValueError(f"unsupported element size {itemsize} ({src.dtype})")
    block_runs = triton.next_power_of_2(src.run_numel)
    if block_tokens is None:
        fit = max(1, _MAX_TILE_BYTES // (block_runs * itemsize))  # tokens in the budget
        block_tokens = min(triton.next_power_of_2(src.page_size), 1 << (fit.bit_length() - 1))
    if block_tokens <= 0 or block_tokens & (block_tokens - 1):
        raise ValueError(f"block_tokens must be a power of two, got {block_tokens}")

    bits = _BITS_DTYPES[itemsize]
    grid = (
        num_transfers,
        src.num_layers * src.num_kv * src.num_groups,
        triton.cdiv(src.page_size, block_tokens),
    )
    on_cuda = device.type == "cuda"
    with torch.cuda.device(device) if on_cuda else contextlib.nullcontext():
        _relayout_kernel[grid](
            src.tensor.view(bits),
            dst.tensor.view(bits),
            src_page_ids,
            dst_page_ids,
            src.page_stride,
            src.layer_stride,
            src.kv_stride,
            src.token_stride,
            src.group_stride,
            dst.page_stride,
            dst.layer_stride,
            dst.kv_stride,
            dst.token_stride,
            dst.group_stride,
            src.num_kv,
            src.num_groups,
            src.page_size,
            src.run_numel,
            BLOCK_T=block_tokens,
            BLOCK_R=block_runs,
            EVEN=src.page_size % block_tokens == 0 and src.run_numel == block_runs,
        )


# ---------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------


def relayout_pages(
    src: RunView,
    dst: RunView,
    src_page_ids: torch.Tensor,
    dst_page_ids: torch.Tensor,
    backend: str = "auto",
) -> None:
    """Copy page `src_page_ids[i]` of `src` to page `dst_page_ids[i]` of `dst`.

    src_page_ids, dst_page_ids: (n,) int32 or int64; n == 0 is a no-op.
    backend: "triton", "torch", or "auto" (Triton when both tensors are on the same CUDA
    device, the torch reference otherwise). Raises ValueError on any invalid input.
    """
    if backend == "auto":
        same_cuda = src.device.type == "cuda" and src.device == dst.device
        backend = "triton" if same_cuda else "torch"
    if backend == "triton":
        relayout_pages_triton(src, dst, src_page_ids, dst_page_ids)
    elif backend == "torch":
        relayout_pages_torch(src, dst, src_page_ids, dst_page_ids)
    else:
        raise ValueError(f"unknown backend {backend!r}; choose 'auto', 'torch' or 'triton'")
