"""L3 under CP page sharding (issue 22, build item 7; acceptance 1's L3 arm, 2, and 3's L3
part).

A page is whole on its owner CP rank, so a sharded engine's objects are the ones a CP1
engine of the same TP x PP layout writes: each is written once, by its owner, and every
rank looks up and reads only the pages it owns (the storage hit and read progress are the
MIN over the world of each rank's first missing page). Checked here with real engine worlds:

- CP2 sharded (the rank-suffix scheme, and the unified one with MLA's latent): the objects
  it writes are a CP1 engine's, byte for byte (one MAC key for both stores), and it serves
  the prompts back from them with CP1's logits.
- CP4 sharded, unified scheme (acceptance 2): it reads what a CP1 engine wrote, with CP1's
  float64 logits; what it writes is byte-identical to CP1's objects of the same prompts;
  a CP1 engine reads those back with its cold logits, and a TP2 engine with the logits it
  gets from CP1's objects.

The sharded worlds run with the rank consensus checker on (every rank's cache decisions,
the storage hits and read lengths agreed over the world among them, must be equal).
Logits are compared with CP1 engines that read KV by gathers as the sharded pool does
(`DebugHooks.gather_reads`); sharded pools are poisoned (NaN rows), so a page that was not
read into its owner's rows shows in the logits.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from multirank import run_world, shared_prefix_prompts
from test_multirank_consensus import checker_env

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.cache.storage_codec import PageShare, StorageLayout
from gpu_worker.cache.storage_io import ReadOp, StorageIO
from gpu_worker.consensus.records import load_logs
from gpu_worker.engine.engine import DebugHooks, Engine, EngineConfig
from gpu_worker.memory.host_pool import HostKVPool
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.storage import StorageConfig, make_backend
from gpu_worker.storage.file import KEY_FILE

CPU = torch.device("cpu")
PAGE = 4
GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)
# (phase, output ids, storage-hit tokens, logits (steps, vocab)) per request
Phase = list[tuple[str, list[int], int, torch.Tensor]]


def prompts(group: int) -> list[list[int]]:
    """Three prompts over one shared prefix; groups 0, 1, 2 share nothing."""
    return shared_prefix_prompts(27, shared=(13, 26), tail=(2, 9))[3 * group : 3 * group + 3]


def config(
    directory: Path, model: str, scheme: str, cp: int = 1, tp: int = 1, sharded: bool = False
) -> EngineConfig:
    cache = CacheConfig(
        page_size=PAGE,
        num_device_pages=64,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(directory),
        hicache_storage_key_scheme=scheme,  # type: ignore[arg-type]
        hicache_storage_prefetch_policy="wait_complete",
        storage_batch_pages=2,
    )
    return EngineConfig(
        model=model,
        cache=cache,
        parallel=ParallelConfig(tp_size=tp, cp_size=cp, kv_sharding=sharded),
        batch_invariant=True,
        debug=DebugHooks(gather_reads=not sharded, poison_kv=sharded),
    )


def traced(engine: Engine, phase: str, batch: list[list[int]], salt: str = "") -> Phase:
    """`batch` as one batch, every step's logits traced; drained after (on every rank)."""
    reqs = [engine.submit(p, GREEDY, salt) for p in batch]
    for r in reqs:
        r.logits_trace = []
    outs = engine.run(reqs)
    engine.drain()
    return [
        (phase, o.output_ids, o.cached.storage, torch.stack(r.logits_trace or []))
        for o, r in zip(outs, reqs, strict=True)
    ]


def write_then_read(engine: Engine, batch: list[list[int]]) -> Phase:
    """Compute `batch` (written through to the store), flush, serve it from the store."""
    run = traced(engine, "cold", batch)
    assert engine.flush_cache()
    run += traced(engine, "store", batch)
    engine.check_integrity()
    return run


def read_write_read(engine: Engine, theirs: list[list[int]], mine: list[list[int]]) -> Phase:
    """Serve `theirs` from objects another engine wrote; compute `mine` (written through),
    flush and serve it back from the store."""
    run = traced(engine, "theirs", theirs)
    run += traced(engine, "cold", mine)
    assert engine.flush_cache()
    run += traced(engine, "store", mine)
    engine.check_integrity()
    return run


def serve(engine: Engine, batch: list[list[int]]) -> Phase:
    return traced(engine, "store", batch)


def objects(directory: Path) -> dict[str, bytes]:
    """Every stored object of a file store: name -> bytes (header, MAC and payload)."""
    return {
        f.name: f.read_bytes()
        for fan in directory.iterdir()
        if fan.is_dir() and not fan.name.startswith(".")
        for f in fan.iterdir()
        if not f.name.startswith(".")
    }


def assert_same(got: Phase, want: Phase, phases: dict[str, str]) -> None:
    """Phase `g` of `got` has `want`'s phase `phases[g]` tokens and logits, bit for bit."""
    by_phase: dict[str, list[tuple[list[int], torch.Tensor]]] = {}
    for phase, out, _, logits in want:
        by_phase.setdefault(phase, []).append((out, logits))
    for g, w in phases.items():
        mine = [(out, logits) for phase, out, _, logits in got if phase == g]
        assert len(mine) == len(by_phase[w]) > 0, g
        for (out, logits), (w_out, w_logits) in zip(mine, by_phase[w], strict=True):
            assert out == w_out, f"{g}: tokens differ from {w}"
            assert not logits.isnan().any(), f"{g}: a row no rank wrote was read"
            assert torch.equal(logits, w_logits), f"{g}: logits differ from {w}"


def storage_hits(run: Phase, phase: str) -> int:
    return sum(hit for p, _, hit, _ in run if p == phase)


def copy_key(src: Path, dst: Path) -> None:
    """One MAC key for two stores, so the same objects have the same bytes."""
    dst.mkdir(mode=0o700, parents=True, exist_ok=True)
    shutil.copy2(src / KEY_FILE, dst / KEY_FILE)


@pytest.mark.parametrize(("model", "scheme"), [("tiny", "rank-suffix"), ("tiny-mla", "unified")])
def test_sharded_cp2_writes_cp1s_objects(tmp_path: Path, model: str, scheme: str) -> None:
    batch = prompts(0)
    cp1 = Engine(config(tmp_path / "cp1", model, scheme))
    try:
        want = write_then_read(cp1, batch)
    finally:
        cp1.close()
    copy_key(tmp_path / "cp1", tmp_path / "cp2")
    cfg = config(tmp_path / "cp2", model, scheme, cp=2, sharded=True)
    got = run_world(cfg, write_then_read, batch, env=checker_env(tmp_path / "checker"))
    assert_same(got, want, {"cold": "cold", "store": "cold"})
    assert storage_hits(got, "store") == storage_hits(want, "store") > 0
    stored, cp1_stored = objects(tmp_path / "cp2"), objects(tmp_path / "cp1")
    assert stored == cp1_stored and len(stored) > 0  # each page object once, CP1's bytes


def test_sharded_cp4_shares_unified_objects_with_cp1_and_tp2(tmp_path: Path) -> None:
    theirs, mine = prompts(1), prompts(2)
    model = "tiny-tp"  # KV heads for TP2
    # CP1 stores: `theirs` (the CP4 engine reads them) and `mine` (what CP4 must write)
    runs = {}
    for name, batch in (("theirs", theirs), ("mine", mine)):
        if name == "mine":  # one MAC key for every store
            copy_key(tmp_path / "cp1-theirs", tmp_path / "cp1-mine")
        engine = Engine(config(tmp_path / f"cp1-{name}", model, "unified"))
        try:
            runs[name] = traced(engine, "cold", batch)
        finally:
            engine.close()
    store = tmp_path / "cp4"
    shutil.copytree(tmp_path / "cp1-theirs", store)
    theirs_objects = objects(store)

    cfg = config(store, model, "unified", cp=4, sharded=True)
    got = run_world(cfg, read_write_read, theirs, mine, env=checker_env(tmp_path / "checker"))
    assert storage_hits(got, "theirs") > 0 and storage_hits(got, "store") > 0
    logs = load_logs(tmp_path / "checker")  # every rank recorded its decisions
    assert len(logs) == 4 and all(len(records) > 10 for records in logs.values())
    assert_same(got, runs["theirs"], {"theirs": "cold"})  # CP1 wrote, CP4 sharded read
    assert_same(got, runs["mine"], {"cold": "cold", "store": "cold"})
    written = {k: v for k, v in objects(store).items() if k not in theirs_objects}
    assert written == objects(tmp_path / "cp1-mine") and written  # CP1's objects, bytes too

    # CP4 sharded wrote, CP1 and TP2 read
    reader = Engine(config(store, model, "unified"))
    try:
        cp1 = traced(reader, "store", mine)
    finally:
        reader.close()
    assert storage_hits(cp1, "store") > 0
    assert_same(cp1, runs["mine"], {"store": "cold"})
    # A TP2 engine's logits differ from CP1's in the last bits (its row-parallel sums): its
    # reference is the same TP2 engine reading CP1's objects of the same prompts
    tp2 = run_world(config(store, model, "unified", tp=2), serve, mine)
    want = run_world(config(tmp_path / "cp1-mine", model, "unified", tp=2), serve, mine)
    assert storage_hits(tp2, "store") == storage_hits(want, "store") > 0
    assert_same(tp2, want, {"store": "store"})
    for (_, out, _, logits), (_, w_out, _, w_logits) in zip(tp2, runs["mine"], strict=True):
        assert out == w_out and torch.allclose(logits, w_logits, rtol=0, atol=1e-12)


# ---------------------------------------------------------------- one rank's share, unit


def test_each_rank_checks_and_moves_only_its_own_pages(tmp_path: Path) -> None:
    """Two ranks' shares of one store, without the agreement (no groups): each writes and
    reads only its pages (host page h on rank h % 2, at local page h // 2), and counts
    the first of its own pages that is missing; the MIN over the two is the agreed count."""
    spec = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, page_size=2, dtype=torch.float32)
    backend = make_backend(StorageConfig(directory=tmp_path))
    hashes = [bytes([q]) * 8 for q in range(4)]  # path pages 0..3 on host pages 0..3
    ios, pools = [], []
    for rank in range(2):
        pool = HostKVPool(spec, 8, "page_first", CPU, num_owners=2, owned_by=rank)
        for j in range(pool.num_local_pages):
            pool.kv[j] = float(2 * j + rank)  # a page's values: its logical host page
        io = StorageIO(backend, StorageLayout("s", share=PageShare(rank, 2)).codec(pool))
        io.write(io.codec.keys(hashes), [0, 1, 2, 3], None)
        io.wait_stored()
        assert [s.local_pages for s in io.pop_stored()] == [4]
        ios.append(io)
        pools.append(pool)
    stored = sorted(objects(tmp_path))
    assert stored == sorted(f"{h.hex()}_s" for h in hashes)  # each page once, by its owner

    def hit(first_page: int, pages: range) -> list[int]:
        keys = ios[0].codec.keys([hashes[q] for q in pages])
        return [io.query(keys, None, first_page).future.result() for io in ios]

    assert hit(0, range(4)) == [4, 4]
    (tmp_path / f"{hashes[3].hex()[:2]}" / f"{hashes[3].hex()}_s").unlink()  # rank 1's page
    assert hit(0, range(4)) == [4, 3]  # rank 0 holds all of its own; rank 1 misses page 3
    assert hit(1, range(1, 4)) == [3, 2]  # from path page 1: page 3 is position 2

    for rank, (io, pool) in enumerate(zip(ios, pools, strict=True)):
        pool.kv.zero_()
        keys = io.codec.keys(hashes[:3])
        (ack,) = io.read(ReadOp(keys, [4, 5, 6], batch_pages=4), None)  # other host pages
        assert ack.future.result() == 3
        local = [h // 2 for h in (4, 5, 6) if h % 2 == rank]
        assert [float(pool.kv[j].max()) for j in local] == [float(q) for q in (0, 1, 2)[rank::2]]
        io.close()
    backend.close()
