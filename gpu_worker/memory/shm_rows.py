"""A CP rank's KV rows in shared memory, and its peers' rows mapped read-only.

The CPU analogue of GPU peer-to-peer reads (NVLink, CUDA IPC): when every CP rank of a
group is a process on one host (`engine/rank.py` spawns them as children of the engine),
each rank allocates its sharded pool's rows (`ShardedDeviceKVPool.kv`) in a file under
`/dev/shm`, the ranks exchange the file names once over the CP group
(`all_gather_object`), and each maps its peers' files read-only. A layer's gather then
packs every owner's pages straight from that owner's rows (`sharded_pool.py`, transport
`shm`): no collective per layer.

No file outlives the exchange: once every rank reported that it mapped every peer's file (a
second `all_gather_object`), each rank unlinks every file (the first to get there does), so
none is left when any rank's pool exists; on any failure before that (a peer on another
host, a mapping refused) each rank unlinks its own in a `finally`. The memory itself goes when
the last process mapping it exits, so a rank that is killed, or an engine that closes,
leaves nothing under `/dev/shm`. The one window is between a rank creating its file and
the exchange: a rank killed exactly there leaves its file (named `hicache-kv-*`).
"""

from __future__ import annotations

import contextlib
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
    """`rows[r]`: CP rank r's pool rows, this rank's own writable, its peers' read-only
    (a write to a peer's rows faults: the mapping is PROT_READ)."""

    rows: list[torch.Tensor]
    maps: list[mmap.mmap] = field(default_factory=list)  # the peers' mappings, kept open


def share_rows(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    cp_rank: int,
    cp_size: int,
    group: dist.ProcessGroup,
    required: bool,
) -> SharedRows | None:
    """Allocate this rank's `shape` rows in shared memory and map every peer's; zeroed.

    A collective over `group` (every CP rank calls it at the same point). None when the
    ranks are not all on this host and `required` is False (the caller gathers with a
    collective instead); ValueError when `required`.
    """
    nbytes = max(1, torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
    path = os.path.join(SHM_DIR, f"{PREFIX}{uuid.uuid4().hex}-r{cp_rank}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        own = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        names: list[tuple[str, str] | None] = [None] * cp_size
        dist.all_gather_object(names, (host_id(), path), group=group)
        hosts = {name[0] for name in names if name is not None}
        if len(hosts) != 1:
            if required:
                raise ValueError(
                    f"--cp-gather-transport shm needs every CP rank on one host; they run on "
                    f"{sorted(hosts)}"
                )
            return None
        maps: list[mmap.mmap] = []
        rows: list[torch.Tensor] = []
        error = None
        try:
            for r, name in enumerate(names):
                assert name is not None
                if r == cp_rank:
                    rows.append(own)
                    continue
                with open(name[1], "rb") as f:
                    mapped = mmap.mmap(f.fileno(), nbytes, prot=mmap.PROT_READ)
                maps.append(mapped)
                with warnings.catch_warnings():  # read-only on purpose: torch warns of it
                    warnings.simplefilter("ignore", UserWarning)
                    rows.append(torch.frombuffer(mapped, dtype=torch.uint8))
        except OSError as e:
            error = f"rank {cp_rank}: {e!r}"
        errors: list[str | None] = [None] * cp_size
        dist.all_gather_object(errors, error, group=group)  # every peer mapped every file
        for name in names:  # every rank mapped every file: whichever unlinks first
            assert name is not None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name[1])
        failed = [e for e in errors if e is not None]
        if failed:
            raise RuntimeError(f"CP ranks could not map each other's KV rows: {failed}")
        views = [t.view(dtype).view(shape) for t in rows]
        return SharedRows(views, maps)
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
