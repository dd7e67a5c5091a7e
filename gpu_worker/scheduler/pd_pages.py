"""P/D: the pages of a request this rank's device pool holds, where the KV pack and write go.

A replicated pool (`DeviceKVPool`, every rank of a CP1 or replicated CP engine) holds every
page at its page id. A CP-sharded pool (`ShardedDeviceKVPool`) holds only the pages of its
CP rank (page `q` on CP rank `q % N`, at local page `q // N`, `parallel/cp_layout.py`): a
sharded prefill rank packs, and a sharded decode rank writes, only those, and the engine's
other CP ranks handle the rest. Both sides go through the relayout kernel between the
unified staging order and the pool (`RunView`), as a replicated pool does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpu_worker.kernels.relayout import RunView
from gpu_worker.memory.pool_group import PoolGroup
from gpu_worker.memory.sharded_pool import ShardedDeviceKVPool


@dataclass(frozen=True, slots=True)
class RankPages:
    """Which of some logical pages this rank holds, and where."""

    view: RunView  # the device pool as runs of one KV head (the unified staging's grouping)
    positions: list[int]  # indices into the logical pages asked about: those it holds, in order
    rows: list[int]  # their pages in `view`


def rank_pages(pools: PoolGroup, page_ids: Sequence[int]) -> RankPages:
    """The pages of `page_ids` this rank's device pool holds: all of them, or under CP
    sharding those its CP rank owns, at their local pages."""
    pool = pools.device
    if not isinstance(pool, ShardedDeviceKVPool):
        return RankPages(pool.run_view(1), list(range(len(page_ids))), list(page_ids))
    layout = pool.layout
    positions = [i for i, q in enumerate(page_ids) if layout.owner_of_page(q) == pool.cp_rank]
    rows = [layout.local_page(page_ids[i]) for i in positions]
    return RankPages(RunView.pool(pool.kv, pool.spec.page_size, 1), positions, rows)
