"""The `file` storage backend's quarantine: `DIR/.quarantine/<key>.<reason>`.

An object that fails verification is moved here rather than deleted: the rename removes it
from its key's path in one atomic step (no reader can see it again, and a fresh put may
replace it), while the bad bytes stay available to tell bit rot from a bug. Quarantined
bytes do not count against capacity_bytes, but the quarantine is bounded by
`quarantine_max_objects` and `quarantine_max_bytes` (the oldest quarantined go first).
"""

from __future__ import annotations

import contextlib
import os
import stat
import time

from gpu_worker.storage.base import QuarantineReason
from gpu_worker.storage.file_fs import listdir, make_private_dir, unlink

QUARANTINE_DIR = ".quarantine"


def quarantine_path(root: str, key: str, reason: QuarantineReason) -> str:
    return os.path.join(root, QUARANTINE_DIR, f"{key}.{reason}")


def move_to_quarantine(path: str, st: os.stat_result, target: str) -> None:
    """Move the bad file `path` (as `st` saw it) to `target`, unless it was already
    replaced or removed. OSError when the move fails (the caller deletes it instead)."""
    try:
        now = os.stat(path)
        if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
            make_private_dir(os.path.dirname(target))
            os.replace(path, target)
            now_ns = time.time_ns()  # its age in the quarantine counts from now (to the
            os.utime(target, ns=(now_ns, now_ns))  # ns: the clock, not the coarse fs one)
    except FileNotFoundError:
        pass  # another process quarantined or evicted it first


def trim_quarantine(root: str, max_objects: int, max_bytes: int) -> tuple[int, int, int]:
    """Drop the oldest quarantined objects beyond the bounds; (objects, bytes) left and
    the number dropped."""
    quarantine = os.path.join(root, QUARANTINE_DIR)
    entries: list[tuple[int, str, int]] = []  # (mtime_ns, name, size)
    for name in listdir(quarantine):
        with contextlib.suppress(OSError):
            st = os.stat(os.path.join(quarantine, name), follow_symlinks=False)
            if stat.S_ISREG(st.st_mode):
                entries.append((st.st_mtime_ns, name, st.st_size))
    entries.sort()
    count, total, dropped = len(entries), sum(e[2] for e in entries), 0
    for _, name, size in entries:
        if count <= max_objects and total <= max_bytes:
            break
        unlink(os.path.join(quarantine, name))
        count, total, dropped = count - 1, total - size, dropped + 1
    return count, total, dropped


def empty_quarantine(root: str) -> None:
    quarantine = os.path.join(root, QUARANTINE_DIR)
    for name in listdir(quarantine):
        unlink(os.path.join(quarantine, name))
