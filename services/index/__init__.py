"""The index service: keeps Redis current from the engines' KV events and heartbeats.

`service.IndexService` runs it, `fencing` decides which batches to apply, `store` writes
Redis in the layout of `bus_schemas.redis_keys`. Never imports torch, triton or gpu_worker.
"""

from services.index.service import IndexConfig, IndexService, IndexStats, build_parser, run

__all__ = ["IndexConfig", "IndexService", "IndexStats", "build_parser", "run"]
