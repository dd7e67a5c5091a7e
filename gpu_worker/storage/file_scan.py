"""The `file` storage backend's start-up scan: what the directory already holds.

It runs in a background thread, so a big directory does not delay start-up; it orders
pre-existing files by mtime (oldest first) behind everything the process touched meanwhile,
and deletes temp files older than STALE_TMP_S (left by crashed writers).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable

from gpu_worker.storage.base import is_valid_key
from gpu_worker.storage.file_fs import TMP_PREFIX

STALE_TMP_S = 3600.0  # the start-up scan deletes temp files older than this (crashed writers)


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
