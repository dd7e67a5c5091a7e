"""The index service: keeps Redis current from the engines' KV events and heartbeats.

`service.IndexService` runs it (`cli` is its command line), `lanes` orders each engine's
work, `records` applies batches and heartbeats after `fencing` decided which to apply,
`maintenance` expires engines and resyncs after Redis comes back, `store` writes Redis in
the layout of `bus_schemas.redis_keys`. Never imports torch, triton or gpu_worker.
"""

from services.index.cli import build_parser, run
from services.index.service import IndexConfig, IndexService, IndexStats

__all__ = ["IndexConfig", "IndexService", "IndexStats", "build_parser", "run"]
