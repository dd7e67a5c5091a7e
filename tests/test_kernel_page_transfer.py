"""Page transfer: the Triton kernel against the torch reference, the reference against a
naive per-block loop that indexes each layout by its logical shape."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from gpu_worker.kernels.page_transfer import (
    PageView,
    transfer_pages,
    transfer_pages_torch,
    transfer_pages_triton,
)

# The Triton path needs both pools on one device; on CPU it runs in the interpreter.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

NUM_LAYERS, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM = 2, 4, 2, 8
NUM_TRANSFERS = 5
# name -> (layout, num_pages)
POOLS = {
    "device": ("layer_first", 8),
    "host_layer_first": ("layer_first", 12),
    "host_page_first": ("page_first", 12),
    "staging": ("page_first", NUM_TRANSFERS),
}
PAIRS = [
    ("device", "host_layer_first"),
    ("device", "host_page_first"),
    ("host_page_first", "device"),
    ("device", "staging"),
    ("staging", "device"),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def make_pool(
    name: str,
    dtype: torch.dtype,
    gen: torch.Generator,
    device: torch.device = DEVICE,
    head_dim: int = HEAD_DIM,
) -> tuple[str, torch.Tensor]:
    """A pool of random values: (layout, tensor) with the shape its layout prescribes."""
    layout, num_pages = POOLS[name]
    if layout == "layer_first":
        shape: tuple[int, ...] = (NUM_LAYERS, 2, num_pages * PAGE_SIZE, NUM_KV_HEADS, head_dim)
    else:
        shape = (num_pages, NUM_LAYERS, 2, PAGE_SIZE, NUM_KV_HEADS, head_dim)
    tensor = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return layout, tensor.to(device)


def view(layout: str, tensor: torch.Tensor) -> PageView:
    if layout == "layer_first":
        return PageView.layer_first(tensor, PAGE_SIZE)
    return PageView.page_first(tensor)


def block(layout: str, tensor: torch.Tensor, page: int, layer: int, kv: int) -> torch.Tensor:
    """The (page_size, num_kv_heads, head_dim) block of one page, from the logical shape."""
    if layout == "layer_first":
        return tensor[layer, kv, page * PAGE_SIZE : (page + 1) * PAGE_SIZE]
    return tensor[page, layer, kv]


def naive_transfer(
    src: tuple[str, torch.Tensor],
    dst: tuple[str, torch.Tensor],
    src_ids: list[int],
    dst_ids: list[int],
) -> None:
    for s, d in zip(src_ids, dst_ids, strict=True):
        for layer in range(NUM_LAYERS):
            for kv in range(2):
                block(*dst, d, layer, kv).copy_(block(*src, s, layer, kv))


def random_ids(
    src_pages: int, dst_pages: int, index_dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Source ids may repeat; destination ids are distinct."""
    src_ids = torch.randint(0, src_pages, (NUM_TRANSFERS,), generator=gen)
    dst_ids = torch.randperm(dst_pages, generator=gen)[:NUM_TRANSFERS]
    return src_ids.to(DEVICE, index_dtype), dst_ids.to(DEVICE, index_dtype)


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    bits = BITS[actual.element_size()]
    assert torch.equal(actual.view(bits), expected.view(bits))


def setup_case(
    pair: tuple[str, str], dtype: torch.dtype, index_dtype: torch.dtype, seed: int = 0
) -> tuple[tuple[str, torch.Tensor], tuple[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    src = make_pool(pair[0], dtype, gen)
    dst = make_pool(pair[1], dtype, gen)
    src_ids, dst_ids = random_ids(POOLS[pair[0]][1], POOLS[pair[1]][1], index_dtype, gen)
    return src, dst, src_ids, dst_ids


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pair", PAIRS, ids="->".join)
def test_torch_reference_matches_naive(
    pair: tuple[str, str], dtype: torch.dtype, index_dtype: torch.dtype
) -> None:
    src, dst, src_ids, dst_ids = setup_case(pair, dtype, index_dtype)
    expected = dst[1].clone()
    naive_transfer(src, (dst[0], expected), src_ids.tolist(), dst_ids.tolist())
    transfer_pages_torch(view(*src), view(*dst), src_ids, dst_ids)
    assert_bits_equal(dst[1], expected)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pair", PAIRS, ids="->".join)
def test_triton_matches_torch_reference(
    pair: tuple[str, str], dtype: torch.dtype, index_dtype: torch.dtype
) -> None:
    src, dst, src_ids, dst_ids = setup_case(pair, dtype, index_dtype)
    expected = dst[1].clone()
    transfer_pages_torch(view(*src), view(dst[0], expected), src_ids, dst_ids)
    transfer_pages_triton(view(*src), view(*dst), src_ids, dst_ids)
    assert_bits_equal(dst[1], expected)


@pytest.mark.parametrize("to_host", [True, False])
def test_mla_pages_triton_and_torch_match_naive(to_host: bool) -> None:
    """MLA pools: one latent plane per layer (num_kv 1) of width 20 (masked blocks)."""
    gen = torch.Generator().manual_seed(2)
    device = torch.randn(NUM_LAYERS, 1, 8 * PAGE_SIZE, 1, 20, generator=gen).to(DEVICE)
    host = torch.randn(12, NUM_LAYERS, 1, PAGE_SIZE, 1, 20, generator=gen).to(DEVICE)
    device_ids, host_ids = [3, 0, 7], [11, 2, 5]
    expected = torch.zeros_like(host if to_host else device)
    for d, h in zip(device_ids, host_ids, strict=True):  # naive: by the logical shapes
        if to_host:
            expected[h, :, 0] = device[:, 0, d * PAGE_SIZE : (d + 1) * PAGE_SIZE]
        else:
            expected[:, 0, d * PAGE_SIZE : (d + 1) * PAGE_SIZE] = host[h, :, 0]
    d_ids, h_ids = torch.tensor(device_ids, device=DEVICE), torch.tensor(host_ids, device=DEVICE)
    for transfer in (transfer_pages_torch, transfer_pages_triton):
        out = expected.new_zeros(expected.shape)
        if to_host:
            transfer(view("layer_first", device), view("page_first", out), d_ids, h_ids)
        else:
            transfer(view("page_first", host), view("layer_first", out), h_ids, d_ids)
        assert_bits_equal(out, expected)


@pytest.mark.parametrize(
    ("head_dim", "block_size"),
    [(8, 16), (6, 32), (6, 64)],  # page_numel 64: 4 even chunks; 48: 2 masked, 1 masked
)
def test_triton_chunked_and_masked_blocks(head_dim: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(1)
    src = make_pool("device", torch.float16, gen, head_dim=head_dim)
    dst = make_pool("host_page_first", torch.float16, gen, head_dim=head_dim)
    src_ids = torch.tensor([3, 0], device=DEVICE)
    dst_ids = torch.tensor([11, 2], device=DEVICE)
    expected = dst[1].clone()
    naive_transfer(src, (dst[0], expected), src_ids.tolist(), dst_ids.tolist())
    transfer_pages_triton(view(*src), view(*dst), src_ids, dst_ids, block_size=block_size)
    assert_bits_equal(dst[1], expected)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("pair", [("device", "host_page_first"), ("staging", "device")])
def test_untouched_pages_unchanged(pair: tuple[str, str], backend: str) -> None:
    src, dst, src_ids, dst_ids = setup_case(pair, torch.float32, torch.int64, seed=2)
    before = dst[1].clone()
    transfer_pages(view(*src), view(*dst), src_ids, dst_ids, backend=backend)
    written = set(dst_ids.tolist())
    for page in range(POOLS[pair[1]][1]):
        if page in written:
            continue
        for layer in range(NUM_LAYERS):
            for kv in range(2):
                got = block(dst[0], dst[1], page, layer, kv)
                assert torch.equal(got, block(dst[0], before, page, layer, kv))


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_empty_transfer_is_noop(backend: str) -> None:
    src, dst, _, _ = setup_case(("device", "host_page_first"), torch.float32, torch.int64)
    before = dst[1].clone()
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    transfer_pages(view(*src), view(*dst), empty, empty, backend=backend)
    assert torch.equal(dst[1], before)


def _bad_inputs() -> dict[str, tuple[PageView, PageView, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    src = view(*make_pool("device", torch.float32, gen))
    dst = view(*make_pool("host_page_first", torch.float32, gen))
    dst_f16 = view(*make_pool("host_page_first", torch.float16, gen))
    dst_narrow = view(*make_pool("host_page_first", torch.float32, gen, head_dim=4))

    def ids(*values: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=DEVICE)

    return {
        "dtype_mismatch": (src, dst_f16, ids(0, 1), ids(0, 1)),
        "page_numel_mismatch": (src, dst_narrow, ids(0, 1), ids(0, 1)),
        "src_id_too_large": (src, dst, ids(0, 8), ids(0, 1)),
        "dst_id_too_large": (src, dst, ids(0, 1), ids(0, 12)),
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
        transfer_pages(src, dst, src_ids, dst_ids, backend=backend)
    assert torch.equal(dst.tensor, before)


def test_unknown_backend_raises() -> None:
    src, dst, src_ids, dst_ids = setup_case(("device", "staging"), torch.float32, torch.int64)
    with pytest.raises(ValueError, match="backend"):
        transfer_pages(view(*src), view(*dst), src_ids, dst_ids, backend="cuda")


def test_triton_rejects_bad_block_size() -> None:
    src, dst, src_ids, dst_ids = setup_case(("device", "staging"), torch.float32, torch.int64)
    with pytest.raises(ValueError, match="power of two"):
        transfer_pages_triton(view(*src), view(*dst), src_ids, dst_ids, block_size=48)


def test_auto_uses_torch_for_cpu_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu_worker.kernels import page_transfer

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("auto must not pick Triton for CPU pools")

    monkeypatch.setattr(page_transfer, "transfer_pages_triton", fail)
    gen = torch.Generator().manual_seed(4)
    src = make_pool("device", torch.float32, gen, device=torch.device("cpu"))
    dst = make_pool("host_page_first", torch.float32, gen, device=torch.device("cpu"))
    expected = dst[1].clone()
    naive_transfer(src, (dst[0], expected), [1, 7], [4, 0])
    transfer_pages(view(*src), view(*dst), torch.tensor([1, 7]), torch.tensor([4, 0]))
    assert torch.equal(dst[1], expected)


def test_page_view_strides() -> None:
    slots = 3 * PAGE_SIZE
    lf = PageView.layer_first(torch.zeros(5, 2, slots, NUM_KV_HEADS, HEAD_DIM), PAGE_SIZE)
    page_numel = PAGE_SIZE * NUM_KV_HEADS * HEAD_DIM
    assert (lf.page_stride, lf.layer_stride, lf.kv_stride) == (
        page_numel,
        2 * slots * NUM_KV_HEADS * HEAD_DIM,
        slots * NUM_KV_HEADS * HEAD_DIM,
    )
    assert (lf.num_layers, lf.page_numel, lf.num_pages) == (5, page_numel, 3)

    pf = PageView.page_first(torch.zeros(7, 5, 2, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM))
    assert (pf.page_stride, pf.layer_stride, pf.kv_stride) == (
        5 * 2 * page_numel,
        2 * page_numel,
        page_numel,
    )
    assert (pf.num_layers, pf.page_numel, pf.num_pages) == (5, page_numel, 7)

    # MLA: one plane per layer (the latent rows), one "head" of the latent's width
    mla = PageView.layer_first(torch.zeros(5, 1, slots, 1, 20), PAGE_SIZE)
    assert (mla.num_kv, mla.page_stride, mla.layer_stride) == (1, PAGE_SIZE * 20, slots * 20)
    assert (mla.num_layers, mla.page_numel, mla.num_pages) == (5, PAGE_SIZE * 20, 3)
    mla = PageView.page_first(torch.zeros(7, 5, 1, PAGE_SIZE, 1, 20))
    assert (mla.num_kv, mla.page_stride, mla.layer_stride) == (1, 5 * PAGE_SIZE * 20, 80)


@pytest.mark.parametrize(
    "make",
    [
        lambda: PageView.layer_first(torch.zeros(2, 2, 10, 2, 8), PAGE_SIZE),  # 10 % 4 != 0
        lambda: PageView.layer_first(torch.zeros(2, 3, 8, 2, 8), PAGE_SIZE),  # not K/V
        lambda: PageView.layer_first(torch.zeros(2, 2, 8, 2), PAGE_SIZE),  # 4-D
        lambda: PageView.layer_first(torch.zeros(2, 2, 8, 8, 2).transpose(3, 4), PAGE_SIZE),
        lambda: PageView.page_first(torch.zeros(3, 2, 3, 4, 2, 8)),  # not K/V nor a latent
        lambda: PageView(torch.zeros(64), 16, 16, 8, 1, 8, num_kv=3),
        lambda: PageView.page_first(torch.zeros(3, 2, 2, 4, 2)),  # 5-D
        lambda: PageView(torch.zeros(10), 4, 4, 4, 1, 8),  # one page does not fit
        lambda: PageView(torch.zeros(64), 16, 0, 8, 1, 8),  # zero stride
    ],
)
def test_page_view_rejects_bad_tensors(make: Callable[[], PageView]) -> None:
    with pytest.raises(ValueError):
        make()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_cross_device_torch_path(direction: str, backend: str) -> None:
    gen = torch.Generator().manual_seed(5)
    device = make_pool("device", torch.bfloat16, gen, device=torch.device("cuda"))
    layout, host_tensor = make_pool("host_page_first", torch.bfloat16, gen, torch.device("cpu"))
    host = (layout, host_tensor.pin_memory())
    src, dst = (device, host) if direction == "d2h" else (host, device)
    src_ids, dst_ids = [3, 3, 0], [1, 5, 2]
    expected = dst[1].cpu().clone()
    naive_transfer((src[0], src[1].cpu()), (dst[0], expected), src_ids, dst_ids)
    ids_on = [torch.tensor(src_ids, dtype=torch.int32), torch.tensor(dst_ids, device="cuda")]
    transfer_pages(view(*src), view(*dst), ids_on[0], ids_on[1], backend=backend)
    torch.cuda.synchronize()
    assert_bits_equal(dst[1].cpu(), expected)
