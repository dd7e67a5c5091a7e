"""The context-parallel KV gather of one layer: an owner-ordered pack and a page-table map.

Under CP page sharding (`parallel/cp_layout.py`) logical page `q` lives only on rank
`q % N`, at local page `q // N`. Before a layer's attention every rank reads a list of
logical pages (a batch's prefix pages, in logical order, say A B C). The gather:

1. `gather_map`: for page `i` of the list, the page of the gathered buffer that will hold it,

       gathered[i] = owner(i) * M + (number of pages before i in the list with i's owner)

   where `M` (`chunk_pages`) is the most pages any one rank owns in the list, the same on
   every rank. The buffer groups pages by owner (rank 0's chunk first), each owner's pages in
   their order of appearance; `gathered` is the page table that lets attention read A B C in
   logical order without moving the pages again.
2. `pack_owned`: this rank copies its owned pages of the list, for one layer, from its pool
   into its chunk, the `send` buffer of `M` pages (`send[gathered[i] - rank * M]`). A chunk
   holding fewer than `M` pages keeps whatever its tail held (padding nobody maps).
3. The caller all-gathers the `N` chunks (equal sizes: `dist.all_gather_single`, torch
   2.13's name for `all_gather_into_tensor`), giving the `(N * M, num_kv, page_size,
   num_kv_heads, head_dim)` gathered buffer on every rank;
   `send` may be chunk `rank` of that buffer itself (an in-place all-gather).

Layouts. `pool` is the rank's device pool, `(num_layers, num_kv, num_local_slots,
num_kv_heads, head_dim)` contiguous (local page `j` is slots `[j * page_size, (j + 1) *
page_size)`); `send` is page-first, `(M, num_kv, page_size, num_kv_heads, head_dim)`
contiguous. Copies are bit-exact: the Triton kernel moves each dtype as the integer type of
its width, as `page_transfer` does.

Backends: `*_triton` (on CPU only under TRITON_INTERPRET=1, in tests), `*_torch` (the
reference), and `backend="auto"`: Triton on CUDA, the reference elsewhere.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

_BITS_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_BLOCK_BYTES = 16 * 1024  # bytes one pack program copies, as in page_transfer
_MAP_BLOCK = 128  # pages the map program scans per step


# ---------------------------------------------------------------------------------------
# Checks shared by both backends
# ---------------------------------------------------------------------------------------


def chunk_pages_of(page_ids: torch.Tensor, cp_size: int) -> int:
    """M: the most pages of `page_ids` (n,) any one of `cp_size` ranks owns (0 if empty).
    One host sync on CUDA."""
    if page_ids.numel() == 0:
        return 0
    return int(torch.bincount(page_ids % cp_size, minlength=cp_size).max().item())


def _check_map(page_ids: torch.Tensor, cp_size: int, chunk_pages: int) -> None:
    if page_ids.dim() != 1 or page_ids.dtype != torch.int64:
        raise ValueError(f"page_ids must be (n,) int64, got {page_ids.dtype} {page_ids.shape}")
    if cp_size <= 0:
        raise ValueError(f"cp_size must be positive, got {cp_size}")
    if page_ids.numel() and int(page_ids.min().item()) < 0:
        raise ValueError("page_ids must be non-negative")
    if chunk_pages < chunk_pages_of(page_ids, cp_size):
        raise ValueError(
            f"chunk_pages {chunk_pages} < the {chunk_pages_of(page_ids, cp_size)} pages "
            "one rank owns in the list"
        )


def _check_pack(
    pool: torch.Tensor,
    page_size: int,
    page_ids: torch.Tensor,
    gathered: torch.Tensor,
    rank: int,
    cp_size: int,
    send: torch.Tensor,
) -> None:
    """Raise ValueError unless the pack is valid. Reads the ids' max: one host sync on CUDA."""
    if pool.dim() != 5 or send.dim() != 5 or not (pool.is_contiguous() and send.is_contiguous()):
        raise ValueError("pool and send must be contiguous 5-D tensors")
    num_kv, num_slots = pool.shape[1], pool.shape[2]
    if send.shape[1:] != (num_kv, page_size, *pool.shape[3:]) or send.dtype != pool.dtype:
        raise ValueError(
            f"send {tuple(send.shape)} {send.dtype} does not hold pages of pool "
            f"{tuple(pool.shape)} {pool.dtype} with page_size {page_size}"
        )
    if num_slots % page_size:
        raise ValueError(f"pool has {num_slots} slots, not a multiple of page_size {page_size}")
    if page_ids.shape != gathered.shape or page_ids.dim() != 1:
        raise ValueError("page_ids and gathered must be (n,) tensors of one length")
    if not 0 <= rank < cp_size:
        raise ValueError(f"rank {rank} is outside a CP group of {cp_size}")
    if page_ids.numel() == 0:
        return
    owned = page_ids % cp_size == rank
    if bool(owned.any()):
        local_max = int((page_ids[owned] // cp_size).max().item())
        if local_max >= num_slots // page_size:
            raise ValueError(f"local page {local_max} is outside the pool")
        slots = gathered[owned] - rank * send.shape[0]
        if int(slots.min().item()) < 0 or int(slots.max().item()) >= send.shape[0]:
            raise ValueError("gathered maps an owned page outside this rank's chunk")


# ---------------------------------------------------------------------------------------
# PyTorch reference
# ---------------------------------------------------------------------------------------


def gather_map_torch(page_ids: torch.Tensor, cp_size: int, chunk_pages: int) -> torch.Tensor:
    """Reference: (n,) int64 logical pages -> (n,) int64 pages of the gathered buffer."""
    _check_map(page_ids, cp_size, chunk_pages)
    owner = page_ids % cp_size  # (n,)
    mine = torch.nn.functional.one_hot(owner, cp_size)  # (n, N): 1 at each page's owner
    before = (mine.cumsum(0) - mine).gather(1, owner[:, None])[:, 0]  # same-owner pages before
    return owner * chunk_pages + before


def pack_owned_torch(
    pool: torch.Tensor,
    layer: int,
    page_size: int,
    page_ids: torch.Tensor,
    gathered: torch.Tensor,
    rank: int,
    cp_size: int,
    send: torch.Tensor,
    validate: bool = True,
) -> None:
    """Reference: copy layer `layer` of this rank's owned pages of `page_ids` into `send`.

    pool: (num_layers, num_kv, num_local_slots, num_kv_heads, head_dim); send: (M, num_kv,
    page_size, num_kv_heads, head_dim); page_ids, gathered: (n,) int64 (gathered from
    `gather_map` with this M).
    """
    if validate:
        _check_pack(pool, page_size, page_ids, gathered, rank, cp_size, send)
    owned = page_ids % cp_size == rank
    local = page_ids[owned] // cp_size  # (k,) local pages
    dst = gathered[owned] - rank * send.shape[0]  # (k,) pages of the chunk
    num_kv, _, heads, dim = pool.shape[1:]
    pages = pool[layer].view(num_kv, -1, page_size, heads, dim)  # (num_kv, local pages, p, H, D)
    send[dst] = pages[:, local].transpose(0, 1)  # (k, num_kv, p, H, D)


# ---------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------


@triton.jit
def _gather_map_kernel(
    page_ids_ptr,  # *int64 (n,): logical pages in logical order
    gathered_ptr,  # *int64 (n,): out, the gathered-buffer page of each
    num_pages,  # n
    cp_size,  # N
    chunk_pages,  # M
    BLOCK: tl.constexpr,  # pages scanned per step
):
    # One program: for each owner, a running count of its pages over the list in BLOCK
    # steps (n * N / BLOCK steps; lists are thousands of pages, owners a handful).
    for owner in range(0, cp_size):
        seen = tl.full((), 0, tl.int64)
        for start in range(0, num_pages, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            valid = offs < num_pages
            page = tl.load(page_ids_ptr + offs, mask=valid, other=0)
            mine = valid & (page % cp_size == owner)
            ones = mine.to(tl.int64)
            before = tl.cumsum(ones, axis=0) - ones + seen  # this owner's pages before i
            tl.store(gathered_ptr + offs, owner * chunk_pages + before, mask=mine)
            seen += tl.sum(ones, axis=0)


@triton.jit
def _pack_owned_kernel(
    pool_ptr,  # *T: element 0 of the rank's pool
    send_ptr,  # *T: element 0 of the send chunk
    page_ids_ptr,  # *int64 (n,): logical pages of the list
    gathered_ptr,  # *int64 (n,): their gathered-buffer pages
    layer_offset,  # elements from the pool's start to layer `layer`
    kv_stride,  # elements from the pool's K plane to its V plane
    rank,  # this rank's CP index
    cp_size,  # N
    chunk_pages,  # M
    num_kv,  # 2 (K, V) or 1 (MLA)
    page_numel,  # page_size * num_kv_heads * head_dim
    BLOCK: tl.constexpr,  # elements one program copies
):
    i = tl.program_id(0)  # the list's page
    kv = tl.program_id(1)  # 0 = K (or latent), 1 = V
    chunk = tl.program_id(2)  # BLOCK-sized piece of the page's block
    page = tl.load(page_ids_ptr + i)
    owned = page % cp_size == rank
    dst_page = tl.load(gathered_ptr + i) - rank * chunk_pages
    src_start = layer_offset + kv * kv_stride + (page // cp_size) * page_numel
    dst_start = (dst_page * num_kv + kv) * page_numel
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < tl.where(owned, page_numel, 0)  # nothing of a page of another owner
    values = tl.load(pool_ptr + src_start + offs, mask=mask)
    tl.store(send_ptr + dst_start + offs, values, mask=mask)


def gather_map_triton(page_ids: torch.Tensor, cp_size: int, chunk_pages: int) -> torch.Tensor:
    """`gather_map_torch` in one single-program launch on `page_ids`' device."""
    _check_map(page_ids, cp_size, chunk_pages)
    gathered = torch.empty_like(page_ids)
    if page_ids.numel() == 0:
        return gathered
    device = page_ids.device
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _gather_map_kernel[(1,)](
            page_ids, gathered, page_ids.numel(), cp_size, chunk_pages, BLOCK=_MAP_BLOCK
        )
    return gathered


def pack_owned_triton(
    pool: torch.Tensor,
    layer: int,
    page_size: int,
    page_ids: torch.Tensor,
    gathered: torch.Tensor,
    rank: int,
    cp_size: int,
    send: torch.Tensor,
    validate: bool = True,
    block_size: int | None = None,
) -> None:
    """`pack_owned_torch` in one launch of `n * num_kv * cdiv(page_numel, block_size)`
    programs; pool, send and the ids on one device. Asynchronous on CUDA when `validate`
    is off (the check reads the ids: a host sync)."""
    if validate:
        _check_pack(pool, page_size, page_ids, gathered, rank, cp_size, send)
    for t in (send, page_ids, gathered):
        if t.device != pool.device:
            raise ValueError(f"the Triton pack needs one device, got {t.device} and {pool.device}")
    n = page_ids.numel()
    if n == 0 or send.shape[0] == 0:
        return
    itemsize = pool.element_size()
    _, num_kv, num_slots, heads, dim = pool.shape
    page_numel = page_size * heads * dim
    if block_size is None:
        block_size = min(triton.next_power_of_2(page_numel), _MAX_BLOCK_BYTES // itemsize)
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    kv_stride = num_slots * heads * dim
    bits = _BITS_DTYPES[itemsize]
    grid = (n, num_kv, triton.cdiv(page_numel, block_size))
    device = pool.device
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _pack_owned_kernel[grid](
            pool.view(bits),
            send.view(bits),
            page_ids,
            gathered,
            layer * num_kv * kv_stride,
            kv_stride,
            rank,
            cp_size,
            send.shape[0],
            num_kv,
            page_numel,
            BLOCK=block_size,
        )


# ---------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------


def _use_triton(backend: str, device: torch.device) -> bool:
    if backend == "auto":
        return device.type == "cuda"
    if backend not in ("triton", "torch"):
        raise ValueError(f"unknown backend {backend!r}; choose 'auto', 'torch' or 'triton'")
    return backend == "triton"


def gather_map(
    page_ids: torch.Tensor, cp_size: int, chunk_pages: int, backend: str = "auto"
) -> torch.Tensor:
    """(n,) int64 logical pages -> (n,) int64 gathered-buffer pages (see the module doc)."""
    if _use_triton(backend, page_ids.device):
        return gather_map_triton(page_ids, cp_size, chunk_pages)
    return gather_map_torch(page_ids, cp_size, chunk_pages)


def pack_owned(
    pool: torch.Tensor,
    layer: int,
    page_size: int,
    page_ids: torch.Tensor,
    gathered: torch.Tensor,
    rank: int,
    cp_size: int,
    send: torch.Tensor,
    backend: str = "auto",
    validate: bool = True,
) -> None:
    """Copy layer `layer` of this rank's owned pages of `page_ids` into chunk `send`.
    `validate=False` skips the range checks (and their host sync): for a plan checked once."""
    args = (pool, layer, page_size, page_ids, gathered, rank, cp_size, send, validate)
    if _use_triton(backend, pool.device):
        pack_owned_triton(*args)
    else:
        pack_owned_torch(*args)
