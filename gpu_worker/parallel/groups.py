"""The process groups of one engine's world, built once by the launcher.

`Engine` never creates a group: the launcher (`gpu_worker/engine/rank.py`) initialises the
world on every rank and passes the resulting `ParallelGroups` in. Every rank creates every
group, in the same order (torch.distributed requires it).

Groups:
- `world`: tensors between ranks (gloo on CPU, nccl on GPU): hidden states stage to stage.
- `cpu_world`: gloo over the whole world: control messages point to point (the step header
  of `pp_sync`, sampled tokens) and start-up agreement. The same group as `world` on CPU.
- `tp` / `tp_cpu`: this stage's TP group for tensors (the row-parallel all_reduce) and for
  control (rank 0's command list and the ready-ACK MIN); None at TP 1.
- `cp`: the ranks of this stage with this rank's TP index, which share a sequence's KV
  pages (context parallelism: the sharded pool's gathers); None at CP 1.
- `stage_cpu`: gloo over every rank of this stage (TP x CP): control that all of them must
  agree on (rank 0's command list, the ready-ACK MIN, the batch-shape guard). At CP 1 it
  is `tp_cpu` itself (no extra group); None when the stage is one rank.
- `consensus`: a dedicated gloo group over the world for the rank consensus checker's side
  thread, so its collectives never interleave with the scheduler's; None when it is off.
- `storage_hit` / `storage_progress` / `storage_write`: three gloo groups over the world for
  external storage's background threads: the MIN of the store's hit length before reading
  (the query thread), of the pages read while reading (the I/O thread), and of the pages
  every rank stored of a write (the put thread: only then does rank 0 advertise them), so
  none waits on another.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gpu_worker.parallel.config import ParallelConfig

DEFAULT_TIMEOUT_S = 120.0  # any collective that waits longer fails (a hang fails fast)


@dataclass(frozen=True, slots=True)
class ParallelGroups:
    config: ParallelConfig
    rank: int  # world rank
    world: dist.ProcessGroup | None = None
    cpu_world: dist.ProcessGroup | None = None
    tp: dist.ProcessGroup | None = None
    tp_cpu: dist.ProcessGroup | None = None
    cp: dist.ProcessGroup | None = None
    stage_cpu: dist.ProcessGroup | None = None
    consensus: dist.ProcessGroup | None = None
    storage_hit: dist.ProcessGroup | None = None
    storage_progress: dist.ProcessGroup | None = None
    storage_write: dist.ProcessGroup | None = None
    # this rank's index among its host's ranks (its GPU; `--nnodes`): None for the world rank
    device_index: int | None = None

    @property
    def local_index(self) -> int:
        """This rank's index among its host's ranks: the GPU it takes (`rank_device`)."""
        return self.rank if self.device_index is None else self.device_index

    @classmethod
    def single(cls) -> ParallelGroups:
        """A world of one rank: no process group at all, every collective a no-op."""
        return cls(ParallelConfig(), 0)

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def pp_rank(self) -> int:
        return self.config.coords(self.rank).pp

    @property
    def cp_rank(self) -> int:
        return self.config.coords(self.rank).cp

    @property
    def tp_rank(self) -> int:
        return self.config.coords(self.rank).tp

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.config.pp_size - 1

    @property
    def tp_src(self) -> int:
        """World rank of TP rank 0 in this stage (the source of its broadcasts)."""
        return self.config.rank_of(self.pp_rank, 0, self.cp_rank)

    def stage_peer(self, pp_rank: int) -> int:
        """The world rank with this rank's TP (and CP) index in stage `pp_rank`."""
        return self.config.rank_of(pp_rank, self.tp_rank, self.cp_rank)

    def describe(self) -> str:
        cp = f"/CP{self.cp_rank}" if self.config.cp_size > 1 else ""
        return (
            f"rank {self.rank} (PP{self.pp_rank}{cp}/TP{self.tp_rank} of {self.config.describe()})"
        )


def rank_device(device: str, rank: int) -> torch.device:
    """The device of world rank `rank` for an engine on `device`: CUDA ranks take one GPU
    each, counting from the given index (`cuda` or `cuda:0`: rank r on `cuda:r`); CPU ranks
    all run on the CPU."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def init_parallel_groups(
    config: ParallelConfig,
    rank: int,
    store: dist.Store,
    device: torch.device,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    consensus: bool = False,
    storage: bool = False,
    device_index: int | None = None,
) -> ParallelGroups:
    """Join the world as `rank` through `store` and build every group.

    On CPU everything is gloo; on CUDA tensors go over nccl and control over gloo groups.
    `consensus` must be the same on every rank (it comes from the environment they share);
    `storage` (external storage is on: the same config on every rank) adds its three groups.
    `device_index`: the rank's index among its host's ranks, where a world spans hosts.
    """
    if config.world_size == 1:
        return ParallelGroups.single()
    timeout = datetime.timedelta(seconds=timeout_s)
    cuda = device.type == "cuda"
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=store,
        rank=rank,
        world_size=config.world_size,
        timeout=timeout,
    )
    world = dist.group.WORLD
    cpu_world = dist.new_group(backend="gloo", timeout=timeout) if cuda else world
    tp, tp_cpu = _tp_groups(config, rank, timeout, cuda)
    cp = _cp_group(config, rank, timeout)
    stage_cpu = tp_cpu if config.cp_size == 1 else _stage_group(config, rank, timeout)
    consensus_group = dist.new_group(backend="gloo", timeout=timeout) if consensus else None
    storage_hit = dist.new_group(backend="gloo", timeout=timeout) if storage else None
    storage_progress = dist.new_group(backend="gloo", timeout=timeout) if storage else None
    storage_write = dist.new_group(backend="gloo", timeout=timeout) if storage else None
    return ParallelGroups(
        config,
        rank,
        world,
        cpu_world,
        tp,
        tp_cpu,
        cp,
        stage_cpu,
        consensus_group,
        storage_hit,
        storage_progress,
        storage_write,
        device_index=device_index,
    )


def _tp_groups(
    config: ParallelConfig, rank: int, timeout: datetime.timedelta, cuda: bool
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's TP group for tensors and for control (the same on CPU); None at TP 1.
    Every rank creates every TP group, stage by stage."""
    if config.tp_size == 1:
        return None, None
    own = config.coords(rank)
    tp = tp_cpu = None
    for stage in range(config.pp_size):
        for cp_rank in range(config.cp_size):
            ranks = config.stage_ranks(stage, cp_rank)
            group = dist.new_group(ranks, timeout=timeout)
            cpu_group = dist.new_group(ranks, backend="gloo", timeout=timeout) if cuda else group
            if (stage, cp_rank) == (own.pp, own.cp):
                tp, tp_cpu = group, cpu_group
    return tp, tp_cpu


def _cp_group(
    config: ParallelConfig, rank: int, timeout: datetime.timedelta
) -> dist.ProcessGroup | None:
    """This rank's CP group; None at CP 1. Every rank creates every CP group."""
    if config.cp_size == 1:
        return None
    own = config.coords(rank)
    cp = None
    for stage in range(config.pp_size):
        for tp_rank in range(config.tp_size):
            group = dist.new_group(config.cp_ranks(stage, tp_rank), timeout=timeout)
            if (stage, tp_rank) == (own.pp, own.tp):
                cp = group
    return cp


def _stage_group(
    config: ParallelConfig, rank: int, timeout: datetime.timedelta
) -> dist.ProcessGroup:
    """A gloo group over this rank's stage (TP x CP ranks). Every rank creates every
    stage's group."""
    own = config.coords(rank).pp
    mine = None
    for stage in range(config.pp_size):
        group = dist.new_group(config.stage_world(stage), backend="gloo", timeout=timeout)
        if stage == own:
            mine = group
    assert mine is not None
    return mine


def destroy_parallel_groups(groups: ParallelGroups) -> None:
    """Leave the world (after the last collective of this rank)."""
    if groups.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
