"""The environment variables gpu_worker reads, in one typed place (prefix `HICACHE_`).

- `HICACHE_RANK_CONSENSUS`: 1 turns the rank consensus checker on (read when modules are
  imported: the decorators are the plain functions otherwise).
- `HICACHE_RANK_CONSENSUS_DIR`: where each rank writes its consensus log (`rank{N}.jsonl`).
- `HICACHE_CACHE_DIR`: where de-quantized model weights are cached (default:
  `$XDG_CACHE_HOME/hicache-mesh`, else `~/.cache/hicache-mesh`).
- `HICACHE_STORAGE_DIR`: the default directory of the `file` storage backend (L3) when
  `--hicache-storage-dir` is not given (default: `storage` under the cache directory's
  parent default, `$XDG_CACHE_HOME/hicache-mesh/storage` or `~/.cache/hicache-mesh/storage`).
"""

from __future__ import annotations

import os
from pathlib import Path

RANK_CONSENSUS = "HICACHE_RANK_CONSENSUS"
RANK_CONSENSUS_DIR = "HICACHE_RANK_CONSENSUS_DIR"
CACHE_DIR = "HICACHE_CACHE_DIR"
STORAGE_DIR = "HICACHE_STORAGE_DIR"


def rank_consensus_enabled() -> bool:
    return os.environ.get(RANK_CONSENSUS, "") not in ("", "0")


def rank_consensus_dir() -> Path | None:
    value = os.environ.get(RANK_CONSENSUS_DIR)
    return Path(value) if value else None


def cache_dir() -> Path:
    value = os.environ.get(CACHE_DIR)
    if value:
        return Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hicache-mesh"


def storage_dir() -> Path:
    value = os.environ.get(STORAGE_DIR)
    if value:
        return Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hicache-mesh" / "storage"
