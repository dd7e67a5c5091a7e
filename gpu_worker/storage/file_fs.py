"""Filesystem primitives of the `file` storage backend: private modes, directory creation,
atomic publication of a written temp file, directory fsync, classifying write errors, and
the store's root and fan-out directories.

Permissions: object and key files are 0600, the directories the backend makes 0700 (set
explicitly, whatever the umask): stored KV is derived from users' prompts.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Iterable

from gpu_worker.storage.base import WriteFailure

log = logging.getLogger(__name__)

FILE_MODE = 0o600
DIR_MODE = 0o700
TMP_PREFIX = ".tmp-"

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}  # EFBIG: a file-size limit
_READ_ONLY_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM}
_NO_HARD_LINK_ERRNOS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV}


def make_private_dir(path: str) -> bool:
    """mkdir `path` with mode 0700 (set explicitly: the umask does not decide); False when
    it exists already."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        return False
    os.chmod(path, DIR_MODE)
    return True


def make_root(root: str) -> None:
    """Create the store's directory `root` (0700); tighten it to 0700 when this user owns
    it. Only logs a failure: a read-only store may still be read."""
    try:
        parent = os.path.dirname(os.path.abspath(root))
        os.makedirs(parent, exist_ok=True)
        if make_private_dir(root):
            return
        st = os.stat(root)
        if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) != DIR_MODE:
            os.chmod(root, DIR_MODE)
            log.info("storage directory %s: mode set to 0700", root)
    except OSError as exc:  # a read-only store may still be read
        log.warning("storage directory %s could not be created: %s", root, exc)


def write_failure_reason(exc: OSError) -> WriteFailure:
    if exc.errno in _FULL_ERRNOS:
        return "full"
    if exc.errno in _READ_ONLY_ERRNOS:
        return "read_only"
    return "other"


def link_no_replace(tmp: str, path: str) -> bool:
    """Publish the complete temp file under its key's name, never replacing a winner;
    False when another writer published first. On filesystems without hard links the temp
    file is renamed over the name instead (still atomic; the writers of one key write the
    same bytes)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False  # the winner's object is complete and has the same content
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINK_ERRNOS:
            raise
        os.replace(tmp, path)
    return True


def sync_dirs(dirs: Iterable[str]) -> None:
    """fsync directories so new names survive a crash (best effort: not every filesystem
    allows it)."""
    for d in dirs:
        with contextlib.suppress(OSError):
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def listdir(path: str) -> list[str]:
    """os.listdir, empty when `path` is missing or not a directory."""
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


def unlink(path: str) -> None:
    """os.unlink, ignoring a file already gone."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def fan_dirs(root: str) -> list[str]:
    """The fan-out directories under `root` (names not starting with ".")."""
    return [
        os.path.join(root, name)
        for name in listdir(root)
        if not name.startswith(".") and os.path.isdir(os.path.join(root, name))
    ]
