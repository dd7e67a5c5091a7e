"""The shared-memory gather of CPU CP ranks (`--cp-gather-transport shm`, issue 22 6b).

Each rank maps its peers' KV rows read-only and packs their pages itself
(`memory/shm_rows.py`, `ShardedDeviceKVPool`'s transport `shm`). What is checked here, in
real gloo rank processes: a read of a peer's rows waits for the peer's earlier writes (a
late owner) and ends before the owner may reuse them (a slow reader); no file is left
under /dev/shm while a world runs, after an engine closes or after a rank is killed; the
flag reaches the pool and bad values are refused. The logits (the float64 oracle) are in
test_cp_engine.py, the pool's reads in test_cp_gather.py, loads in test_cp_host.py.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import signal
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from multirank import run_gloo_ranks, run_world

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.memory.sharded_pool import ShardedDeviceKVPool
from gpu_worker.memory.shm_rows import PREFIX, SHM_DIR
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.parallel.config import ParallelConfig
from services.engine import flags
from services.engine.config import engine_config_from_args

CPU = torch.device("cpu")
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=2, page_size=2, dtype=torch.float64)
LAG_S = 0.5  # how late the late rank is: far longer than a pack


def shm_files() -> list[str]:
    return sorted(f for f in os.listdir(SHM_DIR) if f.startswith(PREFIX))


@dataclass(frozen=True, slots=True)
class Batch:
    seq_lens: list[int]
    extend_lens: list[int]
    slot_ids: list[torch.Tensor]


def kv_of(layer: int, n: int) -> torch.Tensor:
    """(n, 2, heads, dim): K and V of `n` tokens of `layer`, the same on every rank."""
    return torch.arange(n * 8, dtype=torch.float64).view(n, 2, 2, 2) + 1000 * layer


def ordered_reads(rank: int, world: int, group: Any) -> None:
    """Pass 1 writes an 8-token prefix (rank 1 writes late); pass 2 reads it back. Rank 0
    must wait for rank 1's rows (its first read), and rank 1, which overwrites its rows as
    soon as its pass is over (as a load into a reused page would), must wait for rank 0,
    which is slow to reach its last layer."""
    pool = ShardedDeviceKVPool(SPEC, 8, CPU, rank, world, group, 1, poison=True, transport="shm")
    assert pool.transport == "shm" and shm_files() == []
    slots = pool.slot_ids([0, 1, 2, 3], 8)  # pages of both ranks
    if rank == 1:
        time.sleep(LAG_S)
    prefill = Batch([8], [8], [slots])  # cold: no prefix page, nothing read from a peer
    for layer in range(SPEC.num_layers):
        pool.before_attention(layer, prefill)
        kv = kv_of(layer, 8)
        pool.set_kv(layer, slots, kv[:, 0], kv[:, 1])
    pool.after_layers(prefill)
    read = Batch([8], [0], [slots])
    for layer in range(SPEC.num_layers):
        if rank == 0 and layer == 1:
            time.sleep(LAG_S)  # a slow attention of layer 0
        pool.before_attention(layer, read)
        k, v = pool.get_kv(layer, slots)
        want = kv_of(layer, 8)
        assert torch.equal(k, want[:, 0]) and torch.equal(v, want[:, 1]), (
            f"rank {rank} layer {layer}: read a peer's rows out of order"
        )
    pool.after_layers(read)
    if rank == 1:
        pool.kv.fill_(float("nan"))  # the owner reuses its rows as soon as its pass is over


def test_peer_reads_wait_for_the_owner_and_end_before_it_reuses_rows() -> None:
    run_gloo_ranks(ordered_reads, 2)


# ---------------------------------------------------------------- no /dev/shm leak


def _kill_rank(rank: int, world: int, port: int, out: Any) -> None:
    try:
        torch.set_num_threads(1)
        timeout = datetime.timedelta(seconds=60)
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        group = dist.new_group(list(range(world)), timeout=timeout)
        pool = ShardedDeviceKVPool(SPEC, 8, CPU, rank, world, group, transport="shm")
        slots = pool.slot_ids([0, 1, 2, 3], 8)
        for layer in range(SPEC.num_layers):
            pool.before_attention(layer, Batch([8], [4], [slots]))  # reads peers' rows
        out.put((rank, "running", shm_files()))  # a SimpleQueue: written before the kill
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-run, its rows still mapped by rank 0
        time.sleep(1.0)  # rank 0 lives on (holding its mapping of rank 1's rows) a while
        out.put((rank, "killed", shm_files()))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def test_no_shm_file_while_running_nor_after_a_rank_is_killed() -> None:
    assert shm_files() == [], "a file from an earlier run is left under /dev/shm"
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_kill_rank, args=(r, 2, port, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        if proc.is_alive():
            proc.kill()
            proc.join()
    reports = []
    while not out.empty():
        reports.append(out.get())
    assert procs[1].exitcode == -signal.SIGKILL, reports
    assert sorted(reports) == [(0, "killed", []), (0, "running", []), (1, "running", [])]
    assert shm_files() == []


def engine_shm(engine: Engine) -> tuple[str, list[str], list[int]]:
    """The pool's transport, the files under /dev/shm while the world runs, and a greedy
    generation that reads peers' rows (a prefix of several pages)."""
    pool = engine.cache.device_pool
    assert isinstance(pool, ShardedDeviceKVPool)
    # the gather budget is the all-gather's scratch: none to bound for shm
    assert (engine.scheduler.admission.gather is None) == (pool.transport == "shm")
    out = engine.generate(list(range(3, 40)), SamplingParams(max_new_tokens=4))
    return pool.transport, shm_files(), out.output_ids


def config(transport: str) -> EngineConfig:
    cache = CacheConfig(page_size=4, num_device_pages=64)
    parallel = ParallelConfig(cp_size=2, kv_sharding=True, cp_gather_transport=transport)
    return EngineConfig(model="tiny", cache=cache, parallel=parallel)


def test_engine_picks_shm_on_cpu_and_leaves_no_file_after_close() -> None:
    assert shm_files() == [], "a file from an earlier run is left under /dev/shm"
    transport, during, tokens = run_world(config("auto"), engine_shm)
    assert transport == "shm" and during == []
    assert shm_files() == []
    transport, during, want = run_world(config("collective"), engine_shm)
    assert transport == "collective" and tokens == want


# ---------------------------------------------------------------- flag and refusals


def test_the_flag_reaches_the_pool_config_and_bad_values_fail() -> None:
    parser = argparse.ArgumentParser()
    flags.add_engine_args(parser)
    argv = ["--cp-size", "2", "--enable-kv-cache-sharding", "--cp-gather-transport", "shm"]
    args = parser.parse_args(argv)
    assert engine_config_from_args(args).parallel.cp_gather_transport == "shm"
    assert flags.engine_argv(args) == argv
    assert ParallelConfig().cp_gather_transport == "auto"
    assert flags.CP_GATHER_TRANSPORTS == ("auto", "collective", "shm")
    with pytest.raises(ValueError, match="--cp-gather-transport must be one of"):
        ParallelConfig(cp_size=2, kv_sharding=True, cp_gather_transport="nvlink")
    with pytest.raises(ValueError, match="--cp-gather-transport must be one of"):
        ShardedDeviceKVPool(SPEC, 8, CPU, 0, 1, None, transport="nvlink")
    with pytest.raises(ValueError, match="shm maps CPU ranks' rows"):
        ShardedDeviceKVPool(SPEC, 8, torch.device("cuda"), 0, 1, None, transport="shm")
    # one rank has no peers: nothing to map, the pack alone
    assert ShardedDeviceKVPool(SPEC, 8, CPU, 0, 1, None, transport="shm").transport == "collective"
