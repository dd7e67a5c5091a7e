"""External storage (L3) in one engine (issue 9): the oracle, policies, faults, isolation.

Every test runs the float64 tiny model with a real `file` backend in a temporary directory.
The oracle: a hit served from storage alone (after a flush of device and host, or in a new
engine on the same directory) gives the cold run's tokens and bit-identical logits, and the
cached tokens per tier are exact. Policies are checked with a gated backend whose reads past
the first batch wait for the test, so hit lengths, not clocks, are asserted.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from test_engine_oracle import Cold, assert_matches_cold, traced
from test_storage_auth import forge

from bus_schemas.page_hash import chain_hashes, root_hash
from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.cache.storage_io import StorageFaults
from gpu_worker.cache.storage_tier import PrefetchTimeout
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.scheduler.request import CachedTokens
from gpu_worker.scheduler.scheduler import SchedulerConfig
from gpu_worker.storage import FileBackend, base
from gpu_worker.storage.file import file_size

PAGE = 4
PROMPT = [(i * 37 + 11) % 250 for i in range(61)]  # 61 tokens: 15 whole pages before the last
HIT = (len(PROMPT) - 1) // PAGE * PAGE  # 60: storage can serve every page but the last token's
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def config(directory: Path, **cache: object) -> EngineConfig:
    kw: dict[str, object] = dict(
        page_size=PAGE,
        num_device_pages=96,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(directory),
        hicache_storage_prefetch_policy="wait_complete",
        storage_batch_pages=4,
    )
    kw.update(cache)
    # batch-invariant rows: logits are compared bit for bit with the cold run
    return EngineConfig(cache=CacheConfig(**kw), batch_invariant=True)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def cold() -> Cold:
    cache = CacheConfig(page_size=PAGE, enable_radix_cache=False)
    eng = Engine(EngineConfig(cache=cache, batch_invariant=True))
    out, logits = traced(eng, PROMPT)
    eng.close()
    return Cold(out.output_ids, logits)


def write_prompt(directory: Path, prompt: Sequence[int] = PROMPT, salt: str = "") -> None:
    """An engine computes `prompt` and writes it through to the store, then goes away."""
    eng = Engine(config(directory))
    eng.run([eng.submit(prompt, GREEDY, salt)])
    eng.drain()  # backups done, then their writes
    eng.close()


def objects(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("*/*") if p.is_file() and not p.name.startswith("."))


def test_a_new_engine_serves_from_storage_exactly(tmp_path: Path, cold: Cold) -> None:
    write_prompt(tmp_path)
    assert len(objects(tmp_path)) == (len(PROMPT) + GREEDY.max_new_tokens - 1) // PAGE
    eng = Engine(config(tmp_path))
    out, logits = traced(eng, PROMPT)
    assert out.cached == CachedTokens(device=0, host=0, storage=HIT)
    assert_matches_cold(out, logits, cold)
    assert eng.cache.stats.storage_pages_read == HIT // PAGE
    eng.cache.check_integrity()
    # the pages now sit in the tree: the next request hits the device
    out, logits = traced(eng, PROMPT)
    assert out.cached == CachedTokens(device=HIT, host=0, storage=0)
    assert_matches_cold(out, logits, cold)
    eng.close()


@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
def test_after_a_flush_the_hit_comes_from_storage(tmp_path: Path, cold: Cold, policy: str) -> None:
    timeout = PrefetchTimeout(base_s=60.0)  # never cut: the hit is whole
    eng = Engine(config(tmp_path, hicache_storage_prefetch_policy=policy, prefetch_timeout=timeout))
    first, logits = traced(eng, PROMPT)
    assert first.cached.total == 0
    eng.drain()
    assert eng.flush_cache()
    out, logits = traced(eng, PROMPT)
    assert out.cached == CachedTokens(0, 0, HIT)
    assert_matches_cold(out, logits, cold)
    eng.close()


def test_a_longer_prompt_reads_its_stored_prefix_and_computes_the_rest(
    tmp_path: Path,
) -> None:
    write_prompt(tmp_path)
    longer = PROMPT + [(i * 13 + 5) % 250 for i in range(23)]
    eng = Engine(dataclasses.replace(config(tmp_path), cache=CacheConfig(page_size=PAGE)))
    want = eng.generate(longer, GREEDY)  # no cache at all
    eng.close()
    eng = Engine(config(tmp_path))
    out = eng.generate(longer, GREEDY)
    # the store holds the prompt's 61 tokens and 5 outputs written: 16 whole pages
    assert out.cached == CachedTokens(0, 0, 60)  # the stored pages that are a prefix of it
    assert out.output_ids == want.output_ids
    eng.close()


# ------------------------------------------------------------------ isolation


def test_salt_and_namespace_never_cross(tmp_path: Path) -> None:
    write_prompt(tmp_path, salt="alice")
    for cfg, salt in (
        (config(tmp_path), "bob"),
        (config(tmp_path), ""),
        (dataclasses.replace(config(tmp_path), dtype="float32"), "alice"),
        (config(tmp_path, page_size=8, num_device_pages=48), "alice"),
    ):
        eng = Engine(cfg)
        out = eng.run([eng.submit(PROMPT, GREEDY, salt)])[0]
        assert out.cached.total == 0, (cfg.dtype, cfg.cache.page_size, salt)
        assert eng.cache.stats.storage_pages_read == 0
        eng.close()
    eng = Engine(config(tmp_path))  # the same salt, after a restart: served
    out = eng.run([eng.submit(PROMPT, GREEDY, "alice")])[0]
    assert out.cached.storage == HIT
    eng.close()


# ------------------------------------------------------------------ host space


def test_little_host_space_falls_back_to_a_shorter_prefix(tmp_path: Path, cold: Cold) -> None:
    """A host pool of 20 pages: prefetches take at most half of it (10 pages = 40 tokens)."""
    write_prompt(tmp_path)
    eng = Engine(config(tmp_path, hicache_ratio=20 / 96))
    assert eng.cache.host_pool is not None and eng.cache.host_pool.num_pages == 20
    out, logits = traced(eng, PROMPT)
    assert out.cached == CachedTokens(0, 0, 10 * PAGE)
    assert_matches_cold(out, logits, cold)
    eng.cache.check_integrity()
    eng.close()


def test_an_aborted_waiting_request_leaves_nothing_behind(tmp_path: Path) -> None:
    write_prompt(tmp_path)
    eng = Engine(config(tmp_path))
    assert eng.cache.host_pool is not None
    free = eng.cache.host_pool.allocator.num_free
    req = eng.submit(PROMPT, GREEDY)
    eng.abort(req.rid)  # before any step: it never reached the ranks
    other = eng.submit(PROMPT, GREEDY)
    eng.step()  # other's prefetch is under way
    eng.abort(other.rid)
    eng.run([other])
    eng.drain()
    assert other.finish_reason == "abort"
    eng.cache.check_integrity()
    storage = eng.cache.storage
    assert storage is not None and storage.prefetches == {} and storage.held_pages == 0
    assert not storage.room_queue
    # what was read is kept as ordinary host cache, nothing leaked
    assert eng.cache.host_pool.allocator.num_free + eng.cache.tree.num_host_pages == free
    eng.close()


# ------------------------------------------------------------------ policies


class GatedBackend(FileBackend):
    """Reads of the first `open_pages` pages of a prefetch go through; later ones wait for
    `gate` (the test opens it when it has seen what it wanted)."""

    open_pages = 4
    gate = threading.Event()

    def get(self, keys: Sequence[str], out: Sequence[memoryview]) -> int:
        if self._seen >= self.open_pages:
            assert GatedBackend.gate.wait(30), "the test never opened the gate"
        self._seen += len(keys)
        return super().get(keys, out)

    _seen = 0


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[GatedBackend]]:
    GatedBackend.gate = threading.Event()
    monkeypatch.setitem(base.BACKENDS, "gated", lambda c: GatedBackend(c))
    yield GatedBackend
    GatedBackend.gate.set()


def policy_hit(directory: Path, policy: str, timeout: PrefetchTimeout | None = None) -> int:
    """Storage tokens of PROMPT when it waits behind one running request of 60 steps."""
    eng = Engine(
        dataclasses.replace(
            config(
                directory,
                hicache_storage_backend="gated",
                hicache_storage_prefetch_policy=policy,
                prefetch_timeout=timeout or PrefetchTimeout(),
            ),
            scheduler=SchedulerConfig(max_running_requests=1),
        )
    )
    blocker = eng.submit([7, 8, 9], SamplingParams(max_new_tokens=60, ignore_eos=True))
    req = eng.submit(PROMPT, GREEDY)
    if policy == "wait_complete":
        threading.Timer(0.3, GatedBackend.gate.set).start()
    outs = eng.run([blocker, req])
    GatedBackend.gate.set()
    eng.drain()
    eng.cache.check_integrity()
    eng.close()
    return outs[1].cached.storage


def test_prefetch_policies_take_what_they_wait_for(
    tmp_path: Path, gated: type[GatedBackend]
) -> None:
    write_prompt(tmp_path)
    full = policy_hit(tmp_path, "wait_complete")
    gated.gate = threading.Event()
    best = policy_hit(tmp_path, "best_effort")
    gated.gate = threading.Event()
    tiny = policy_hit(tmp_path, "timeout", PrefetchTimeout(base_s=0.0, per_ki_token_s=0.0))
    assert full == HIT
    assert best == gated.open_pages * PAGE  # the first batch, read while it queued
    # cut as soon as its read started: what the open first batch brought by then, at most
    assert tiny in (0, gated.open_pages * PAGE)


def test_the_cost_policy_recomputes_when_storage_is_slower(tmp_path: Path) -> None:
    """--hicache-load-policy cost covers L3: once rank 0 measured reads (made slow here) as
    slower than prefill, the next storage hit is recomputed instead of read."""
    write_prompt(tmp_path)
    slow = StorageFaults(read_delay_ms=150.0)
    eng = Engine(config(tmp_path, hicache_load_policy="cost", storage_faults=slow))
    eng.generate([(i * 7 + 1) % 250 for i in range(64)], GREEDY)  # measures prefill
    first = eng.generate(PROMPT, GREEDY)  # nothing measured about the store yet: read
    assert first.cached.storage == HIT
    eng.drain()
    assert eng.flush_cache()
    second = eng.generate(PROMPT, GREEDY)
    assert second.cached == CachedTokens(0, 0, 0)
    assert eng.cache.stats.storage_reads_skipped == 1
    assert second.output_ids == first.output_ids
    eng.close()


# ------------------------------------------------------------------ faults


def damage(directory: Path, page: int, how: str) -> None:
    """Damage the object of PROMPT's page `page` (objects sort by name, not by page: find it
    by reading the engine's own keys)."""
    eng = Engine(config(directory))
    hashes = chain_hashes(root_hash(eng.namespace, ""), PROMPT[:HIT], PAGE)
    payload_bytes = eng.kv_spec.bytes_per_page
    eng.close()
    key = f"{hashes[page].hex()}_tp0of1pp0of1"
    path = directory / key[:2] / key
    data = path.read_bytes()
    if how == "corrupt":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "misnamed":  # another page's object under this page's name
        other = f"{hashes[page + 1].hex()}_tp0of1pp0of1"
        path.write_bytes((directory / other[:2] / other).read_bytes())
    else:  # forged: another page's KV as this page's payload, its digest made to fit
        other = f"{hashes[page + 1].hex()}_tp0of1pp0of1"
        forge(path, (directory / other[:2] / other).read_bytes()[len(data) - payload_bytes :])


@pytest.mark.parametrize("how", ["corrupt", "truncated", "misnamed", "forged"])
def test_a_damaged_object_is_a_miss_from_there_on(tmp_path: Path, cold: Cold, how: str) -> None:
    write_prompt(tmp_path)
    damage(tmp_path, 9, how)
    eng = Engine(config(tmp_path))
    out, logits = traced(eng, PROMPT)
    assert out.cached == CachedTokens(0, 0, 9 * PAGE)  # pages 0..8 only
    assert_matches_cold(out, logits, cold)
    storage = eng.cache.storage
    assert storage is not None
    stats = storage.io.backend.stats()
    assert stats.num_quarantined == 1
    assert len(list((tmp_path / ".quarantine").iterdir())) == 1  # set aside, never read
    eng.drain()  # the pages it computed instead were written back: the store healed
    eng.close()
    eng = Engine(config(tmp_path))
    out, logits = traced(eng, PROMPT)
    assert out.cached == CachedTokens(0, 0, HIT)
    assert_matches_cold(out, logits, cold)
    eng.close()


def test_a_store_that_cannot_write_still_serves(tmp_path: Path, cold: Cold) -> None:
    """The directory's fan-out entries are files: every write fails; requests are served."""
    for i in range(256):
        (tmp_path / f"{i:02x}").write_bytes(b"")
    eng = Engine(config(tmp_path))
    out, logits = traced(eng, PROMPT)
    assert_matches_cold(out, logits, cold)
    eng.drain()
    storage = eng.cache.storage
    assert storage is not None
    assert storage.io.backend.stats().num_write_failures > 0
    assert eng.cache.stats.storage_pages_written == 0
    # what heartbeats carry to /metrics (hicache_engine_storage_write_failures)
    assert eng.cache_stats()["storage_write_failures"] > 0
    out, logits = traced(eng, PROMPT)  # still served, from the device
    assert out.cached.device == HIT
    eng.close()


# ------------------------------------------------------------------ what the index is told


def storage_events(eng: Engine) -> list[list[str]]:
    """The page hashes of the "stored" storage KV events rank 0 would send now."""
    return [e.page_hashes for e in eng.cache.drain_events() if e.tier == "storage"]


def test_a_partial_write_advertises_only_the_pages_the_store_took(tmp_path: Path) -> None:
    """A store capped at 5 objects takes 5 of the prompt's 15 pages (one write: the output
    completes no page). The storage KV event names exactly those 5: an event for the whole
    write would have the index advertise 10 pages the store does not hold."""
    eng = Engine(config(tmp_path))
    hashes = [h.hex() for h in chain_hashes(root_hash(eng.namespace, ""), PROMPT[:HIT], PAGE)]
    payload = eng.kv_spec.bytes_per_page
    eng.close()
    size = file_size(f"{hashes[0]}_tp0of1pp0of1", payload)
    eng = Engine(config(tmp_path, hicache_storage_size_gb=5.5 * size / 1e9))
    eng.run([eng.submit(PROMPT, SamplingParams(max_new_tokens=1, ignore_eos=True))])
    eng.drain()
    held = {p.name.split("_")[0] for p in objects(tmp_path)}
    assert held == set(hashes[:5])  # the put stopped at the cap
    assert storage_events(eng) == [hashes[:5]]
    assert eng.cache.stats.storage_pages_written == 5
    eng.close()


def test_engines_of_different_models_never_read_each_others_objects(tmp_path: Path) -> None:
    """Four models share one store: two checkpoints of the same shape (different weights),
    and two presets of other shapes. Each computes the same prompt while the others' objects
    are there, reads none of them (a hit of another model's KV with the same shape would
    change its outputs; one of another shape would be quarantined as the wrong size), and
    later reads its own back."""
    from test_hf_loader import corrupt_copy, save_hf_model

    def perturb(tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            if name.endswith("v_proj.weight"):
                t.mul_(1.5)

    a, b = tmp_path / "model-a", tmp_path / "model-b"
    save_hf_model("llama", a)
    corrupt_copy(a, b, edit_tensors=perturb)
    store = tmp_path / "store"
    prompt = [t % 128 for t in PROMPT]  # within the checkpoints' vocabulary
    models = [str(a), str(b), "tiny", "tiny-tp"]

    def engine(model: str, cache: CacheConfig | None = None) -> Engine:
        cfg = config(store) if cache is None else EngineConfig(cache=cache)
        return Engine(dataclasses.replace(cfg, model=model, dtype="float64"))

    want = {}
    for m in models:
        eng = engine(m, CacheConfig(page_size=PAGE, enable_radix_cache=False))
        want[m] = eng.generate(prompt, GREEDY).output_ids
        eng.close()
    assert want[str(a)] != want[str(b)]  # the perturbed weights answer otherwise
    for m in models:
        eng = engine(m)
        out = eng.generate(prompt, GREEDY)
        assert out.cached.total == 0, m  # the other models' objects are not its own
        assert out.output_ids == want[m], m
        eng.drain()
        eng.close()
    for m in models:
        eng = engine(m)
        out = eng.generate(prompt, GREEDY)
        assert out.cached == CachedTokens(0, 0, HIT), m
        assert out.output_ids == want[m], m
        eng.close()
    assert not (store / ".quarantine").exists()


def test_the_same_model_name_with_other_weights_never_reads_their_objects(
    tmp_path: Path,
) -> None:
    """Issue 20, finding 5: the namespace carries a digest of the weights, not only the
    `--model` string. Two `tiny` engines with other `--model-seed`s share a store and read
    none of each other's objects; a checkpoint directory whose files were replaced under the
    same path reads none of the old weights' objects. The same weights do read theirs."""
    write_prompt(tmp_path)  # tiny, seed 0
    other_seed = dataclasses.replace(config(tmp_path), seed=1)
    eng = Engine(other_seed)
    out = eng.generate(PROMPT, GREEDY)
    assert out.cached.total == 0 and eng.cache.stats.storage_pages_read == 0
    eng.drain()
    eng.close()
    for cfg in (config(tmp_path), other_seed):  # each seed reads its own objects back
        eng = Engine(cfg)
        assert eng.generate(PROMPT, GREEDY).cached == CachedTokens(0, 0, HIT), cfg.seed
        eng.close()
    assert not (tmp_path / ".quarantine").exists()

    from test_hf_loader import corrupt_copy, save_hf_model

    def perturb(tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            if name.endswith("v_proj.weight"):
                t.mul_(1.5)

    model, spare = tmp_path / "model", tmp_path / "spare"
    save_hf_model("llama", model)
    store = tmp_path / "hf-store"
    prompt = [t % 128 for t in PROMPT]  # within the checkpoint's vocabulary
    cfg = dataclasses.replace(config(store), model=str(model), dtype="float64")
    eng = Engine(cfg)
    first = eng.generate(prompt, GREEDY)
    eng.drain()
    eng.close()
    corrupt_copy(model, spare, edit_tensors=perturb)
    (spare / "model.safetensors").replace(model / "model.safetensors")  # new weights, same path
    eng = Engine(cfg)
    out = eng.generate(prompt, GREEDY)
    assert out.cached.total == 0  # the old weights' KV is not these weights' KV
    assert out.output_ids != first.output_ids
    eng.drain()
    eng.close()
    eng = Engine(cfg)
    assert eng.generate(prompt, GREEDY).cached == CachedTokens(0, 0, HIT)
    eng.close()
