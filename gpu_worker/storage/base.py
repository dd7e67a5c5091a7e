"""The storage (L3) backend interface, its config, and the registry that picks a backend.

A backend stores immutable objects under string keys that the caller builds (a page hash
plus a suffix naming the layer range and head group, see DESIGN.md section 5). Every call
is batched and answers with a count of LEADING keys: the engine only ever uses a prefix of
pages, so "the first n pages" is the one answer it needs, and a miss in the middle makes
everything after it useless.

Torch-free: callers pass bytes and writable memoryviews (e.g. `tensor.numpy()` views).
"""

from __future__ import annotations

import abc
import hashlib
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from gpu_worker import env

STORAGE_DIR_ENV = env.STORAGE_DIR  # see default_storage_dir

MAX_KEY_LEN = 200
_KEY_RE = re.compile(rf"[A-Za-z0-9_.\-]{{1,{MAX_KEY_LEN}}}")

QuarantineReason = Literal["corrupt", "truncated", "misnamed", "wrong_size", "unauthenticated"]
QUARANTINE_REASONS: tuple[QuarantineReason, ...] = (
    "corrupt",
    "truncated",
    "misnamed",
    "wrong_size",
    "unauthenticated",  # a well-formed object whose MAC is not this deployment's key's
)
WriteFailure = Literal["full", "read_only", "other"]
WRITE_FAILURES: tuple[WriteFailure, ...] = ("full", "read_only", "other")


def is_valid_key(key: object) -> bool:
    """True for a path-safe key: 1..200 of `[A-Za-z0-9_.-]`, not starting with ".".

    No "/", "..", NUL or other separators can pass, so a key is always one file name, and
    names starting with "." stay free for the backend's own files (temp files, quarantine).
    """
    return isinstance(key, str) and not key.startswith(".") and _KEY_RE.fullmatch(key) is not None


def check_keys(keys: Sequence[str]) -> None:
    """Raise ValueError naming the first invalid key. Backends call it before any I/O, so a
    batch with one bad key changes nothing."""
    for key in keys:
        if not is_valid_key(key):
            shown = repr(key) if len(repr(key)) <= 60 else repr(key)[:57] + "..."
            raise ValueError(
                f"invalid storage key {shown}: use 1..{MAX_KEY_LEN} characters of "
                "[A-Za-z0-9_.-], not starting with '.'"
            )


# The default cap (`capacity_bytes` None): this fraction of the size of the filesystem that
# holds the directory, and never more than half of what is free for the store at start-up
# (free space plus the store's own objects), so the default never fills a disk.
DEFAULT_CAPACITY_FRACTION = 0.1
DEFAULT_QUARANTINE_MAX_OBJECTS = 64
DEFAULT_QUARANTINE_MAX_BYTES = 256 << 20


def default_capacity_bytes(directory: Path | str, store_bytes: int | None) -> int:
    """The default cap for a store in `directory` that holds `store_bytes` already (see
    DEFAULT_CAPACITY_FRACTION), measured on the nearest existing ancestor; with
    `store_bytes` None (not known yet), the filesystem fraction alone."""
    path = os.path.abspath(directory)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    st = os.statvfs(path)
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    cap = int(size * DEFAULT_CAPACITY_FRACTION)
    if store_bytes is not None:
        cap = min(cap, (free + store_bytes) // 2)
    return max(1, cap)


def default_storage_dir() -> Path:
    """`$HICACHE_STORAGE_DIR` if set, else `$XDG_CACHE_HOME/hicache-mesh/storage`, else
    `~/.cache/hicache-mesh/storage` (read in `gpu_worker/env.py`)."""
    return env.storage_dir()


@dataclass(frozen=True, slots=True)
class StorageConfig:
    """Which backend, where, and how big. One per engine; every rank builds its backend
    from the same config."""

    backend: str = "file"  # a name in BACKENDS
    directory: Path = field(default_factory=default_storage_dir)
    # on-disk bytes (headers included) this process keeps; 0 = no cap; None = the default
    # (`default_capacity_bytes`, fixed once the start-up scan knows the store's size)
    capacity_bytes: int | None = None
    # the MAC key of the objects (a per-deployment secret); None = `DIR/.key`, made on first
    # use (32 random bytes, mode 0600), so restarts on the same directory keep their objects
    key_file: Path | None = None
    # `.quarantine/` keeps at most this many objects and bytes (the oldest go first)
    quarantine_max_objects: int = DEFAULT_QUARANTINE_MAX_OBJECTS
    quarantine_max_bytes: int = DEFAULT_QUARANTINE_MAX_BYTES
    # Test hooks (fault injection), never set in production:
    delay_s_per_get: float = 0.0  # sleep this long before reading each object (a slow store)
    fail_get_after: int | None = None  # after this many objects read, every read is a miss

    def __post_init__(self) -> None:
        check_backend_name(self.backend)
        if not isinstance(self.directory, Path):
            object.__setattr__(self, "directory", Path(self.directory))
        if self.key_file is not None and not isinstance(self.key_file, Path):
            object.__setattr__(self, "key_file", Path(self.key_file))
        cap = self.capacity_bytes
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int)):
            raise ValueError(f"capacity_bytes must be an int or None, got {cap!r}")
        if cap is not None and cap < 0:
            raise ValueError(f"capacity_bytes must be >= 0 (0 = no cap), got {cap}")
        if self.quarantine_max_objects < 0 or self.quarantine_max_bytes < 0:
            raise ValueError("quarantine_max_objects and quarantine_max_bytes must be >= 0")
        if self.delay_s_per_get < 0:
            raise ValueError(f"delay_s_per_get must be >= 0, got {self.delay_s_per_get}")
        if self.fail_get_after is not None and self.fail_get_after < 0:
            raise ValueError(f"fail_get_after must be None or >= 0, got {self.fail_get_after}")


@dataclass(frozen=True, slots=True)
class StorageStats:
    """A snapshot of one backend's counters, as this process knows them.

    Counters are cumulative since the backend was made (clear() does not reset them);
    num_objects and num_bytes describe what the backend believes is stored now.
    """

    num_objects: int  # objects this process knows are stored (its own view)
    num_bytes: int  # their on-disk size, headers included (what capacity_bytes caps)
    scanned: bool  # the start-up scan finished; before it, num_objects/num_bytes undercount
    num_reads: int  # objects `get` tried to read
    num_hits: int  # ... read and verified
    num_misses: int  # ... absent, vanished, failing verification, or refused by a test hook
    num_written: int  # objects this process wrote (an existing key left alone is not counted)
    num_evictions: int  # objects this process removed to respect capacity_bytes
    quarantined: Mapping[QuarantineReason, int]  # objects that failed verification, by reason
    write_failures: Mapping[WriteFailure, int]  # put calls that stopped early, by reason
    capacity_bytes: int = 0  # the cap in force (0: none)
    quarantine_objects: int = 0  # what `.quarantine/` holds now (bounded, oldest dropped)
    quarantine_bytes: int = 0
    quarantine_dropped: int = 0  # quarantined objects deleted to keep it within its bounds

    @property
    def num_quarantined(self) -> int:
        return sum(self.quarantined.values())

    @property
    def num_write_failures(self) -> int:
        return sum(self.write_failures.values())


class StorageBackend(abc.ABC):
    """Batched, write-once object storage shared by engines.

    Every method is thread-safe (the engine calls from background threads), and several
    processes may use one store at once: an object another process removes is a miss,
    never an error. Every method validates all its keys first (`check_keys`) and raises
    ValueError, touching nothing, when one is invalid. After `close`, methods raise
    RuntimeError.
    """

    def __init__(self, config: StorageConfig) -> None:
        self.config = config

    @property
    def store_id(self) -> str:
        """A short name of the store itself: engines whose ids are equal read each other's
        objects (the index keeps storage pages per store, the router credits them to the
        engines that announce it). The file backend's: its backend and resolved directory."""
        where = f"{self.config.backend}:{os.path.realpath(self.config.directory)}"
        return hashlib.blake2b(where.encode(), digest_size=8).hexdigest()

    @abc.abstractmethod
    def exists(self, keys: Sequence[str]) -> int:
        """How many LEADING keys are stored; stops at the first missing one.

        Cheap (no payload is read or verified), so a later `get` may still miss. May mark
        the found objects as recently used. Changes no object.
        """

    @abc.abstractmethod
    def get(self, keys: Sequence[str], out: Sequence[memoryview]) -> int:
        """Read object i into out[i]; return how many LEADING objects were read and verified.

        Before: len(out) == len(keys); each out[i] is a writable C-contiguous buffer of
        exactly the object's payload size (ValueError otherwise, before any read).
        The first object that is missing or fails verification stops the count; later ones
        are not read. An object that fails verification is removed from the store so it is
        never read again, and counted in `stats().quarantined`. The content of out[i] for
        i >= the returned count is undefined. Hits are marked recently used.
        """

    @abc.abstractmethod
    def put(self, keys: Sequence[str], data: Sequence[bytes | memoryview]) -> int:
        """Store object i as data[i]; return how many LEADING objects are now stored.

        Write-once: an existing key is left alone and counts as stored (keys name their
        content). A put never leaves a partial object visible, even with concurrent writers
        of the same key. It may evict least recently used objects to respect
        capacity_bytes. A full or read-only store, or any other OSError, never raises: the
        put stops at that object, returns the count so far, and counts the failure in
        `stats().write_failures` (logged at most once a minute per reason).
        Before: len(data) == len(keys); each data[i] is a C-contiguous buffer.
        """

    @abc.abstractmethod
    def stats(self) -> StorageStats:
        """A consistent snapshot of the counters; changes nothing."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Remove every object this backend can see, including other processes' objects in
        a shared store. Objects being written concurrently may survive."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop background work and release resources. Idempotent; later calls of other
        methods raise RuntimeError."""


# The registry: backend name -> factory. A backend's module registers itself when imported
# (`register_backend`), so this module never imports a backend; `gpu_worker.storage` imports
# every backend module, and importing any part of the package fills the registry.
BACKENDS: dict[str, Callable[[StorageConfig], StorageBackend]] = {}


def register_backend(name: str, factory: Callable[[StorageConfig], StorageBackend]) -> None:
    """Make `factory` the backend `StorageConfig.backend == name` builds (once per name)."""
    if name in BACKENDS:
        raise ValueError(f"storage backend {name!r} is registered twice")
    BACKENDS[name] = factory


def check_backend_name(name: str) -> None:
    if name not in BACKENDS:
        raise ValueError(f"unknown storage backend {name!r}; choose one of {sorted(BACKENDS)}")


def make_backend(config: StorageConfig) -> StorageBackend:
    """The backend `config.backend` names, built from `config`."""
    check_backend_name(config.backend)
    return BACKENDS[config.backend](config)
