"""The parallel layout's arithmetic: ranks, stages, layer split, shards, devices, flags."""

from __future__ import annotations

import argparse
import pickle

import pytest
import torch

from gpu_worker.cache.hicache import HOST_LAYOUTS, LOAD_POLICIES, WRITE_POLICIES
from gpu_worker.cache.storage_tier import PREFETCH_POLICIES
from gpu_worker.cache.storage_writes import STORAGE_WRITE_POLICIES
from gpu_worker.engine import rank as rank_module
from gpu_worker.engine.engine import EngineConfig
from gpu_worker.engine.rank import RankSpec
from gpu_worker.model.config import PRESETS
from gpu_worker.model.shard import ModelShard
from gpu_worker.parallel.config import ParallelConfig, stage_layers
from gpu_worker.parallel.groups import ParallelGroups, rank_device
from gpu_worker.storage import BACKENDS
from gpu_worker.storage.layout import KEY_SCHEMES, ShardNames, shard_names
from services.engine import flags
from services.engine.config import engine_config_from_args


def test_ranks_are_stage_major() -> None:
    p = ParallelConfig(tp_size=2, pp_size=3)
    assert p.world_size == 6
    coords = [p.coords(r) for r in range(6)]
    assert [(c.pp, c.tp) for c in coords] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert [c.cp for c in coords] == [0] * 6
    assert p.stage_ranks(1) == [2, 3] and p.rank_of(2, 1) == 5
    assert p.cp_ranks(1, 1) == [3]  # CP 1: a CP group is one rank
    with pytest.raises(ValueError, match="outside"):
        p.coords(6)
    with pytest.raises(ValueError, match="--tp-size must be a positive integer"):
        ParallelConfig(tp_size=0)


def test_context_parallel_ranks_sit_between_stage_and_tp() -> None:
    """CP is accepted (issue 22); its ranks are numbered as the module says, and KV
    sharding needs CP ranks to shard over (tests/test_cp_engine.py runs the engines)."""
    assert ParallelConfig(2, 3, cp_size=1) == ParallelConfig(2, 3)
    p = ParallelConfig(tp_size=2, pp_size=2, cp_size=2)
    assert p.world_size == 8 and p.describe() == "TP2/PP2/CP2"
    coords = [p.coords(r) for r in range(8)]
    assert [(c.pp, c.cp, c.tp) for c in coords[:4]] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert p.stage_world(1) == [4, 5, 6, 7] and p.cp_ranks(1, 1) == [5, 7]
    assert ParallelConfig(2, 3).stage_world(2) == ParallelConfig(2, 3).stage_ranks(2)
    assert ParallelConfig(cp_size=4, kv_sharding=True).describe() == "TP1/PP1/CP4 sharded"
    with pytest.raises(ValueError, match="--cp-size must be a positive integer"):
        ParallelConfig(cp_size=0)
    with pytest.raises(ValueError, match=r"--enable-kv-cache-sharding .* needs --cp-size 2"):
        ParallelConfig(kv_sharding=True)


def test_rank_suffix_names_are_the_stored_ones_at_cp_1() -> None:
    """Objects stored before CP existed stay readable: the names at CP 1 are unchanged."""
    p = ParallelConfig(tp_size=2, pp_size=2)
    names = [shard_names(p, r, replicated=False) for r in range(4)]
    assert [n.shard for n in names] == [
        "tp0of2pp0of2",
        "tp1of2pp0of2",
        "tp0of2pp1of2",
        "tp1of2pp1of2",
    ]
    assert {n.layout for n in names} == {"tp2pp2"}
    mla = [shard_names(p, r, replicated=True).shard for r in range(4)]
    assert mla == ["tp0of2pp0of2", "tp0of2pp0of2", "tp0of2pp1of2", "tp0of2pp1of2"]
    assert shard_names(ParallelConfig(), 0, replicated=False) == ShardNames(
        "tp0of1pp0of1", "tp1pp1"
    )


def test_layers_split_evenly_the_last_stage_never_longer() -> None:
    assert [list(stage_layers(8, 2, s)) for s in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [len(stage_layers(10, 4, s)) for s in range(4)] == [3, 3, 2, 2]
    assert [stage_layers(30, 4, s).start for s in range(4)] == [0, 8, 16, 23]
    with pytest.raises(ValueError, match="--pp-size 5 needs at least 5 layers"):
        stage_layers(4, 5, 0)


def test_shards_hold_their_heads_and_layers() -> None:
    tiny_tp = PRESETS["tiny-tp"]
    shard = ModelShard.of(tiny_tp, ParallelConfig(4, 2), rank=7)  # PP1/TP3
    local = shard.local_config(tiny_tp)
    assert (shard.layers, shard.tp_rank, shard.last_stage) == (range(4, 8), 3, True)
    assert (local.num_heads, local.num_kv_heads, local.num_layers) == (2, 2, 4)
    assert local.intermediate_size == 32 and local.head_dim == tiny_tp.head_dim
    with pytest.raises(ValueError, match=r"--tp-size 4 does not divide the model's 2 KV heads"):
        ModelShard.of(PRESETS["tiny"], ParallelConfig(4, 1), 0)


def test_cuda_ranks_take_one_gpu_each() -> None:
    assert rank_device("cpu", 3) == torch.device("cpu")
    assert rank_device("cuda", 2) == torch.device("cuda", 2)
    assert rank_device("cuda:4", 1) == torch.device("cuda", 5)


def test_a_rank_on_another_host_takes_its_hosts_gpus_from_0(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over `--nnodes` hosts a rank's GPU is its index among its host's ranks, not its world
    rank: node 1 of a 4-rank world over 2 hosts runs ranks 2 and 3 on cuda:0 and cuda:1."""
    specs: list[RankSpec] = []

    class Popen:
        def __init__(self, argv: list[str], stdin: object) -> None:
            self.stdin = self

        def write(self, data: bytes) -> None:
            specs.append(pickle.loads(data))

        def close(self) -> None:
            pass

    monkeypatch.setattr(rank_module.subprocess, "Popen", Popen)
    config = EngineConfig(model="tiny", parallel=ParallelConfig(tp_size=4))
    rank_module._spawn(config, range(3, 4), "10.0.0.1", 29500, 5.0, report=True)  # node 1
    rank_module._spawn(config, range(1, 2), "10.0.0.1", 29500, 5.0, report=False)  # node 0
    assert [(s.rank, s.device_index) for s in specs] == [(3, 1), (1, 1)]
    groups = ParallelGroups(ParallelConfig(tp_size=4), 3, device_index=1)
    assert rank_device("cuda", groups.local_index) == torch.device("cuda", 1)
    assert ParallelGroups(ParallelConfig(tp_size=4), 1).local_index == 1  # one host


def test_torch_free_flags_match_the_engine() -> None:
    """services/engine/flags.py repeats gpu_worker's choice lists; they must agree."""
    assert flags.WRITE_POLICIES == WRITE_POLICIES
    assert flags.HOST_LAYOUTS == HOST_LAYOUTS
    assert flags.LOAD_POLICIES == LOAD_POLICIES
    assert flags.PREFETCH_POLICIES == PREFETCH_POLICIES
    assert flags.STORAGE_WRITE_POLICIES == STORAGE_WRITE_POLICIES
    assert tuple(sorted(BACKENDS)) == flags.STORAGE_BACKENDS
    assert flags.KEY_SCHEMES == KEY_SCHEMES
    parser = argparse.ArgumentParser()
    flags.add_engine_args(parser)
    argv = ["--tp-size", "2", "--pp-size", "2", "--debug-rank-raise", "1:7"]
    args = parser.parse_args([*argv, "--debug-transfer-delay-ms", "3"])
    config = engine_config_from_args(args)
    assert (config.parallel.tp_size, config.parallel.pp_size) == (2, 2)
    assert config.debug.rank_raise == (1, 7)
    assert config.cache.transfer_delay is not None and config.cache.transfer_delay.max_ms == 3
    assert flags.engine_argv(args)[:4] == ["--tp-size", "2", "--pp-size", "2"]
    with pytest.raises(ValueError, match="RANK:TOKEN"):
        engine_config_from_args(parser.parse_args(["--debug-rank-raise", "one"]))
    storage = ["--enable-hierarchical-cache", "--hicache-storage-backend", "file"]
    storage += ["--hicache-storage-dir", "/tmp/x", "--hicache-storage-size", "2.5"]
    storage += ["--hicache-storage-prefetch-policy", "wait_complete"]
    storage += [
        "--hicache-storage-prefetch-timeout-base",
        "1",
        "--debug-storage-read-delay-ms",
        "4",
    ]
    storage += ["--hicache-storage-key-scheme", "unified", "--hicache-storage-head-partition"]
    storage += ["2", "--hicache-storage-layer-partition", "4"]
    cache = engine_config_from_args(parser.parse_args(storage)).cache
    assert (cache.hicache_storage_backend, cache.hicache_storage_dir) == ("file", "/tmp/x")
    assert cache.hicache_storage_size_gb == 2.5 and cache.prefetch_timeout.base_s == 1.0
    assert cache.hicache_storage_prefetch_policy == "wait_complete"
    assert cache.storage_faults is not None and cache.storage_faults.read_delay_ms == 4.0
    assert cache.hicache_storage_key_scheme == "unified"
    assert (cache.storage_layer_partition, cache.storage_head_partition) == (4, 2)
    with pytest.raises(ValueError, match="enable-hierarchical-cache"):
        engine_config_from_args(parser.parse_args(storage[1:]))


def test_the_launcher_cli_and_bench_import_no_torch() -> None:
    """They parse and pass on engine flags: loading torch for that took seconds."""
    import subprocess
    import sys

    modules = "services.launch.up, services.engine.flags, services.cli, services.bench.cli"
    code = f"import sys, {modules}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
