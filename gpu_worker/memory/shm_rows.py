"""The KV rows of a host's CP ranks in one shared-memory file: each rank's own writable,
every rank's mapped read-only.

The CPU analogue of GPU peer-to-peer reads (NVLink, CUDA IPC): when every CP rank of a
group is a process on one host (`engine/rank.py` spawns them as children of the engine),
CP rank 0 creates one file under `/dev/shm` holding every rank's sharded pool rows
(`ShardedDeviceKVPool.kv`), one region per rank, and sends its name to its peers once over
the CP group (`all_gather_object`). Each rank maps its own region writable and the whole
file read-only. Attention then reads a layer's K/V of any logical slots straight from their
owners' rows (`sharded_pool.py`, transport `shm`): one `index_select` over every rank's
rows (`SharedRows.flat`), the same one copy a replicated pool's read makes, with no
collective and no packing per layer.

Why one file: the read is one gather only when every owner's rows are rows of one tensor.
Each region is padded to a whole number of both mmap pages and KV rows (`region_rows`), so
the file is a (cp_size * region_rows, num_kv_heads, head_dim) array whose row
`r * region_rows + i` is row `i` of rank r's pool (its rows flattened, layers first).

No file outlives the exchange: once every rank reported that it mapped the file (a second
`all_gather_object`), each rank unlinks it (the first to get there does), so none is left
when any rank's pool exists; on any failure before that (a peer on another host, a mapping
refused) rank 0 unlinks it in a `finally`. The memory goes when the last process mapping it
exits, so a rank that is killed, or an engine that closes, leaves nothing under `/dev/shm`.
The one window is between rank 0 creating the file and the exchange: rank 0 killed exactly
there leaves the file (named `hicache-kv-*`).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import socket
import uuid
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"
PREFIX = "hicache-kv-"  # every file this module creates starts so (tests look for leaks)


def host_id() -> str:
    """What makes two processes share `/dev/shm`: the host name and the kernel's boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass(eq=False)
class SharedRows:
    """`rows[r]`: CP rank r's pool rows, this rank's own writable, its peers' read-only (a
    write to a peer's rows faults: the mapping is PROT_READ). `flat`: every rank's rows as
    one read-only (cp_size * region_rows, num_kv_heads, head_dim) tensor, rank r's row `i`
    (of its rows flattened over their leading dimensions) at `r * region_rows + i`."""

    rows: list[torch.Tensor]
    flat: torch.Tensor
    region_rows: int
    maps: list[mmap.mmap] = field(default_factory=list)  # the mappings, kept open


def share_rows(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    cp_rank: int,
    cp_size: int,
    group: dist.ProcessGroup,
    required: bool,
) -> SharedRows | None:
    """Map every CP rank's `shape` rows (`(..., num_kv_heads, head_dim)`) from one shared
    file, zeroed; this rank's writable.

    A collective over `group` (every CP rank calls it at the same point). None when the
    ranks are not all on this host and `required` is False (the caller gathers with a
    collective instead); ValueError when `required`.
    """
    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = max(1, torch.Size(shape).numel()) * itemsize
    row_bytes = shape[-2] * shape[-1] * itemsize
    unit = math.lcm(mmap.ALLOCATIONGRANULARITY, row_bytes)
    region = -(-nbytes // unit) * unit  # a region's bytes: whole mmap pages and whole rows
    path = None
    if cp_rank == 0:
        path = os.path.join(SHM_DIR, f"{PREFIX}{uuid.uuid4().hex}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, cp_size * region)
        finally:
            os.close(fd)
    try:
        names: list[tuple[str, str | None] | None] = [None] * cp_size
        dist.all_gather_object(names, (host_id(), path), group=group)
        hosts = {name[0] for name in names if name is not None}
        if len(hosts) != 1:
            if required:
                raise ValueError(
                    f"--cp-gather-transport shm needs every CP rank on one host; they run on "
                    f"{sorted(hosts)}"
                )
            return None
        assert names[0] is not None and names[0][1] is not None
        shared = names[0][1]
        maps: list[mmap.mmap] = []
        error = None
        try:
            fd = os.open(shared, os.O_RDWR)
            try:
                maps.append(mmap.mmap(fd, cp_size * region, prot=mmap.PROT_READ))
                maps.append(mmap.mmap(fd, region, offset=cp_rank * region))
            finally:
                os.close(fd)
        except OSError as e:
            error = f"rank {cp_rank}: {e!r}"
        errors: list[str | None] = [None] * cp_size
        dist.all_gather_object(errors, error, group=group)  # every rank mapped the file
        with contextlib.suppress(FileNotFoundError):  # whichever rank gets here first
            os.unlink(shared)
        failed = [e for e in errors if e is not None]
        if failed:
            raise RuntimeError(f"CP ranks could not map their shared KV rows: {failed}")
        with warnings.catch_warnings():  # read-only on purpose: torch warns of it
            warnings.simplefilter("ignore", UserWarning)
            whole = torch.frombuffer(maps[0], dtype=torch.uint8).view(cp_size, region)
        own = torch.frombuffer(maps[1], dtype=torch.uint8)
        regions = [own if r == cp_rank else whole[r] for r in range(cp_size)]
        rows = [t[:nbytes].view(dtype).view(shape) for t in regions]
        flat = whole.view(-1).view(dtype).view(-1, shape[-2], shape[-1])
        return SharedRows(rows, flat, region // row_bytes, maps)
    finally:
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
