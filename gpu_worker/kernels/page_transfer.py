"""Copy whole KV pages between pools of different layouts: one gather-scatter kernel.

Every pool (the device pool, the host pool in either layout, the staging buffer) is seen
through a `PageView`: for page `p`, layer `l` and `c` (0 = K, 1 = V; MLA has only its
latent, `c = 0`) the block of `page_numel = page_size * num_kv_heads * head_dim` contiguous
elements starts at element

    p * page_stride + l * layer_stride + c * kv_stride

of the tensor's memory. A transfer copies, for every `i`, all `num_layers * num_kv` blocks
of page `src_page_ids[i]` of `src` into page `dst_page_ids[i]` of `dst`. It is a bit-exact
copy; both sides must have the same dtype and block geometry.

Backends:
- `transfer_pages_triton`: one kernel launch; `src` and `dst` must be on the same device.
  It does not read host memory from the GPU: a host <-> device move runs the kernel between
  the device pool and a device staging buffer (`page_first`, pages in transfer order),
  then moves the staging buffer with one contiguous `copy_` (into or out of pinned host
  memory). On CPU it runs only under TRITON_INTERPRET=1 (tests).
- `transfer_pages_torch`: the PyTorch reference; any devices, cross-device included.
- `transfer_pages(..., backend="auto")`: Triton when both pools are on the same CUDA
  device, the reference otherwise.

Destination page ids should be distinct: with duplicates, which source wins is unspecified.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_INDEX_DTYPES = (torch.int32, torch.int64)
# The kernel copies raw bits: each dtype is viewed as the integer type of its width.
_BITS_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Bytes copied by one program when a block is large: with Triton's default 4 warps each
# thread moves 128 bytes as eight 16-byte accesses. Untuned; see the benchmark.
_MAX_BLOCK_BYTES = 16 * 1024


@dataclass(frozen=True, slots=True, eq=False)
class PageView:
    """A KV pool tensor seen as `(num_pages, num_layers, num_kv, page_numel)` blocks.

    Block `(p, l, c)` is the `page_numel` contiguous elements starting at element
    `p * page_stride + l * layer_stride + c * kv_stride` of `tensor` (counted from
    `tensor.data_ptr()`). Strides are in elements. Use `layer_first` or `page_first`
    rather than building one by hand; `__post_init__` checks that every block of every
    page lies inside `tensor`.
    """

    tensor: torch.Tensor  # the pool, contiguous; any dtype
    page_stride: int  # elements from page p to page p + 1
    layer_stride: int  # elements from layer l to layer l + 1
    kv_stride: int  # elements from K (c = 0) to V (c = 1)
    num_layers: int
    page_numel: int  # page_size * num_kv_heads * head_dim
    num_kv: int = 2  # 2 (K and V) for MHA, 1 for MLA

    def __post_init__(self) -> None:
        if not self.tensor.is_contiguous():
            raise ValueError("PageView.tensor must be contiguous")
        for name in ("page_stride", "layer_stride", "kv_stride", "num_layers", "page_numel"):
            if getattr(self, name) <= 0:
                raise ValueError(f"PageView.{name} must be positive, got {getattr(self, name)}")
        if self.num_kv not in (1, 2):
            raise ValueError(f"PageView.num_kv must be 1 or 2, got {self.num_kv}")
        if self._page_extent() > self.tensor.numel():
            raise ValueError(
                f"one page spans {self._page_extent()} elements but the tensor holds "
                f"only {self.tensor.numel()}"
            )

    @classmethod
    def layer_first(cls, tensor: torch.Tensor, page_size: int) -> PageView:
        """View a `(num_layers, num_kv, num_slots, num_kv_heads, head_dim)` contiguous pool.

        This is the device pool's layout (and the host `layer_first` layout): num_kv is 2
        for MHA, 1 for MLA. Page `p` covers slots `[p * page_size, (p + 1) * page_size)`.
        """
        if tensor.dim() != 5 or tensor.shape[1] not in (1, 2):
            raise ValueError(
                "layer_first expects (num_layers, num_kv, num_slots, num_kv_heads, head_dim) "
                f"with num_kv 1 or 2, got shape {tuple(tensor.shape)}"
            )
        num_layers, num_kv, num_slots, num_kv_heads, head_dim = tensor.shape
        if page_size <= 0 or num_slots % page_size:
            raise ValueError(f"num_slots={num_slots} is not a multiple of page_size={page_size}")
        slot_numel = num_kv_heads * head_dim
        return cls(
            tensor=tensor,
            page_stride=page_size * slot_numel,
            layer_stride=num_kv * num_slots * slot_numel,
            kv_stride=num_slots * slot_numel,
            num_layers=num_layers,
            page_numel=page_size * slot_numel,
            num_kv=num_kv,
        )

    @classmethod
    def page_first(cls, tensor: torch.Tensor) -> PageView:
        """View a `(num_pages, num_layers, num_kv, page_size, num_kv_heads, head_dim)`
        contiguous tensor: the host `page_first` layout and the staging buffer."""
        if tensor.dim() != 6 or tensor.shape[2] not in (1, 2):
            raise ValueError(
                "page_first expects (num_pages, num_layers, num_kv, page_size, num_kv_heads, "
                f"head_dim) with num_kv 1 or 2, got shape {tuple(tensor.shape)}"
            )
        _, num_layers, num_kv, page_size, num_kv_heads, head_dim = tensor.shape
        page_numel = page_size * num_kv_heads * head_dim
        return cls(
            tensor=tensor,
            page_stride=num_layers * num_kv * page_numel,
            layer_stride=num_kv * page_numel,
            kv_stride=page_numel,
            num_layers=num_layers,
            page_numel=page_numel,
            num_kv=num_kv,
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

    def blocks(self) -> torch.Tensor:
        """`tensor` as a `(num_pages, num_layers, num_kv, page_numel)` strided view (no copy)."""
        return torch.as_strided(
            self.tensor,
            (self.num_pages, self.num_layers, self.num_kv, self.page_numel),
            (self.page_stride, self.layer_stride, self.kv_stride, 1),
        )

    def _page_extent(self) -> int:
        """Elements from the start of page 0 to the end of its last block."""
        last_block = (self.num_layers - 1) * self.layer_stride + (self.num_kv - 1) * self.kv_stride
        return last_block + self.page_numel


# ---------------------------------------------------------------------------------------
# Input checks shared by both backends
# ---------------------------------------------------------------------------------------


def _check_transfer(
    src: PageView, dst: PageView, src_page_ids: torch.Tensor, dst_page_ids: torch.Tensor
) -> None:
    """Raise ValueError unless `src -> dst` with these ids is a valid transfer.

    The range check reads the ids' min and max: one host sync per CUDA index tensor.
    """
    if src.dtype != dst.dtype:
        raise ValueError(f"dtype mismatch: src {src.dtype}, dst {dst.dtype}")
    shapes = [(v.num_layers, v.num_kv, v.page_numel) for v in (src, dst)]
    if shapes[0] != shapes[1]:
        raise ValueError(
            f"page shape mismatch (num_layers, num_kv, page_numel): src {shapes[0]}, "
            f"dst {shapes[1]}"
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


def _check_in_range(name: str, ids: torch.Tensor, num_pages: int) -> None:
    if ids.numel() == 0:
        return
    lo, hi = torch.stack(torch.aminmax(ids)).tolist()
    if lo < 0 or hi >= num_pages:
        raise ValueError(f"{name} must lie in [0, {num_pages}), got min {lo} and max {hi}")


# ---------------------------------------------------------------------------------------
# PyTorch reference
# ---------------------------------------------------------------------------------------


def transfer_pages_torch(
    src: PageView, dst: PageView, src_page_ids: torch.Tensor, dst_page_ids: torch.Tensor
) -> None:
    """Reference: copy page `src_page_ids[i]` of `src` to page `dst_page_ids[i]` of `dst`.

    src_page_ids, dst_page_ids: (n,) int32 or int64, on any device.
    `src` and `dst` may be on different devices: the pages are gathered on the source
    device into a `(n, num_layers, num_kv, page_numel)` buffer, moved, and scattered on the
    destination device. A move to the GPU is stream-ordered (non-blocking); a move to the
    host is blocking, so the pages are in `dst` when this returns.
    """
    _check_transfer(src, dst, src_page_ids, dst_page_ids)
    if src_page_ids.numel() == 0:
        return
    src_ids = src_page_ids.to(src.device, torch.int64)
    dst_ids = dst_page_ids.to(dst.device, torch.int64)
    pages = src.blocks()[src_ids]  # (n, num_layers, num_kv, page_numel), on src.device
    if src.device != dst.device:
        pages = pages.to(dst.device, non_blocking=dst.device.type == "cuda")
    dst.blocks()[dst_ids] = pages


# ---------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------


@triton.jit
def _page_transfer_kernel(
    src_ptr,  # *T: element 0 of the source pool
    dst_ptr,  # *T: element 0 of the destination pool
    src_page_ids_ptr,  # *int32|int64 (n,): source page of transfer i
    dst_page_ids_ptr,  # *int32|int64 (n,): destination page of transfer i
    src_page_stride,  # source strides, in elements
    src_layer_stride,
    src_kv_stride,
    dst_page_stride,  # destination strides, in elements
    dst_layer_stride,
    dst_kv_stride,
    num_kv,  # 2 (MHA) or 1 (MLA)
    page_numel,  # elements in one (page, layer, kv) block
    BLOCK: tl.constexpr,  # elements copied by one program; a power of two
    EVEN: tl.constexpr,  # page_numel % BLOCK == 0: no mask needed
):
    """Program (i, num_kv * l + c, j) copies elements [j * BLOCK, (j + 1) * BLOCK) of block
    (l, c) from page src_page_ids[i] to page dst_page_ids[i]."""
    transfer = tl.program_id(0)
    layer_kv = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    layer = layer_kv // num_kv
    kv = layer_kv % num_kv
    # Offsets in int64: a host pool easily holds more than 2**31 elements.
    src_page = tl.load(src_page_ids_ptr + transfer).to(tl.int64)
    dst_page = tl.load(dst_page_ids_ptr + transfer).to(tl.int64)
    src_start = src_page * src_page_stride + layer * src_layer_stride + kv * src_kv_stride
    dst_start = dst_page * dst_page_stride + layer * dst_layer_stride + kv * dst_kv_stride

    offs = chunk * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,) within the block
    if EVEN:
        values = tl.load(src_ptr + src_start + offs)
        tl.store(dst_ptr + dst_start + offs, values)
    else:
        mask = offs < page_numel
        values = tl.load(src_ptr + src_start + offs, mask=mask)
        tl.store(dst_ptr + dst_start + offs, values, mask=mask)


def transfer_pages_triton(
    src: PageView,
    dst: PageView,
    src_page_ids: torch.Tensor,
    dst_page_ids: torch.Tensor,
    *,
    block_size: int | None = None,
) -> None:
    """Copy page `src_page_ids[i]` of `src` to page `dst_page_ids[i]` of `dst` in one launch.

    src, dst: on the same device, same dtype, same num_layers, num_kv and page_numel.
    src_page_ids, dst_page_ids: (n,) int32 or int64, on that device.
    block_size: elements per program, a power of two; by default 16 KiB worth, or the
    whole block when smaller. Asynchronous on CUDA (stream-ordered), apart from the
    range check's host sync.
    """
    _check_transfer(src, dst, src_page_ids, dst_page_ids)
    device = src.device
    if dst.device != device:
        raise ValueError(
            f"the Triton path needs src and dst on one device, got {device} and {dst.device}; "
            "use transfer_pages_torch or a device staging buffer"
        )
    for name, ids in (("src_page_ids", src_page_ids), ("dst_page_ids", dst_page_ids)):
        if ids.device != device:
            raise ValueError(f"{name} is on {ids.device}, the pools on {device}")
    num_transfers = src_page_ids.numel()
    if num_transfers == 0:
        return
    itemsize = src.tensor.element_size()
    if itemsize not in _BITS_DTYPES:
        raise ValueError(f"unsupported element size {itemsize} ({src.dtype})")
    if block_size is None:
        block_size = min(triton.next_power_of_2(src.page_numel), _MAX_BLOCK_BYTES // itemsize)
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")

    bits = _BITS_DTYPES[itemsize]
    grid = (num_transfers, src.num_layers * src.num_kv, triton.cdiv(src.page_numel, block_size))
    on_cuda = device.type == "cuda"
    with torch.cuda.device(device) if on_cuda else contextlib.nullcontext():
        _page_transfer_kernel[grid](
            src.tensor.view(bits),
            dst.tensor.view(bits),
            src_page_ids,
            dst_page_ids,
            src.page_stride,
            src.layer_stride,
            src.kv_stride,
            dst.page_stride,
            dst.layer_stride,
            dst.kv_stride,
            src.num_kv,
            src.page_numel,
            BLOCK=block_size,
            EVEN=src.page_numel % block_size == 0,
        )


# ---------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------


def transfer_pages(
    src: PageView,
    dst: PageView,
    src_page_ids: torch.Tensor,
    dst_page_ids: torch.Tensor,
    backend: str = "auto",
) -> None:
    """Copy page `src_page_ids[i]` of `src` to page `dst_page_ids[i]` of `dst`.

    src_page_ids, dst_page_ids: (n,) int32 or int64; n == 0 is a no-op.
    backend: "triton", "torch", or "auto" (Triton when both pools are on the same CUDA
    device, the torch reference otherwise). Raises ValueError on any invalid input.
    """
    if backend == "auto":
        same_cuda = src.device.type == "cuda" and src.device == dst.device
        backend = "triton" if same_cuda else "torch"
    if backend == "triton":
        transfer_pages_triton(src, dst, src_page_ids, dst_page_ids)
    elif backend == "torch":
        transfer_pages_torch(src, dst, src_page_ids, dst_page_ids)
    else:
        raise ValueError(f"unknown backend {backend!r}; choose 'auto', 'torch' or 'triton'")
