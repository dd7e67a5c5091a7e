"""The context-parallel KV gather: ownership math, the Triton pack and map against their torch
references (and those against naive loops), and `ShardedDeviceKVPool` in real gloo worlds of
2 and 4 ranks against a replicated `DeviceKVPool`, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from multirank import run_gloo_ranks

from gpu_worker.kernels.cp_gather import (
    chunk_pages_of,
    gather_map,
    gather_map_torch,
    gather_map_triton,
    pack_owned,
    pack_owned_torch,
    pack_owned_triton,
)
from gpu_worker.memory.device_pool import DeviceKVPool
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.memory.sharded_pool import ShardedDeviceKVPool
from gpu_worker.model.forward_batch import ForwardBatch
from gpu_worker.parallel.cp_layout import CPLayout

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
PAGE_SIZE, NUM_LAYERS = 4, 3


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BITS[t.element_size()])


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert torch.equal(bits(a), bits(b)), what


# ---------------------------------------------------------------- ownership


def test_layout_formula_and_inverse() -> None:
    for n in (1, 2, 3, 4):
        layout = CPLayout(PAGE_SIZE, n)
        slots = torch.arange(37 * PAGE_SIZE)
        rows = layout.local_rows(slots)
        for x in range(0, len(slots), 7):
            q = x // PAGE_SIZE
            assert layout.owner_of_page(q) == q % n
            assert int(rows[x]) == (q // n) * PAGE_SIZE + x % PAGE_SIZE
        owners = layout.owner_of_slots(slots)
        for r in range(n):
            mine = layout.owned_mask(slots, r)
            assert torch.equal(mine, owners == r)
            # each rank's rows are distinct, fit its pool, and map back to the same slots
            assert len(set(rows[mine].tolist())) == int(mine.sum())
            assert int(rows[mine].max()) < layout.num_local_pages(37) * PAGE_SIZE
            assert torch.equal(layout.logical_slots(rows[mine], r), slots[mine])
        assert sum(len(layout.owned_pages(list(range(37)), r)) for r in range(n)) == 37


def test_layout_article_example() -> None:
    """Figure 1a: two ranks; A/B/C extended by D, which lands on logical page 5, local 2 of
    rank 1."""
    layout = CPLayout(PAGE_SIZE, 2)
    assert (layout.owner_of_page(5), layout.local_page(5)) == (1, 2)
    assert layout.logical_page(2, 1) == 5
    assert layout.owned_pages([0, 1, 2, 5], 0) == [0, 2]
    assert layout.max_owned([0, 1, 2, 5]) == 2
    assert layout.num_local_pages(7) == 4


# ---------------------------------------------------------------- kernels


def naive_map(pages: list[int], n: int, m: int) -> list[int]:
    seen = [0] * n
    out = []
    for q in pages:
        out.append((q % n) * m + seen[q % n])
        seen[q % n] += 1
    return out


def random_pages(gen: torch.Generator, num: int, limit: int, n: int, skip_rank: int) -> list[int]:
    """`num` distinct pages below `limit`, none of them owned by `skip_rank` (-1: any)."""
    pool = [q for q in torch.randperm(limit, generator=gen).tolist() if q % n != skip_rank]
    return pool[:num]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_map_kernel_matches_reference_and_loop(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    for num, skip in ((0, -1), (1, -1), (9, 1), (300, -1), (257, 0)):  # > one 128-page block
        pages = random_pages(gen, num, 400, n, skip)
        ids = torch.tensor(pages, dtype=torch.int64)
        m = chunk_pages_of(ids, n) + (1 if num == 9 else 0)  # a chunk larger than needed too
        expected = naive_map(pages, n, m)
        assert gather_map_torch(ids, n, m).tolist() == expected
        assert gather_map_triton(ids.to(DEVICE), n, m).tolist() == expected
        assert gather_map(ids, n, m, backend="auto").tolist() == expected


def test_map_rejects_a_short_chunk() -> None:
    ids = torch.tensor([0, 2, 4], dtype=torch.int64)
    with pytest.raises(ValueError, match="chunk_pages"):
        gather_map_torch(ids, 2, 2)


def make_pool(
    gen: torch.Generator, dtype: torch.dtype, num_kv: int, num_local_pages: int
) -> torch.Tensor:
    heads, dim = (2, 8) if num_kv == 2 else (1, 12)
    shape = (NUM_LAYERS, num_kv, num_local_pages * PAGE_SIZE, heads, dim)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)


def naive_pack(
    pool: torch.Tensor, layer: int, pages: list[int], rank: int, n: int, send: torch.Tensor
) -> torch.Tensor:
    """The send chunk built page by page from the logical shapes, over a copy of `send`."""
    send, m = send.clone(), send.shape[0]
    for q, g in zip(pages, naive_map(pages, n, m), strict=True):
        if q % n == rank:
            j = q // n
            send[g - rank * m] = pool[layer, :, j * PAGE_SIZE : (j + 1) * PAGE_SIZE]
    return send


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv", [2, 1], ids=["mha", "mla"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_pack_kernel_matches_reference(dtype: torch.dtype, num_kv: int, n: int) -> None:
    gen = torch.Generator().manual_seed(n * 10 + num_kv)
    limit = 24
    pool_pages = CPLayout(PAGE_SIZE, n).num_local_pages(limit)
    # ranks that own none of the list: skip rank 1 (and an empty list)
    for num, skip in ((7, -1), (5, 1), (0, -1)):
        pages = random_pages(gen, num, limit, n, skip)
        ids = torch.tensor(pages, dtype=torch.int64, device=DEVICE)
        m = max(chunk_pages_of(ids, n), 1)
        gathered = gather_map_torch(ids, n, m)
        pools = [make_pool(gen, dtype, num_kv, pool_pages) for _ in range(n)]
        for rank in range(n):
            blank = torch.full((m, num_kv, PAGE_SIZE, *pools[rank].shape[3:]), float("nan"))
            blank = blank.to(dtype).to(DEVICE)  # NaN where the chunk gets no page
            expected = naive_pack(pools[rank], 1, pages, rank, n, blank)
            for pack in (pack_owned_torch, pack_owned_triton):
                send = blank.clone()
                pack(pools[rank], 1, PAGE_SIZE, ids, gathered, rank, n, send)
                assert_bits_equal(send, expected, f"{pack.__name__} rank {rank} {pages}")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_gather_in_one_process_reads_logical_pages(backend: str, n: int) -> None:
    """Every rank packs its chunk of a sharded copy of a full pool; the chunks concatenated
    (what all_gather_into_tensor produces) read through the map give the full pool's pages
    in logical order, for every layer."""
    gen = torch.Generator().manual_seed(7 + n)
    layout, limit = CPLayout(PAGE_SIZE, n), 30
    full = make_pool(gen, torch.bfloat16, 2, limit)
    local = [torch.full_like(full[:, :, : layout.num_local_pages(limit) * PAGE_SIZE], 7.0)]
    local = local * n
    local = [t.clone() for t in local]
    for q in range(limit):  # each page to its owner's local page
        dst = local[q % n][:, :, (q // n) * PAGE_SIZE : (q // n + 1) * PAGE_SIZE]
        dst.copy_(full[:, :, q * PAGE_SIZE : (q + 1) * PAGE_SIZE])
    pages = random_pages(gen, 11, limit, n, -1)
    ids = torch.tensor(pages, dtype=torch.int64, device=DEVICE)
    m = chunk_pages_of(ids, n)
    gathered = gather_map(ids, n, m, backend)
    for layer in range(NUM_LAYERS):
        chunks = []
        for rank in range(n):
            send = torch.full((m, 2, PAGE_SIZE, 2, 8), float("nan"), dtype=full.dtype)
            send = send.to(DEVICE)
            pack_owned(local[rank], layer, PAGE_SIZE, ids, gathered, rank, n, send, backend)
            chunks.append(send)
        buffer = torch.cat(chunks)  # (N * M, num_kv, p, H, D)
        for q, g in zip(pages, gathered.tolist(), strict=True):
            want = full[layer, :, q * PAGE_SIZE : (q + 1) * PAGE_SIZE]
            assert_bits_equal(buffer[g], want, f"layer {layer} page {q}")


# ---------------------------------------------------------------- the pool


def spec_of(dtype: torch.dtype, mla: bool) -> KVSpec:
    if mla:
        return KVSpec(NUM_LAYERS, 1, 12, PAGE_SIZE, dtype, num_kv=1)
    return KVSpec(NUM_LAYERS, 2, 8, PAGE_SIZE, dtype)


NUM_POOL_PAGES = 40
# Forward passes: per request (page ids, prefix_len, new tokens). The same on every rank.
# 1: cold prefills (no prefix page: nothing to gather); 2: an extend onto a partly filled
# prefix page and a request sharing A's first two pages; 3: decode steps; 4-5: a request
# whose pages all belong to rank 0 at N = 2, 3 and 4 (the other ranks own none of them).
PASSES: list[list[tuple[list[int], int, int]]] = [
    [([0, 1, 2, 3], 0, 10), ([5, 6], 0, 7)],
    [([0, 1, 2, 3], 10, 5), ([0, 1, 9, 10], 8, 6)],
    [([0, 1, 2, 3], 15, 1), ([5, 6], 7, 1), ([0, 1, 9, 10], 14, 1)],
    [([12, 24, 36], 0, 10)],
    [([12, 24, 36], 10, 2), ([7, 8, 11], 0, 9)],
]


def run_passes(
    sharded: ShardedDeviceKVPool, replicated: DeviceKVPool, spec: KVSpec, prefetch: bool
) -> None:
    """Give both pools the same writes, pass by pass and layer by layer, and compare every
    read; raise AssertionError on the first difference."""
    gen = torch.Generator().manual_seed(123)  # the same K/V on every rank
    for step, seqs in enumerate(PASSES):
        built = []
        for pages, prefix_len, num_new in seqs:
            slots = replicated.slot_ids(pages, prefix_len + num_new)
            built.append(([0] * num_new, prefix_len, slots))
        batch = ForwardBatch.build(built, torch.device("cpu"))
        new_slots = torch.cat([s[p:] for _, p, s in built])
        if prefetch:
            sharded.prefetch(0, batch)
        for layer in range(spec.num_layers):
            sharded.before_attention(layer, batch)
            shape = (len(new_slots), spec.num_kv_heads, spec.head_dim)
            k, v = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(2))
            k, v = k.to(spec.dtype), v.to(spec.dtype)
            if spec.mla:
                sharded.set_latent(layer, new_slots, k)
                replicated.set_latent(layer, new_slots, k)
            else:
                sharded.set_kv(layer, new_slots, k, v)
                replicated.set_kv(layer, new_slots, k, v)
            reads = [*batch.slot_ids, torch.cat(batch.slot_ids).flip(0)]
            for slots in reads:
                if spec.mla:
                    got, want = (
                        [sharded.get_latent(layer, slots)],
                        [replicated.get_latent(layer, slots)],
                    )
                else:
                    got = list(sharded.get_kv(layer, slots))
                    want = list(replicated.get_kv(layer, slots))
                for g, w in zip(got, want, strict=True):
                    where = f"pass {step} layer {layer}"
                    assert not bool(g.isnan().any()), f"{where}: read an unwritten row"
                    assert_bits_equal(g, w, where)


def check_union(sharded: ShardedDeviceKVPool, replicated: DeviceKVPool, group) -> None:
    """The ranks' owned rows, put back at their logical slots, are the replicated pool."""
    n, p = sharded.cp_size, PAGE_SIZE
    mine = sharded.kv.contiguous()
    parts = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(parts, mine, group=group)
    full = torch.empty_like(replicated.kv)
    filled = torch.zeros(full.shape[2], dtype=torch.bool)
    for r, part in enumerate(parts):
        for j in range(sharded.num_local_pages):
            q = sharded.layout.logical_page(j, r)
            if q < NUM_POOL_PAGES:
                full[:, :, q * p : (q + 1) * p] = part[:, :, j * p : (j + 1) * p]
                assert not bool(filled[q * p : (q + 1) * p].any())
                filled[q * p : (q + 1) * p] = True
    assert bool(filled.all())
    assert_bits_equal(full, replicated.kv, "union of the ranks' rows")


# (dtype, mla, num_buffers, backend, prefetch, transport): each runs in the same world;
# shm packs peers' pages from their mapped rows, collective all-gathers them
WORLD_CASES = [
    (torch.float32, False, 2, "torch", False, "collective"),
    (torch.bfloat16, False, 1, "torch", False, "shm"),
    (torch.float64, True, 2, "torch", True, "shm"),
    (torch.float16, False, 2, "torch", True, "collective"),
    (torch.float32, False, 2, "torch", True, "shm"),
]


class GatherReadPool(DeviceKVPool):
    """A replicated pool that attention reads by slot gathers only, as it reads a sharded
    one (the in-place decode path sums in another order, so its logits differ in the last
    bits)."""

    contiguous_slices = False


@torch.no_grad()
def model_oracle(preset: str, rank: int, world: int, group) -> None:
    """The float64 preset's logits over chunked prefill, decode and a shared prefix are the
    same with the sharded pool as with a replicated one, exactly."""
    from gpu_worker.model import build_model

    model = build_model(preset, torch.device("cpu"), torch.float64, seed=0)[1]
    c = model.config
    spec = KVSpec(c.num_layers, c.num_kv_heads, c.kv_head_dim, PAGE_SIZE, torch.float64, c.num_kv)
    cpu = torch.device("cpu")
    replicated = GatherReadPool(spec, 24, cpu)
    sharded = ShardedDeviceKVPool(spec, 24, cpu, rank, world, group, check_reads=True)
    assert sharded.transport == "shm"  # auto, on CPU ranks of one host
    sharded.kv.fill_(float("nan"))
    pages = {"A": [0, 1, 2, 3], "B": [5, 6, 7], "C": [0, 1, 9, 10]}
    tokens = {"A": list(range(30, 41)), "B": list(range(70, 76)), "C": [*range(30, 38), 90, 91]}
    # passes: (request, prefix_len, new tokens); decode steps feed back the argmax
    passes = [[("A", 0, 7), ("B", 0, 6)], [("A", 7, 4)], [("C", 8, 2)]]
    passes += [[("A", 11 + i, 1), ("B", 6 + i, 1), ("C", 10 + i, 1)] for i in range(3)]
    for step, seqs in enumerate(passes):
        built = []
        for name, prefix_len, num_new in seqs:
            slots = replicated.slot_ids(pages[name], prefix_len + num_new)
            built.append((tokens[name][prefix_len : prefix_len + num_new], prefix_len, slots))
        want = model(ForwardBatch.build(built, cpu), replicated)
        got = model(ForwardBatch.build(built, cpu), sharded)
        assert not bool(want.isnan().any())
        assert_bits_equal(got, want, f"{preset} pass {step} logits")
        for (name, prefix_len, num_new), row in zip(seqs, want, strict=True):
            if len(tokens[name]) == prefix_len + num_new:  # its next token: greedy
                tokens[name].append(int(row.argmax()))


MODEL_PRESETS = {2: ["tiny", "tiny-mla"], 4: ["tiny"]}


def world_rank(rank: int, world: int, group: dist.ProcessGroup, cases: list) -> None:
    for dtype, mla, num_buffers, backend, prefetch, transport in cases:
        spec = spec_of(dtype, mla)
        replicated = DeviceKVPool(spec, NUM_POOL_PAGES, torch.device("cpu"))
        sharded = ShardedDeviceKVPool(
            spec,
            NUM_POOL_PAGES,
            torch.device("cpu"),
            rank,
            world,
            group,
            num_buffers,
            backend=backend,
            check_reads=True,
            transport=transport,
        )
        assert sharded.transport == transport
        replicated.kv.fill_(float("nan"))  # an unwritten row reads as NaN in both
        sharded.kv.fill_(float("nan"))
        run_passes(sharded, replicated, spec, prefetch)
        check_union(sharded, replicated, group)
        expected = (sharded.num_local_pages + 1) * spec.bytes_per_page
        assert sharded.device_bytes() == expected
    for preset in MODEL_PRESETS[world]:
        model_oracle(preset, rank, world, group)


def run_world(world: int, cases: list) -> None:
    run_gloo_ranks(world_rank, world, cases, timeout_s=90)


def test_sharded_pool_world_of_2() -> None:
    run_world(2, [*WORLD_CASES, (torch.bfloat16, True, 2, "triton", False, "collective")])


def test_sharded_pool_world_of_4() -> None:
    run_world(4, WORLD_CASES)


def test_sharded_pool_at_cp1_is_the_replicated_pool() -> None:
    """With one rank there is no group and no collective: the gather is the pack alone."""
    spec = spec_of(torch.float32, False)
    replicated = DeviceKVPool(spec, NUM_POOL_PAGES, torch.device("cpu"))
    sharded = ShardedDeviceKVPool(spec, NUM_POOL_PAGES, torch.device("cpu"), 0, 1, None)
    replicated.kv.fill_(float("nan"))
    sharded.kv.fill_(float("nan"))
    run_passes(sharded, replicated, spec, prefetch=False)
    n = NUM_POOL_PAGES * PAGE_SIZE
    assert_bits_equal(sharded.kv[:, :, :n], replicated.kv)


def test_sharded_pool_refuses_reads_it_did_not_gather() -> None:
    spec = spec_of(torch.float32, False)
    pool = ShardedDeviceKVPool(spec, 8, torch.device("cpu"), 0, 1, None, check_reads=True)
    slots = pool.slot_ids([1, 2], 6)
    batch = ForwardBatch.build([([0] * 2, 4, slots)], torch.device("cpu"))
    with pytest.raises(RuntimeError, match="before_attention"):
        pool.get_kv(0, slots)
    pool.before_attention(0, batch)
    with pytest.raises(RuntimeError, match="outside the gathered pages"):
        pool.get_kv(0, pool.slot_ids([3], 2))
    with pytest.raises(RuntimeError, match="before_attention"):
        pool.get_kv(2, slots)  # layer 1 was prefetched, layer 2 never gathered
    assert not pool.contiguous_slices
    unaligned = ForwardBatch.build([([0] * 2, 4, slots + 1)], torch.device("cpu"))
    with pytest.raises(ValueError, match="page-aligned"):
        pool.before_attention(0, unaligned)


def test_scratch_and_device_bytes() -> None:
    spec = spec_of(torch.bfloat16, False)
    pool = ShardedDeviceKVPool(spec, 8, torch.device("cpu"), 0, 1, None, num_buffers=2)
    assert pool.scratch_bytes() == 0
    slots = pool.slot_ids([1, 2, 3], 10)
    batch = ForwardBatch.build([([0] * 3, 7, slots)], torch.device("cpu"))
    plan = pool.plan(batch)
    # prefix pages 1 and 2 gathered (one rank: M = 2), page 3 staged, one trash page
    assert (plan.chunk_pages, plan.num_staged, plan.num_scratch_pages) == (2, 1, 4)
    page_block = 2 * PAGE_SIZE * 2 * 8 * 2  # (K, V) x p x heads x dim x 2 bytes
    assert pool.scratch_bytes_for(plan) == 2 * 4 * page_block
    pool.before_attention(0, batch)
    assert pool.scratch_bytes() == pool.scratch_bytes_for(plan)  # both buffers filled
    assert pool.device_bytes() == 9 * spec.bytes_per_page
