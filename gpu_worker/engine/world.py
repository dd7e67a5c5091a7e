"""The torch.distributed world of one engine: init, and rank 0's broadcast of new work."""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist


def init_single_rank_world(timeout_s: float = 60.0) -> None:
    """Make this process a world of size 1 (gloo), unless a world already exists.

    An in-process engine is still one `torch.distributed` world, so the code path that
    broadcasts work from rank 0 is the same one multi-rank engines run.
    """
    if dist.is_initialized():
        return
    dist.init_process_group(
        "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def broadcast_work(items: list[Any]) -> list[Any]:
    """Rank 0's list of new work items, delivered to every rank in the same order."""
    if dist.get_world_size() == 1:
        return items
    box: list[Any] = [items if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return list(box[0])
