"""The `file` storage backend: one file per object in a local or shared directory.

Layout: `DIR/<first 2 chars of key>/<key>` (the fan-out keeps any one directory small),
`DIR/.quarantine/<key>.<reason>` for objects that failed verification, and short-lived
`DIR/<fan>/.tmp-<pid>-<random>` files while a put is in flight. Keys never start with ".",
so none of the backend's own names can collide with an object.

FileBackend keeps the interface and the per-object read and write I/O, and ties together
pieces that each do one job: the object format and its MAC (`file_format`), the MAC key
(`file_key`), filesystem primitives (`file_fs`), the quarantine (`file_quarantine`), the
start-up scan thread (`file_scan`), the LRU that accounts for capacity (`file_index`) and
the thread-safe books that hold it with the counters behind `stats()` (`file_books`).
Their docstrings say more.

A root this user owns is tightened to 0700 (set explicitly, whatever the umask): stored KV
is derived from users' prompts.

Writes are atomic and write-once: the object is written and fsynced under a temp name in its
final directory, then hard-linked to the final name. `link` fails if the name exists, so
concurrent writers of one key (threads or processes) never tear or replace an object: the
first complete one wins and the others drop their temp files. On filesystems without hard
links the temp file is renamed over the name instead (still atomic; the writers of one key
write the same bytes).

Reads verify magic, version, key, payload length (against the file size and the caller's
buffer) and checksum. A failing object is moved to `.quarantine/` rather than deleted: the
rename removes it from its key's path in one atomic step (no reader can see it again, and a
fresh put may replace it), while the bad bytes stay available to tell bit rot from a bug.
If the rename fails the file is deleted instead. `clear()` empties the quarantine;
quarantined bytes do not count against capacity_bytes, but the quarantine is bounded by
`quarantine_max_objects` and `quarantine_max_bytes` (the oldest quarantined go first) and
counted in the stats.

Capacity: capacity_bytes None (the default) is `default_capacity_bytes`: a tenth of the
filesystem, at most half of the space free for the store; it is fixed once the start-up
scan knows what the store holds (until then, the tenth alone bounds it). Each process keeps an LRU (key -> on-disk size) of the objects it knows and, when
a put would exceed capacity_bytes, deletes its least recently used files first. The cap is
enforced by each process on its own view: other processes' objects count only once this
process has seen them (start-up scan, exists, get), and a file another process evicted is
just a miss. The start-up scan runs in a background thread, so a big directory does not
delay start-up; it orders pre-existing files by mtime (oldest first) behind everything the
process touched meanwhile. Until it ends the cap may be exceeded; the next put after it
evicts down to the cap. Recency is a logical order (the OrderedDict), not time; mtime is
used only once, to seed the order from a previous run.

Thread safety: one lock, owned by the books (`file_books`), guards the LRU index and the
counters; file I/O runs outside it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Sequence

from gpu_worker.storage.base import (
    QuarantineReason,
    StorageBackend,
    StorageConfig,
    StorageStats,
    WriteFailure,
    check_keys,
    default_capacity_bytes,
    is_valid_key,
    register_backend,
)
from gpu_worker.storage.file_books import FileBooks
from gpu_worker.storage.file_format import HEADER as HEADER
from gpu_worker.storage.file_format import byte_view, encode_header, verify_into
from gpu_worker.storage.file_format import file_size as file_size
from gpu_worker.storage.file_fs import (
    FILE_MODE,
    fan_dirs,
    link_no_replace,
    listdir,
    make_private_dir,
    make_root,
    sync_dirs,
    unlink,
    write_failure_reason,
)
from gpu_worker.storage.file_fs import TMP_PREFIX as TMP_PREFIX
from gpu_worker.storage.file_key import KEY_FILE, load_key
from gpu_worker.storage.file_quarantine import QUARANTINE_DIR as QUARANTINE_DIR
from gpu_worker.storage.file_quarantine import (
    empty_quarantine,
    move_to_quarantine,
    quarantine_path,
    trim_quarantine,
)
from gpu_worker.storage.file_scan import STALE_TMP_S as STALE_TMP_S
from gpu_worker.storage.file_scan import StartupScan

log = logging.getLogger(__name__)


class FileBackend(StorageBackend):
    """Objects as files under `config.directory`; see the module docstring."""

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        self.root = str(config.directory)
        self._closed = False
        capacity = config.capacity_bytes  # None: the default, set by the scan
        if capacity is None:
            # until the scan knows the store's size: the bound without the free-space term,
            # so that nothing is evicted or refused for a size not yet known
            capacity = default_capacity_bytes(self.root, None)
        self._books = FileBooks(capacity)
        make_root(self.root)
        key_file = config.key_file
        self._mac_key = load_key(
            str(key_file or os.path.join(self.root, KEY_FILE)), create=key_file is None
        )
        self._scan = StartupScan(
            self.root, self._books, config.capacity_bytes is None, self._trim_quarantine
        )
        self._scan.start()

    # ---------------------------------------------------------------- interface

    def exists(self, keys: Sequence[str]) -> int:
        self._check_open()
        check_keys(keys)
        for i, key in enumerate(keys):
            try:
                st = os.stat(self._path(key))
            except OSError:
                self._books.forget(key)
                return i
            self._books.touch(key, st.st_size)
        return len(keys)

    def get(self, keys: Sequence[str], out: Sequence[memoryview]) -> int:
        self._check_open()
        check_keys(keys)
        if len(out) != len(keys):
            raise ValueError(f"get: {len(keys)} keys but {len(out)} output buffers")
        views = [byte_view(buf, writable=True) for buf in out]
        for i, (key, view) in enumerate(zip(keys, views, strict=True)):
            if not self._read_one(key, view):
                return i
        return len(keys)

    def put(self, keys: Sequence[str], data: Sequence[bytes | memoryview]) -> int:
        self._check_open()
        check_keys(keys)
        if len(data) != len(keys):
            raise ValueError(f"put: {len(keys)} keys but {len(data)} payloads")
        views = [byte_view(buf, writable=False) for buf in data]
        stored: set[str] = set()
        new_dirs: set[str] = set()
        for i, (key, view) in enumerate(zip(keys, views, strict=True)):
            failure = self._put_one(key, view, stored, new_dirs)
            if failure is not None:
                self._record_write_failure(failure, key)
                sync_dirs(new_dirs)
                return i
            stored.add(key)
        sync_dirs(new_dirs)
        return len(keys)

    def stats(self) -> StorageStats:
        return self._books.stats(scanned=self._scan.done)

    def clear(self) -> None:
        """Also stops the start-up scan (its view would be stale) and empties the
        quarantine. Leaves temp files alone: removing one would fail its writer's put."""
        self._check_open()
        self._scan.stop()
        for fan in fan_dirs(self.root):
            for name in listdir(fan):
                if is_valid_key(name):
                    unlink(os.path.join(fan, name))
                    self._books.forget(name)
        empty_quarantine(self.root)
        self._books.clear()

    def close(self) -> None:
        if self._closed:
            return
        self._scan.stop()
        self._closed = True

    # ---------------------------------------------------------------- extras

    def wait_until_scanned(self, timeout: float | None = None) -> bool:
        """Block until the start-up scan has finished (or was stopped); False on timeout."""
        return self._scan.wait(timeout)

    def check_integrity(self) -> None:
        """Assert the bookkeeping invariants; tests call it."""
        self._books.check_integrity()

    def lru_keys(self) -> list[str]:
        """The known keys, least recently used first (a copy, for tests and debugging)."""
        return self._books.lru_keys()

    # ---------------------------------------------------------------- reads

    def _read_one(self, key: str, out: memoryview) -> bool:
        """Read and verify one object into `out`; count it; quarantine it if bad."""
        if self.config.delay_s_per_get > 0:
            time.sleep(self.config.delay_s_per_get)
        if not self._books.count_read(self.config.fail_get_after):
            return False
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                failure = verify_into(f, st.st_size, key, out, self._mac_key)
        except FileNotFoundError:
            self._books.forget(key, miss=True)  # never stored, or removed by another process
            return False
        except OSError as exc:  # e.g. EIO: a miss, but the object may be fine later
            if self._books.should_warn("read_error"):
                log.warning("storage read of %s failed: %s (logged once a minute)", key, exc)
            self._books.forget(key, miss=True)
            return False
        if failure is not None:
            self._quarantine(key, path, st, failure)
            return False
        self._books.count_hit(key, st.st_size)
        return True

    def _quarantine(
        self, key: str, path: str, st: os.stat_result, reason: QuarantineReason
    ) -> None:
        """Move the bad file away from its key's path, unless it was already replaced."""
        target = quarantine_path(self.root, key, reason)
        try:
            move_to_quarantine(path, st, target)
        except OSError as exc:
            log.warning("storage object %s: quarantine failed (%s); deleting it", key, exc)
            target = "(deleted)"
            unlink(path)
        self._books.count_quarantined(key, reason)
        log.warning("storage object %s failed verification (%s): moved to %s", key, reason, target)
        self._trim_quarantine()

    def _trim_quarantine(self) -> None:
        """Drop the oldest quarantined objects beyond the quarantine's bounds; count it."""
        count, total, dropped = trim_quarantine(
            self.root, self.config.quarantine_max_objects, self.config.quarantine_max_bytes
        )
        self._books.set_quarantine(count, total, dropped)

    # ---------------------------------------------------------------- writes

    def _put_one(
        self, key: str, payload: memoryview, batch: set[str], new_dirs: set[str]
    ) -> WriteFailure | None:
        """Store one object unless present; None on success, else why it failed."""
        path = self._path(key)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            pass
        except OSError as exc:  # e.g. the fan-out "directory" is a file
            self._log_write_error(key, exc)
            return write_failure_reason(exc)
        else:
            self._books.touch(key, st.st_size)
            return None
        size = file_size(key, payload.nbytes)
        victims = self._books.reserve(size, batch)
        if victims is None:
            return "full"
        for victim in victims:
            unlink(self._path(victim))
        try:
            published = self._write_file(key, path, payload, new_dirs)
        except OSError as exc:
            self._books.release(size)
            self._log_write_error(key, exc)
            return write_failure_reason(exc)
        self._books.count_written(key, size, published)
        return None

    def _write_file(self, key: str, path: str, payload: memoryview, new_dirs: set[str]) -> bool:
        """Write the object atomically; False when another writer published it first."""
        fan = os.path.dirname(path)
        if not os.path.isdir(fan) and make_private_dir(fan):
            new_dirs.add(self.root)
        tmp = os.path.join(fan, f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)  # whatever the umask
            with open(fd, "wb") as f:
                f.write(encode_header(key, payload, self._mac_key))
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            published = link_no_replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        new_dirs.add(fan)
        return published

    def _record_write_failure(self, reason: WriteFailure, key: str) -> None:
        self._books.count_write_failure(reason)
        if self._books.should_warn(reason):
            log.warning(
                "storage put stopped at %s: %s (%s); further %r failures are counted in "
                "stats and logged at most once a minute",
                key,
                reason,
                self.root,
                reason,
            )

    @staticmethod
    def _log_write_error(key: str, exc: OSError) -> None:
        log.debug("storage put of %s failed: %s", key, exc)

    # ---------------------------------------------------------------- paths

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key[:2], key)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"storage backend on {self.root} is closed")


register_backend("file", FileBackend)
