"""Storage (L3): the backend interface, its config and registry, and the `file` backend.

Importing this package imports every backend module, and each registers itself in
`BACKENDS` (`base.register_backend`): whatever part of the package a caller imports, the
registry is full before `StorageConfig` checks a backend name.
"""

from gpu_worker.storage.base import (
    BACKENDS,
    QUARANTINE_REASONS,
    WRITE_FAILURES,
    QuarantineReason,
    StorageBackend,
    StorageConfig,
    StorageStats,
    WriteFailure,
    check_keys,
    default_storage_dir,
    is_valid_key,
    make_backend,
)
from gpu_worker.storage.file import FileBackend

__all__ = [
    "BACKENDS",
    "QUARANTINE_REASONS",
    "WRITE_FAILURES",
    "FileBackend",
    "QuarantineReason",
    "StorageBackend",
    "StorageConfig",
    "StorageStats",
    "WriteFailure",
    "check_keys",
    "default_storage_dir",
    "is_valid_key",
    "make_backend",
]
