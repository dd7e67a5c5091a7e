"""Relayout: the Triton kernel against the torch reference, the reference against a naive
per-page copy that indexes each layout by its logical shape (never through `RunView`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from gpu_worker.kernels.relayout import (
    RunView,
    relayout_pages,
    relayout_pages_torch,
    relayout_pages_triton,
)

# The Triton path needs both tensors on one device; on CPU it runs in the interpreter.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

NUM_LAYERS = 3
NUM_TRANSFERS = 3
# layout -> pages in a tensor of that layout
NUM_PAGES = {"pool": 6, "page_first": 5, "unified": 4}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, slots=True)
class Geometry:
    """One page's shape: `num_kv` K/V planes of `page_size` tokens x heads x head_dim."""

    num_kv: int  # 2 for MHA, 1 for MLA
    page_size: int
    num_kv_heads: int
    group_heads: int
    head_dim: int  # the latent dim for MLA

    @property
    def num_groups(self) -> int:
        return self.num_kv_heads // self.group_heads

    def __str__(self) -> str:
        return (
            f"kv{self.num_kv}-ps{self.page_size}-h{self.num_kv_heads}"
            f"-g{self.group_heads}-d{self.head_dim}"
        )


MHA = [
    Geometry(2, page_size, 4, group_heads, head_dim)
    for group_heads, page_size, head_dim in itertools.product([1, 2, 4], [1, 4, 16], [8, 16])
]
# One latent row per token; 24 is not a power of two, so the kernel's masked path runs.
MLA = Geometry(1, 4, 1, 1, 24)
SMALL = [Geometry(2, 4, 4, 1, 8), Geometry(2, 4, 4, 2, 8), Geometry(2, 4, 4, 4, 8), MLA]
PAIRS = [
    ("pool", "unified"),
    ("unified", "pool"),
    ("page_first", "unified"),
    ("unified", "page_first"),
]


def shape(layout: str, geom: Geometry, num_pages: int) -> tuple[int, ...]:
    g = geom
    if layout == "pool":
        return (NUM_LAYERS, g.num_kv, num_pages * g.page_size, g.num_kv_heads, g.head_dim)
    if layout == "page_first":
        return (num_pages, NUM_LAYERS, g.num_kv, g.page_size, g.num_kv_heads, g.head_dim)
    return (
        num_pages,
        g.num_groups,
        NUM_LAYERS,
        g.num_kv,
        g.page_size,
        g.group_heads,
        g.head_dim,
    )


def make(
    layout: str,
    geom: Geometry,
    dtype: torch.dtype,
    gen: torch.Generator,
    device: torch.device = DEVICE,
) -> tuple[str, torch.Tensor]:
    """A tensor of random values: (layout, tensor) with the shape its layout prescribes."""
    tensor = torch.randn(shape(layout, geom, NUM_PAGES[layout]), generator=gen, dtype=torch.float64)
    return layout, tensor.to(dtype).to(device)


def view(layout: str, tensor: torch.Tensor, geom: Geometry) -> RunView:
    if layout == "pool":
        return RunView.pool(tensor, geom.page_size, geom.group_heads)
    if layout == "page_first":
        return RunView.page_first(tensor, geom.group_heads)
    return RunView.unified(tensor)


def read_page(layout: str, tensor: torch.Tensor, geom: Geometry, page: int) -> torch.Tensor:
    """Page `page` as (num_layers, num_kv, page_size, num_kv_heads, head_dim), by indexing."""
    ps = geom.page_size
    if layout == "pool":
        return tensor[:, :, page * ps : (page + 1) * ps]
    if layout == "page_first":
        return tensor[page]
    # (num_groups, L, KV, ps, group_heads, D) -> (L, KV, ps, num_groups, group_heads, D)
    grouped = tensor[page].permute(1, 2, 3, 0, 4, 5)
    return grouped.reshape(NUM_LAYERS, geom.num_kv, ps, geom.num_kv_heads, geom.head_dim)


def to_unified(page: torch.Tensor, geom: Geometry) -> torch.Tensor:
    """(L, KV, ps, num_kv_heads, D) -> (num_groups, L, KV, ps, group_heads, D)."""
    h = geom.group_heads
    return torch.stack([page[:, :, :, g * h : (g + 1) * h] for g in range(geom.num_groups)])


def write_page(
    layout: str, tensor: torch.Tensor, geom: Geometry, page: int, value: torch.Tensor
) -> None:
    ps = geom.page_size
    if layout == "pool":
        tensor[:, :, page * ps : (page + 1) * ps] = value
    elif layout == "page_first":
        tensor[page] = value
    else:
        tensor[page] = to_unified(value, geom)


def naive_relayout(
    src: tuple[str, torch.Tensor],
    dst: tuple[str, torch.Tensor],
    geom: Geometry,
    src_ids: list[int],
    dst_ids: list[int],
) -> None:
    for s, d in zip(src_ids, dst_ids, strict=True):
        write_page(dst[0], dst[1], geom, d, read_page(*src, geom, s).clone())


def random_ids(
    src_pages: int, dst_pages: int, index_dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct source and destination ids, each a prefix of a random permutation."""
    src_ids = torch.randperm(src_pages, generator=gen)[:NUM_TRANSFERS]
    dst_ids = torch.randperm(dst_pages, generator=gen)[:NUM_TRANSFERS]
    return src_ids.to(DEVICE, index_dtype), dst_ids.to(DEVICE, index_dtype)


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    bits = BITS[actual.element_size()]
    assert torch.equal(actual.view(bits), expected.view(bits))


Case = tuple[tuple[str, torch.Tensor], tuple[str, torch.Tensor], torch.Tensor, torch.Tensor]


def setup_case(
    pair: tuple[str, str],
    geom: Geometry,
    dtype: torch.dtype,
    index_dtype: torch.dtype = torch.int64,
    seed: int = 0,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    src = make(pair[0], geom, dtype, gen)
    dst = make(pair[1], geom, dtype, gen)
    src_ids, dst_ids = random_ids(NUM_PAGES[pair[0]], NUM_PAGES[pair[1]], index_dtype, gen)
    return src, dst, src_ids, dst_ids


def check_triton_against_torch(case: Case, geom: Geometry, **kwargs: int) -> None:
    src, dst, src_ids, dst_ids = case
    expected = dst[1].clone()
    relayout_pages_torch(view(*src, geom), view(dst[0], expected, geom), src_ids, dst_ids)
    relayout_pages_triton(view(*src, geom), view(*dst, geom), src_ids, dst_ids, **kwargs)
    assert_bits_equal(dst[1], expected)


# ---------------------------------------------------------------- the reference


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geom", SMALL, ids=str)
@pytest.mark.parametrize("pair", PAIRS, ids="->".join)
def test_torch_reference_matches_naive(
    pair: tuple[str, str], geom: Geometry, dtype: torch.dtype, index_dtype: torch.dtype
) -> None:
    src, dst, src_ids, dst_ids = setup_case(pair, geom, dtype, index_dtype)
    expected = dst[1].clone()
    naive_relayout(src, (dst[0], expected), geom, src_ids.tolist(), dst_ids.tolist())
    relayout_pages_torch(view(*src, geom), view(*dst, geom), src_ids, dst_ids)
    assert_bits_equal(dst[1], expected)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("geom", SMALL, ids=str)
def test_pool_unified_pool_round_trip(geom: Geometry, backend: str) -> None:
    """Backup then load: the unified bytes are the grouped pages, the pool pages come back."""
    gen = torch.Generator().manual_seed(1)
    pool = make("pool", geom, torch.bfloat16, gen)
    unified = make("unified", geom, torch.bfloat16, gen)
    pool_ids = [4, 0, 5]
    unified_ids = [2, 3, 0]

    expected = unified[1].clone()
    for p, u in zip(pool_ids, unified_ids, strict=True):
        page = pool[1][:, :, p * geom.page_size : (p + 1) * geom.page_size]  # (L, KV, ps, H, D)
        expected[u] = to_unified(page, geom)  # (G, L, KV, ps, group_heads, D)
    ids = (torch.tensor(pool_ids, device=DEVICE), torch.tensor(unified_ids, device=DEVICE))
    relayout_pages(view(*pool, geom), view(*unified, geom), *ids, backend=backend)
    assert_bits_equal(unified[1], expected)

    restored = make("pool", geom, torch.bfloat16, gen)
    before = restored[1].clone()
    relayout_pages(view(*unified, geom), view(*restored, geom), ids[1], ids[0], backend=backend)
    ps = geom.page_size
    for p in range(NUM_PAGES["pool"]):
        source = pool[1] if p in pool_ids else before
        tokens = slice(p * ps, (p + 1) * ps)
        assert_bits_equal(restored[1][:, :, tokens], source[:, :, tokens])


# ---------------------------------------------------------------- Triton against the reference


@pytest.mark.parametrize("pair", [("pool", "unified"), ("unified", "pool")], ids="->".join)
@pytest.mark.parametrize("geom", MHA, ids=str)
def test_triton_matches_torch_mha(geom: Geometry, pair: tuple[str, str]) -> None:
    check_triton_against_torch(setup_case(pair, geom, torch.float16, seed=2), geom)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geom", [Geometry(2, 4, 4, 2, 8), MLA], ids=str)
@pytest.mark.parametrize("pair", [("pool", "unified"), ("unified", "pool")], ids="->".join)
def test_triton_matches_torch_dtypes(
    pair: tuple[str, str], geom: Geometry, dtype: torch.dtype, index_dtype: torch.dtype
) -> None:
    check_triton_against_torch(setup_case(pair, geom, dtype, index_dtype, seed=3), geom)


@pytest.mark.parametrize("geom", SMALL, ids=str)
@pytest.mark.parametrize(
    "pair", [("page_first", "unified"), ("unified", "page_first")], ids="->".join
)
def test_triton_matches_torch_page_first(pair: tuple[str, str], geom: Geometry) -> None:
    check_triton_against_torch(setup_case(pair, geom, torch.float32, torch.int32, 4), geom)


@pytest.mark.parametrize(
    ("geom", "block_tokens"),
    [
        (Geometry(2, 16, 4, 2, 8), 4),  # 4 even token chunks
        (Geometry(2, 6, 4, 2, 8), 4),  # 2 chunks, the last one masked
        (Geometry(2, 4, 4, 4, 6), 2),  # run of 24 elements in a block of 32: masked
        (MLA, 1),
    ],
    ids=str,
)
def test_triton_token_chunks_and_masks(geom: Geometry, block_tokens: int) -> None:
    for pair in [("pool", "unified"), ("unified", "pool")]:
        case = setup_case(pair, geom, torch.float16, seed=5)
        check_triton_against_torch(case, geom, block_tokens=block_tokens)


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_empty_transfer_is_noop(backend: str) -> None:
    geom = SMALL[1]
    src, dst, _, _ = setup_case(("pool", "unified"), geom, torch.float32)
    before = dst[1].clone()
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    relayout_pages(view(*src, geom), view(*dst, geom), empty, empty, backend=backend)
    assert torch.equal(dst[1], before)


# ---------------------------------------------------------------- bad input


def _bad_inputs() -> dict[str, tuple[RunView, RunView, torch.Tensor, torch.Tensor]]:
    geom = SMALL[1]
    gen = torch.Generator().manual_seed(6)
    src = view(*make("pool", geom, torch.float32, gen), geom)
    dst = view(*make("unified", geom, torch.float32, gen), geom)
    dst_f16 = view(*make("unified", geom, torch.float16, gen), geom)

    def unified(g: Geometry) -> RunView:
        return view(*make("unified", g, torch.float32, gen), g)

    def ids(*values: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=DEVICE)

    return {
        "dtype_mismatch": (src, dst_f16, ids(0, 1), ids(0, 1)),
        "group_mismatch": (src, unified(SMALL[0]), ids(0, 1), ids(0, 1)),
        "page_size_mismatch": (src, unified(Geometry(2, 2, 4, 2, 8)), ids(0, 1), ids(0, 1)),
        "head_dim_mismatch": (src, unified(Geometry(2, 4, 4, 2, 4)), ids(0, 1), ids(0, 1)),
        "num_kv_mismatch": (src, unified(Geometry(1, 4, 4, 2, 8)), ids(0, 1), ids(0, 1)),
        "src_id_too_large": (src, dst, ids(0, 6), ids(0, 1)),
        "dst_id_too_large": (src, dst, ids(0, 1), ids(0, 4)),
        "negative_id": (src, dst, ids(0, -1), ids(0, 1)),
        "length_mismatch": (src, dst, ids(0, 1, 2), ids(0, 1)),
        "ids_2d": (src, dst, ids(0, 1).view(1, 2), ids(0, 1).view(1, 2)),
        "float_ids": (src, dst, ids(0, 1, dtype=torch.float32), ids(0, 1)),
        "int16_ids": (src, dst, ids(0, 1), ids(0, 1, dtype=torch.int16)),
    }


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_bad_inputs_raise(case: str, backend: str) -> None:
    src, dst, src_ids, dst_ids = _bad_inputs()[case]
    before = dst.tensor.clone()
    with pytest.raises(ValueError):
        relayout_pages(src, dst, src_ids, dst_ids, backend=backend)
    assert torch.equal(dst.tensor, before)


def test_triton_rejects_src_and_dst_on_different_devices() -> None:
    """A CPU source and a "meta" destination (no GPU needed): refused before any launch."""
    geom = SMALL[1]
    src = view(*make("pool", geom, torch.float32, torch.Generator(), torch.device("cpu")), geom)
    dst = RunView.unified(torch.empty(shape("unified", geom, 4), device="meta"))
    ids = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="one device"):
        relayout_pages_triton(src, dst, ids, ids)


def test_unknown_backend_raises() -> None:
    geom = SMALL[1]
    src, dst, src_ids, dst_ids = setup_case(("pool", "unified"), geom, torch.float32)
    with pytest.raises(ValueError, match="backend"):
        relayout_pages(view(*src, geom), view(*dst, geom), src_ids, dst_ids, backend="cuda")


def test_triton_rejects_bad_block_tokens() -> None:
    geom = SMALL[1]
    src, dst, src_ids, dst_ids = setup_case(("pool", "unified"), geom, torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        relayout_pages_triton(view(*src, geom), view(*dst, geom), src_ids, dst_ids, block_tokens=3)


def test_auto_uses_torch_for_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu_worker.kernels import relayout

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("auto must not pick Triton for CPU tensors")

    monkeypatch.setattr(relayout, "relayout_pages_triton", fail)
    geom = SMALL[1]
    gen = torch.Generator().manual_seed(7)
    cpu = torch.device("cpu")
    src = make("pool", geom, torch.float32, gen, device=cpu)
    dst = make("unified", geom, torch.float32, gen, device=cpu)
    expected = dst[1].clone()
    naive_relayout(src, (dst[0], expected), geom, [5, 1], [3, 0])
    relayout_pages(view(*src, geom), view(*dst, geom), torch.tensor([5, 1]), torch.tensor([3, 0]))
    assert torch.equal(dst[1], expected)


# ---------------------------------------------------------------- RunView


def test_run_view_strides() -> None:
    # (num_layers, 2, 3 pages * page_size 4 slots, 6 heads, head_dim 8), groups of 2 heads
    pool = RunView.pool(torch.zeros(5, 2, 12, 6, 8), page_size=4, group_heads=2)
    assert (
        pool.page_stride,
        pool.layer_stride,
        pool.kv_stride,
        pool.token_stride,
        pool.group_stride,
    ) == (4 * 48, 2 * 12 * 48, 12 * 48, 48, 16)
    assert (pool.num_pages, *pool.geometry) == (3, 5, 2, 4, 3, 16)

    pf = RunView.page_first(torch.zeros(7, 5, 2, 4, 6, 8), group_heads=3)
    assert (pf.page_stride, pf.layer_stride, pf.kv_stride, pf.token_stride, pf.group_stride) == (
        5 * 2 * 4 * 48,
        2 * 4 * 48,
        4 * 48,
        48,
        24,
    )
    assert (pf.num_pages, *pf.geometry) == (7, 5, 2, 4, 2, 24)

    # (num_pages, num_groups, num_layers, num_kv, page_size, group_heads, head_dim)
    un = RunView.unified(torch.zeros(7, 3, 5, 2, 4, 2, 8))
    group_numel = 5 * 2 * 4 * 16
    assert (un.page_stride, un.layer_stride, un.kv_stride, un.token_stride, un.group_stride) == (
        3 * group_numel,
        2 * 4 * 16,
        4 * 16,
        16,
        group_numel,
    )
    assert (un.num_pages, *un.geometry) == (7, 5, 2, 4, 3, 16)

    mla = RunView.pool(torch.zeros(5, 1, 8, 1, 24), page_size=4, group_heads=1)
    assert (mla.num_pages, *mla.geometry) == (2, 5, 1, 4, 1, 24)


@pytest.mark.parametrize(
    "make_view",
    [
        lambda: RunView.pool(torch.zeros(2, 2, 8, 4, 8), 4, group_heads=3),  # 3 does not divide 4
        lambda: RunView.pool(torch.zeros(2, 2, 8, 4, 8), 4, group_heads=0),
        lambda: RunView.page_first(torch.zeros(3, 2, 2, 4, 4, 8), group_heads=3),
        lambda: RunView.pool(torch.zeros(2, 2, 10, 2, 8), 4, 1),  # 10 % 4 != 0
        lambda: RunView.pool(torch.zeros(2, 3, 8, 2, 8), 4, 1),  # num_kv 3
        lambda: RunView.pool(torch.zeros(2, 2, 8, 2), 4, 1),  # 4-D
        lambda: RunView.pool(torch.zeros(2, 2, 8, 8, 2).transpose(3, 4), 4, 1),  # strided
        lambda: RunView.page_first(torch.zeros(3, 2, 2, 4, 2), 1),  # 5-D
        lambda: RunView.unified(torch.zeros(3, 2, 2, 3, 4, 1, 8)),  # num_kv 3
        lambda: RunView.unified(torch.zeros(3, 2, 2, 2, 4, 8, 2).transpose(5, 6)),  # strided
        lambda: RunView(torch.zeros(10), 4, 4, 4, 1, 1, 1, 1, 1, 1, 12),  # one page does not fit
        lambda: RunView(torch.zeros(64), 16, 0, 8, 1, 1, 1, 1, 1, 1, 8),  # zero stride
        lambda: RunView(torch.zeros(64), 16, 8, 8, 1, 1, 1, 1, 0, 1, 8),  # zero page_size
    ],
)
def test_run_view_rejects_bad_tensors(make_view: Callable[[], RunView]) -> None:
    with pytest.raises(ValueError):
        make_view()


# ---------------------------------------------------------------- CUDA only


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_cross_device_torch_path(direction: str, backend: str) -> None:
    geom = SMALL[1]
    gen = torch.Generator().manual_seed(8)
    pool = make("pool", geom, torch.bfloat16, gen, device=torch.device("cuda"))
    layout, host_tensor = make("unified", geom, torch.bfloat16, gen, torch.device("cpu"))
    host = (layout, host_tensor.pin_memory())
    src, dst = (pool, host) if direction == "d2h" else (host, pool)
    src_ids = [3, 0, 1] if direction == "d2h" else [1, 3, 0]
    dst_ids = [1, 2, 0] if direction == "d2h" else [5, 2, 0]
    expected = dst[1].cpu().clone()
    naive_relayout((src[0], src[1].cpu()), (dst[0], expected), geom, src_ids, dst_ids)
    ids_on = [torch.tensor(src_ids, dtype=torch.int32), torch.tensor(dst_ids, device="cuda")]
    relayout_pages(view(*src, geom), view(*dst, geom), ids_on[0], ids_on[1], backend=backend)
    torch.cuda.synchronize()
    assert_bits_equal(dst[1].cpu(), expected)
