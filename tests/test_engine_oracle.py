"""The oracle: a cache hit never changes an output (DESIGN.md invariant 1).

Greedy generation on the float64 tiny model, cold with the radix cache off, must give the
same tokens with device hits and with hits forced into the host tier, for every write policy
and host layout. Tokens alone are a weak oracle (a model that keeps repeating a few tokens can
hide KV written a page off), so every step's float64 logits must equal the cold run's
exactly (`Req.logits_trace`). Cached-token counts are checked against an independent
brute-force model of what each tier holds, not against the tree itself.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.scheduler.request import GenerateOutput
from gpu_worker.scheduler.scheduler import SchedulerConfig

PAGE = 4
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


@dataclass(frozen=True)
class Cold:
    """The cold reference of one prompt: its tokens and each step's logits (steps, vocab)."""

    output_ids: list[int]
    logits: torch.Tensor


def generate_traced(
    eng: Engine, prompts: Sequence[list[int]]
) -> list[tuple[GenerateOutput, torch.Tensor]]:
    """Run `prompts` together, keeping each step's logits: [(output, (steps, vocab))]."""
    reqs = [eng.submit(p, GREEDY) for p in prompts]
    for req in reqs:
        req.logits_trace = []
    outs = eng.run(reqs)
    return [(o, torch.stack(r.logits_trace or [])) for o, r in zip(outs, reqs, strict=True)]


def traced(eng: Engine, prompt: list[int]) -> tuple[GenerateOutput, torch.Tensor]:
    return generate_traced(eng, [prompt])[0]


def assert_matches_cold(out: GenerateOutput, logits: torch.Tensor, want: Cold) -> None:
    """Same tokens and bit-identical float64 logits at every step."""
    assert out.output_ids == want.output_ids
    assert logits.dtype == torch.float64 and logits.shape == want.logits.shape
    assert torch.equal(logits, want.logits), (
        f"logits differ from the cold run by up to {(logits - want.logits).abs().max().item():.3g}"
    )


def device_kv(eng: Engine, tokens: list[int]) -> torch.Tensor:
    """The KV the engine's device cache holds for the cached prefix of `tokens`:
    (num_layers, 2, cached_len, num_kv_heads, head_dim), position by position."""
    match = eng.cache.match(tokens)
    pool = eng.cache.device_pool
    return pool.kv[:, :, pool.slot_ids(list(match.device_page_ids), match.device_len)]


def make_prompts(seed: int = 7) -> list[list[int]]:
    """3 groups x 3 prompts; each group shares an unaligned prefix, suffixes differ."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(3):
        shared = [rng.randrange(256) for _ in range(rng.randint(17, 30))]
        for _ in range(3):
            prompts.append(shared + [rng.randrange(256) for _ in range(rng.randint(3, 14))])
    return prompts


def aligned_lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n - n % PAGE


def kv_tokens(prompt: list[int], output: list[int]) -> list[int]:
    """Tokens whose KV a finished request leaves behind: all but the last generated."""
    return (prompt + output)[:-1]


def expected_hit(prompt: list[int], held: list[list[int]]) -> int:
    """Longest page-aligned prefix of prompt[:-1] found in any of the held sequences."""
    return max((aligned_lcp(prompt[:-1], seq) for seq in held), default=0)


def engine(cache: CacheConfig, chunk: int = 512) -> Engine:
    """A float64 tiny engine whose rows are batch-invariant, so logits can be compared exactly."""
    eng = Engine(EngineConfig(cache=cache, scheduler=SchedulerConfig(chunked_prefill_size=chunk)))
    eng.model.set_batch_invariant(True)
    return eng


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts()


@pytest.fixture(scope="module")
def cold_kv(prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt's prefix KV computed cold (the cache flushed before each), by position.

    Logits alone cannot see every misplaced page: attention over keys that already carry
    their RoPE is a sum over a set, so pages swapped within the prefix change the logits only
    in their rounding. The KV bytes at each position can."""
    eng = engine(CacheConfig(page_size=PAGE, num_device_pages=256))
    kvs = []
    for p in prompts:
        assert eng.flush_cache()
        assert eng.generate(p, GREEDY).cached.total == 0
        kvs.append(device_kv(eng, p).clone())
        assert kvs[-1].shape[2] == (len(p) - 1) // PAGE * PAGE
    return kvs


@pytest.fixture(scope="module")
def cold(prompts: list[list[int]]) -> list[Cold]:
    eng = engine(CacheConfig(page_size=PAGE, num_device_pages=256, enable_radix_cache=False))
    runs = [traced(eng, p) for p in prompts]
    assert all(o.cached.total == 0 for o, _ in runs)
    assert eng.cache.num_free_device_pages == 256
    return [Cold(o.output_ids, logits) for o, logits in runs]


def test_cold_reference_is_varied(cold: list[Cold]) -> None:
    """The oracle is only as strong as the outputs are varied: no prompt's continuation is one
    repeated token, and prompts with different suffixes continue differently."""
    assert all(len(set(c.output_ids)) >= 4 for c in cold), [c.output_ids for c in cold]
    assert len({tuple(c.output_ids) for c in cold}) == len(cold)
    assert all(c.logits.shape == (GREEDY.max_new_tokens, 260) for c in cold)


def test_device_hits_match_cold(prompts: list[list[int]], cold: list[Cold]) -> None:
    eng = engine(CacheConfig(page_size=PAGE, num_device_pages=256), chunk=8)
    held: list[list[int]] = []
    for turn in range(2):
        for p, want in zip(prompts, cold, strict=True):
            out, logits = traced(eng, p)
            assert_matches_cold(out, logits, want)
            assert out.cached.host == 0
            assert out.cached.device == expected_hit(p, held), f"turn {turn}"
            held.append(kv_tokens(p, out.output_ids))
        eng.check_integrity()
    # the second turn hit every prompt's whole aligned prefix (prompt[:-1])
    assert eng.cache_stats()["cached_tokens_device"] > 0


def test_batched_requests_match_cold(prompts: list[list[int]], cold: list[Cold]) -> None:
    eng = engine(CacheConfig(page_size=PAGE, num_device_pages=256), chunk=16)
    for _ in range(2):  # the second time everything is cached
        runs = generate_traced(eng, prompts)
        for (out, logits), want in zip(runs, cold, strict=True):
            assert_matches_cold(out, logits, want)
    outs = [o for o, _ in runs]
    assert [o.cached.device for o in outs] == [(len(p) - 1) // PAGE * PAGE for p in prompts]
    eng.check_integrity()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_host_hits_match_cold(
    prompts: list[list[int]],
    cold: list[Cold],
    cold_kv: list[torch.Tensor],
    policy: str,
    layout: str,
) -> None:
    cfg = CacheConfig(
        page_size=PAGE,
        num_device_pages=256,
        enable_hierarchical_cache=True,
        hicache_ratio=2.0,
        hicache_write_policy=policy,  # type: ignore[arg-type]
        hicache_mem_layout=layout,  # type: ignore[arg-type]
        write_through_threshold=1,
    )
    eng = engine(cfg, chunk=8)
    # Pass 1 fills the device cache; pass 2 hits it (the hit makes write_through_selective
    # back the matched paths up). Then the device cache is emptied: what was backed up stays
    # on the host.
    for _ in range(2):
        for p, want in zip(prompts, cold, strict=True):
            assert_matches_cold(*traced(eng, p), want)
    eng.cache.drain()
    eng.cache.evict_device(eng.cache.tree.num_device_pages)
    assert eng.cache.tree.num_device_pages == 0
    assert eng.cache.tree.num_host_pages > 0
    eng.check_integrity()

    on_device: list[list[int]] = []  # what pass 3 puts back on the device, request by request
    for i, (p, want) in enumerate(zip(prompts, cold, strict=True)):
        out, logits = traced(eng, p)
        assert_matches_cold(out, logits, want)
        device = expected_hit(p, on_device)
        total = (len(p) - 1) // PAGE * PAGE  # every prompt's prefix was backed up in pass 2
        assert (out.cached.device, out.cached.host) == (device, total - device)
        assert torch.equal(device_kv(eng, p), cold_kv[i]), "restored KV differs from cold KV"
        on_device.append(kv_tokens(p, out.output_ids))
    assert eng.cache.stats.host_hit_tokens > 0
    eng.cache.drain()
    eng.check_integrity()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_small_device_pool_spills_to_host(
    prompts: list[list[int]], cold: list[Cold], policy: str
) -> None:
    """A device pool of a few requests: LRU eviction pushes prefixes to the host, reused later."""
    cfg = CacheConfig(
        page_size=PAGE,
        num_device_pages=24,
        enable_hierarchical_cache=True,
        hicache_ratio=8.0,
        hicache_write_policy=policy,  # type: ignore[arg-type]
    )
    eng = engine(cfg, chunk=8)
    for _ in range(2):
        for p, want in zip(prompts, cold, strict=True):
            assert_matches_cold(*traced(eng, p), want)
    assert eng.cache.stats.host_hit_tokens > 0
    eng.cache.drain()
    eng.check_integrity()


def test_flush_cache_returns_every_page(prompts: list[list[int]]) -> None:
    cfg = CacheConfig(page_size=PAGE, num_device_pages=64, enable_hierarchical_cache=True)
    eng = engine(cfg)
    eng.generate_batch(prompts[:3], GREEDY)
    assert eng.cache.num_free_device_pages < 64
    assert eng.flush_cache()
    assert eng.cache.num_free_device_pages == 64
    assert eng.cache.host_pool is not None
    assert eng.cache.host_pool.allocator.num_free == eng.cache.host_pool.num_pages
    assert eng.generate(prompts[0], GREEDY).cached.total == 0
