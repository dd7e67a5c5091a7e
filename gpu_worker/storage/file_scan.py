"""The `file` storage backend's start-up scan: what the directory already holds.

It runs in a background thread (`StartupScan`), so a big directory does not delay start-up;
it orders pre-existing files by mtime (oldest first) behind everything the process touched
meanwhile, and deletes temp files older than STALE_TMP_S (left by crashed writers). Once it
knows what the store holds, it fixes a default capacity (see `default_capacity_bytes`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable

from gpu_worker.storage.base import default_capacity_bytes, is_valid_key
from gpu_worker.storage.file_books import FileBooks
from gpu_worker.storage.file_fs import TMP_PREFIX, fan_dirs

log = logging.getLogger(__name__)

STALE_TMP_S = 3600.0  # the start-up scan deletes temp files older than this (crashed writers)


class StartupScan:
    """The thread that learns the objects already under `root` into `books`, oldest mtime
    least recently used, then calls `after`. With `fix_capacity` (no capacity configured)
    it also sets the books' capacity to the default for the store's size. Neither happens
    when it is stopped first."""

    def __init__(
        self, root: str, books: FileBooks, fix_capacity: bool, after: Callable[[], None]
    ) -> None:
        self.root = root
        self._books = books
        self._fix_capacity = fix_capacity
        self._after = after
        self._done = threading.Event()
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._run, name="storage-file-scan", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def done(self) -> bool:
        """True once the scan has finished or was stopped."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the scan has finished (or was stopped); False on timeout."""
        return self._done.wait(timeout)

    def stop(self) -> None:
        """Stop the scan (its view would be stale) and wait for its thread to end."""
        self._cancel.set()
        self._thread.join()

    def _run(self) -> None:
        found: list[tuple[int, str, int]] = []  # (mtime_ns, key, size)
        stale_before = time.time() - STALE_TMP_S
        try:
            scan_fans(fan_dirs(self.root), stale_before, self._cancel, found)
        except OSError as exc:
            log.warning("storage scan of %s stopped: %s", self.root, exc)
        finally:
            if not self._cancel.is_set():
                self._merge(found)
                self._after()
            self._done.set()

    def _merge(self, found: list[tuple[int, str, int]]) -> None:
        """Put scanned objects behind everything touched while the scan ran; fix the
        default cap now that the store's size is known."""
        used = self._books.merge_scan(found)
        if self._fix_capacity:
            with contextlib.suppress(OSError):
                self._books.set_capacity(default_capacity_bytes(self.root, used))


def scan_fans(
    fans: Iterable[str],
    stale_before: float,
    cancel: threading.Event,
    found: list[tuple[int, str, int]],
) -> bool:
    """Append (mtime_ns, key, size) of each object in the fan-out directories `fans` to
    `found`; False when `cancel` stopped it. OSError when a directory cannot be read."""
    for fan in fans:
        with os.scandir(fan) as entries:
            for entry in entries:
                if cancel.is_set():
                    return False
                scan_entry(entry, os.path.basename(fan), stale_before, found)
    return True


def scan_entry(
    entry: os.DirEntry[str], fan: str, stale_before: float, found: list[tuple[int, str, int]]
) -> None:
    try:
        if not entry.is_file(follow_symlinks=False):
            return
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return  # vanished
    if entry.name.startswith(TMP_PREFIX):
        if st.st_mtime < stale_before:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
    elif is_valid_key(entry.name) and entry.name[:2] == fan:
        found.append((st.st_mtime_ns, entry.name, st.st_size))
