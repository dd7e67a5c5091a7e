"""The MAC key of the `file` storage backend.

`StorageConfig.key_file`, or by default `DIR/.key`, made on first use (32 random bytes as
hex, mode 0600, published with a hard link so ranks starting together agree on one). Kept
beside the objects, it survives restarts, so a restarted engine reads what it wrote. It
guards against writers who cannot read it; in a directory others may write, give a key file
outside it (`--hicache-storage-key-file`), since they could replace `DIR/.key`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets

from gpu_worker.storage.file_fs import FILE_MODE, TMP_PREFIX

log = logging.getLogger(__name__)

KEY_FILE = ".key"  # the default MAC key, in the storage directory
MIN_KEY_BYTES = 16


def load_key(path: str, create: bool) -> bytes:
    """The MAC key in file `path`: blake2b-512 of its content (surrounding whitespace
    stripped), so any secret of at least MIN_KEY_BYTES bytes serves. With `create`, a
    missing file is made first: 32 random bytes as hex, mode 0600, published with a hard
    link so that processes starting together all read the one that won. ValueError, naming
    the file, when it is missing (and not to be made), unreadable or too short."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        if not create:
            raise ValueError(
                f"no storage key file at {path} (make one: `umask 077; openssl rand -hex 32 "
                f"> {path}`)"
            ) from None
        try:
            raw = _create_key(path)
        except OSError as exc:
            raise ValueError(
                f"the storage key {path} could not be made ({exc}); give a key file with "
                "--hicache-storage-key-file"
            ) from None
    except OSError as exc:
        raise ValueError(f"the storage key file {path} cannot be read: {exc}") from None
    secret = raw.strip()
    if len(secret) < MIN_KEY_BYTES:
        raise ValueError(
            f"the storage key file {path} holds {len(secret)} bytes; at least "
            f"{MIN_KEY_BYTES} are needed (e.g. `openssl rand -hex 32`)"
        )
    with contextlib.suppress(OSError):
        if os.stat(path).st_mode & 0o077:
            log.warning("the storage key file %s is readable by others: chmod 600 it", path)
    return hashlib.blake2b(secret, digest_size=64, person=b"hicache-l3-key").digest()


def _create_key(path: str) -> bytes:
    """Write a fresh key to `path` unless another process got there first; its content."""
    tmp = f"{path}{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        with open(fd, "wb") as f:
            f.write(secrets.token_hex(32).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    with open(path, "rb") as f:
        return f.read()
