"""The unified key scheme (issue 10): stored KV independent of the writer's TP/PP layout.

The article's example on `tiny-tp` (8 layers, 8 KV heads): a TP4/PP2 engine writes through
to a `file` store with head partition 2 and layer partition 4, so every page is 8 objects
(2 layer ranges x 4 head groups) and each of the 8 ranks writes exactly one of them; a
TP2/PP1 engine (4 objects per rank per page) and a TP1 engine (all 8) then serve the same
prompts from those objects, with the cold run's tokens (float64). A store written in another
namespace (dtype, page size, grid) never hits, and a grid that does not fit a rank's shard
is a clear error naming the flag to change.
"""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path

import pytest
from multirank import run_world

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.storage.layout import StorageNamespace, shard_cells

pytestmark = pytest.mark.timeout(400)

PAGE = 4
GREEDY = SamplingParams(max_new_tokens=3, ignore_eos=True)
KEY = re.compile(r"^[0-9a-f]{32}_[0-9a-f]{16}_L(\d+)-(\d+)_H(\d+)$")


def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(256) for _ in range(rng.randint(30, 45))] for _ in range(3)]


def config(directory: Path, tp: int, pp: int, **cache: object) -> EngineConfig:
    kw: dict[str, object] = dict(
        page_size=PAGE,
        num_device_pages=96,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(directory),
        hicache_storage_prefetch_policy="wait_complete",
        hicache_storage_key_scheme="unified",
        storage_layer_partition=4,
        storage_head_partition=2,
    )
    kw.update(cache)
    return EngineConfig(
        model="tiny-tp",
        cache=CacheConfig(**kw),  # type: ignore[arg-type]
        parallel=ParallelConfig(tp, pp),
    )


def serve(engine: Engine, reqs: list[list[int]]) -> dict[str, object]:
    outs = engine.run([engine.submit(p, GREEDY) for p in reqs])
    engine.drain()  # write-through to the store done
    return {"outputs": [o.output_ids for o in outs], "storage": [o.cached.storage for o in outs]}


def cold(reqs: list[list[int]]) -> list[list[int]]:
    eng = Engine(EngineConfig(model="tiny-tp", cache=CacheConfig(page_size=PAGE)))
    out = [eng.generate(p, GREEDY).output_ids for p in reqs]
    eng.close()
    return out


def test_a_tp4_pp2_writer_and_a_tp2_reader_share_the_objects(tmp_path: Path) -> None:
    reqs = prompts()
    want = cold(reqs)
    wrote = run_world(config(tmp_path, 4, 2), serve, reqs)
    assert wrote["outputs"] == want
    objects = [p.name for p in tmp_path.glob("*/*") if p.is_file()]
    cells = {tuple(int(x) for x in KEY.match(name).groups()) for name in objects}  # type: ignore[union-attr]
    assert cells == {(a, a + 3, g) for a in (0, 4) for g in range(4)}  # 2 ranges x 4 groups
    pages = {name[:32] for name in objects}
    assert len(objects) == 8 * len(pages)  # every page: exactly its 8 objects
    kv_pages = sum((len(p) + GREEDY.max_new_tokens - 1) // PAGE for p in reqs)
    assert len(pages) == kv_pages

    read = run_world(config(tmp_path, 2, 1), serve, reqs)  # TP2/PP1: 4 objects per rank
    assert read["outputs"] == want
    assert read["storage"] == [(len(p) - 1) // PAGE * PAGE for p in reqs]

    eng = Engine(config(tmp_path, 1, 1))  # TP1: all 8 objects of a page
    got = serve(eng, reqs)
    eng.close()
    assert got == read


def test_another_namespace_never_hits(tmp_path: Path) -> None:
    reqs = prompts()[:1]
    eng = Engine(config(tmp_path, 1, 1))
    serve(eng, reqs)
    eng.close()
    for cfg in (
        dataclasses.replace(config(tmp_path, 1, 1), dtype="float32"),
        config(tmp_path, 1, 1, page_size=8, num_device_pages=48),
        config(tmp_path, 1, 1, storage_head_partition=4),  # another grid
        config(tmp_path, 1, 1, storage_layer_partition=8),
    ):
        eng = Engine(cfg)
        assert serve(eng, reqs)["storage"] == [0], cfg.cache
        eng.close()
    eng = Engine(config(tmp_path, 1, 1))
    assert serve(eng, reqs)["storage"] == [(len(reqs[0]) - 1) // PAGE * PAGE]
    eng.close()


def test_a_grid_that_does_not_fit_is_a_clear_error(tmp_path: Path) -> None:
    ns = StorageNamespace("tiny-tp", "float64", PAGE, "mha_sharded", 8, 8, 8, 4, 2)
    assert len(shard_cells(ns, (4, 8), (2, 4), 1).cells) == 1  # TP4/PP2 rank 5
    with pytest.raises(ValueError, match="--hicache-storage-layer-partition"):
        shard_cells(ns, (0, 6), (0, 8), 0)  # a stage of 6 layers
    with pytest.raises(ValueError, match="--hicache-storage-head-partition"):
        shard_cells(ns, (0, 8), (0, 1), 0)  # TP8: one head per rank, groups of 2
    with pytest.raises(ValueError, match="--hicache-storage-layer-partition 3"):
        Engine(config(tmp_path, 1, 1, storage_layer_partition=3))
    with pytest.raises(ValueError, match="--hicache-storage-head-partition 3"):
        Engine(config(tmp_path, 1, 1, storage_head_partition=3))
    assert ns.digest != dataclasses.replace(ns, kv_dtype="float32").digest
    assert ns.digest == StorageNamespace(**dataclasses.asdict(ns)).digest
