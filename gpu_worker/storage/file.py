"""The `file` storage backend: one file per object in a local or shared directory.

Layout: `DIR/<first 2 chars of key>/<key>` (the fan-out keeps any one directory small),
`DIR/.quarantine/<key>.<reason>` for objects that failed verification, and short-lived
`DIR/<fan>/.tmp-<pid>-<random>` files while a put is in flight. Keys never start with ".",
so none of the backend's own names can collide with an object.

Object file: HEADER, then the key (ASCII), then the payload.

    HEADER = "<8sHHQ32s16s": magic, format version, key length, payload length, digest, MAC

The digest is blake2b-256 of the payload. hashlib's blake2b runs at about a GB/s per core
and releases the GIL on large buffers, so it costs little next to the disk read, and unlike
crc32 it makes an undetected corruption practically impossible, which matters because a
wrong page silently changes outputs. The MAC is keyed blake2b-128 over the header before it
(the digest included) and the key, under the deployment's secret (`load_key`): whoever can
write into the directory but lacks the key cannot make an object that is served, e.g. one
whose payload is another page's KV with a matching digest. One pass over the payload
serves both checks. A failing MAC is "unauthenticated" (forged, or written under another
key: a deployment sharing the directory with another key file, or an old format), a
failing digest "corrupt". The key is stored so that a file copied or renamed under another
key's name is caught ("misnamed") instead of served as that key's KV.

The MAC key: `StorageConfig.key_file`, or by default `DIR/.key`, made on first use (32
random bytes as hex, mode 0600, published with a hard link so ranks starting together agree
on one). Kept beside the objects, it survives restarts, so a restarted engine reads what it
wrote. It guards against writers who cannot read it; in a directory others may write, give
a key file outside it (`--hicache-storage-key-file`), since they could replace `DIR/.key`.

Permissions: object and key files are 0600, the directories this backend makes 0700, and a
root this user owns is tightened to 0700 (set explicitly, whatever the umask): stored KV is
derived from users' prompts.

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

Thread safety: one lock guards the LRU and the counters; file I/O runs outside it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import io
import logging
import os
import secrets
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from gpu_worker.storage.base import (
    QUARANTINE_REASONS,
    WRITE_FAILURES,
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

log = logging.getLogger(__name__)

MAGIC = b"HICKV\x00\x01\x00"
FORMAT_VERSION = 2  # 2: a payload digest of 32 bytes and a keyed MAC
PREFIX = struct.Struct("<8sHHQ32s")  # magic, version, key_len, payload_len, blake2b-256
HEADER = struct.Struct("<8sHHQ32s16s")  # PREFIX, then the MAC (keyed blake2b-128)
DIGEST_SIZE = 32
MAC_SIZE = 16
MAC_PERSON = b"hicache-l3-mac"
QUARANTINE_DIR = ".quarantine"
KEY_FILE = ".key"  # the default MAC key, in the storage directory
MIN_KEY_BYTES = 16
FILE_MODE = 0o600
DIR_MODE = 0o700
TMP_PREFIX = ".tmp-"
STALE_TMP_S = 3600.0  # the start-up scan deletes temp files older than this (crashed writers)
WARN_INTERVAL_S = 60.0  # at most one write-failure warning per reason per interval

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}  # EFBIG: a file-size limit
_READ_ONLY_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM}
_NO_HARD_LINK_ERRNOS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV}


def file_size(key: str, payload_nbytes: int) -> int:
    """On-disk size of an object: what capacity_bytes and StorageStats.num_bytes count."""
    return HEADER.size + len(key) + payload_nbytes


def object_mac(mac_key: bytes, prefix: bytes, key_bytes: bytes) -> bytes:
    """The MAC of an object: keyed blake2b over its header's PREFIX (which holds the
    payload's digest) and its key."""
    h = hashlib.blake2b(key=mac_key, digest_size=MAC_SIZE, person=MAC_PERSON)
    h.update(prefix)
    h.update(key_bytes)
    return h.digest()


def encode_header(key: str, payload: memoryview, mac_key: bytes) -> bytes:
    digest = hashlib.blake2b(payload, digest_size=DIGEST_SIZE).digest()
    key_bytes = key.encode("ascii")
    prefix = PREFIX.pack(MAGIC, FORMAT_VERSION, len(key_bytes), payload.nbytes, digest)
    return prefix + object_mac(mac_key, prefix, key_bytes) + key_bytes


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


def make_private_dir(path: str) -> bool:
    """mkdir `path` with mode 0700 (set explicitly: the umask does not decide); False when
    it exists already."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        return False
    os.chmod(path, DIR_MODE)
    return True


def write_failure_reason(exc: OSError) -> WriteFailure:
    if exc.errno in _FULL_ERRNOS:
        return "full"
    if exc.errno in _READ_ONLY_ERRNOS:
        return "read_only"
    return "other"


def _byte_view(buf: bytes | memoryview, writable: bool) -> memoryview:
    """A flat unsigned-byte view of a C-contiguous buffer (ValueError otherwise)."""
    view = memoryview(buf)
    if writable and view.readonly:
        raise ValueError("storage get needs writable output buffers")
    if not view.c_contiguous:
        raise ValueError("storage buffers must be C-contiguous")
    if view.format == "B" and view.ndim == 1:
        return view
    try:
        return view.cast("B")
    except TypeError as exc:  # a format memoryview cannot reinterpret as bytes
        raise ValueError(f"storage buffer of format {view.format!r}: {exc}") from None


def _read_exact(f: io.FileIO, n: int) -> bytes:
    parts = []
    while n > 0:
        chunk = f.read(n)
        if not chunk:
            break
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


def _readinto_exact(f: io.FileIO, buf: memoryview) -> int:
    done = 0
    while done < buf.nbytes:
        n = f.readinto(buf[done:])
        if not n:
            break
        done += n
    return done


def verify_into(
    f: io.FileIO, size: int, key: str, out: memoryview, mac_key: bytes
) -> QuarantineReason | None:
    """Read the object file `f` (`size` bytes on disk) for `key` into `out`; None when every
    check passes, else why it failed. The MAC is checked before the payload is read: a
    forged object's bytes never reach `out`."""
    key_bytes = key.encode("ascii")
    head = _read_exact(f, HEADER.size + len(key_bytes))  # header and key in one read
    if len(head) < HEADER.size:
        return "truncated"
    magic, version, key_len, payload_len, digest, mac = HEADER.unpack_from(head)
    if magic != MAGIC:
        return "corrupt"
    if version != FORMAT_VERSION:
        return "unauthenticated"  # an older format: no MAC of this deployment's key
    if key_len != len(key_bytes):
        return "misnamed"
    if len(head) < HEADER.size + key_len:
        return "truncated"
    if head[HEADER.size :] != key_bytes:
        return "misnamed"
    expected = HEADER.size + key_len + payload_len
    if size != expected:
        return "truncated" if size < expected else "corrupt"
    if not hmac.compare_digest(object_mac(mac_key, head[: PREFIX.size], key_bytes), mac):
        return "unauthenticated"
    if payload_len != out.nbytes:
        return "wrong_size"
    if _readinto_exact(f, out) < payload_len:
        return "truncated"  # shrank since the stat
    if hashlib.blake2b(out, digest_size=DIGEST_SIZE).digest() != digest:
        return "corrupt"
    return None


@dataclass(slots=True)
class _Counters:
    num_reads: int = 0
    num_hits: int = 0
    num_misses: int = 0
    num_written: int = 0
    num_evictions: int = 0


class FileBackend(StorageBackend):
    """Objects as files under `config.directory`; see the module docstring."""

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        self.root = str(config.directory)
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, int] = OrderedDict()  # key -> on-disk size, oldest first
        self._used_bytes = 0  # sum of self._lru's sizes
        self._pending_bytes = 0  # reserved by puts in flight
        self._counters = _Counters()
        self._quarantined = dict.fromkeys(QUARANTINE_REASONS, 0)
        self._write_failures = dict.fromkeys(WRITE_FAILURES, 0)
        self._last_warned: dict[str, float] = {}  # reason -> time.monotonic() of its warning
        self._closed = False
        self._capacity = config.capacity_bytes  # None: the default, set by the scan
        if self._capacity is None:
            # until the scan knows the store's size: the bound without the free-space term,
            # so that nothing is evicted or refused for a size not yet known
            self._capacity = default_capacity_bytes(self.root, None)
        self._quarantine_objects = self._quarantine_bytes = self._quarantine_dropped = 0
        self._make_root()
        key_file = config.key_file
        self._mac_key = load_key(
            str(key_file or os.path.join(self.root, KEY_FILE)), create=key_file is None
        )
        self._scanned = threading.Event()
        self._cancel_scan = threading.Event()
        self._scan_thread = threading.Thread(
            target=self._scan, name="storage-file-scan", daemon=True
        )
        self._scan_thread.start()

    # ---------------------------------------------------------------- interface

    def exists(self, keys: Sequence[str]) -> int:
        self._check_open()
        check_keys(keys)
        for i, key in enumerate(keys):
            try:
                st = os.stat(self._path(key))
            except OSError:
                self._forget(key)
                return i
            self._touch(key, st.st_size)
        return len(keys)

    def get(self, keys: Sequence[str], out: Sequence[memoryview]) -> int:
        self._check_open()
        check_keys(keys)
        if len(out) != len(keys):
            raise ValueError(f"get: {len(keys)} keys but {len(out)} output buffers")
        views = [_byte_view(buf, writable=True) for buf in out]
        for i, (key, view) in enumerate(zip(keys, views, strict=True)):
            if not self._read_one(key, view):
                return i
        return len(keys)

    def put(self, keys: Sequence[str], data: Sequence[bytes | memoryview]) -> int:
        self._check_open()
        check_keys(keys)
        if len(data) != len(keys):
            raise ValueError(f"put: {len(keys)} keys but {len(data)} payloads")
        views = [_byte_view(buf, writable=False) for buf in data]
        stored: set[str] = set()
        new_dirs: set[str] = set()
        for i, (key, view) in enumerate(zip(keys, views, strict=True)):
            failure = self._put_one(key, view, stored, new_dirs)
            if failure is not None:
                self._record_write_failure(failure, key)
                self._sync_dirs(new_dirs)
                return i
            stored.add(key)
        self._sync_dirs(new_dirs)
        return len(keys)

    def stats(self) -> StorageStats:
        with self._lock:
            c = self._counters
            return StorageStats(
                num_objects=len(self._lru),
                num_bytes=self._used_bytes,
                scanned=self._scanned.is_set(),
                num_reads=c.num_reads,
                num_hits=c.num_hits,
                num_misses=c.num_misses,
                num_written=c.num_written,
                num_evictions=c.num_evictions,
                quarantined=MappingProxyType(dict(self._quarantined)),
                write_failures=MappingProxyType(dict(self._write_failures)),
                capacity_bytes=self._capacity or 0,
                quarantine_objects=self._quarantine_objects,
                quarantine_bytes=self._quarantine_bytes,
                quarantine_dropped=self._quarantine_dropped,
            )

    def clear(self) -> None:
        """Also stops the start-up scan (its view would be stale) and empties the
        quarantine. Leaves temp files alone: removing one would fail its writer's put."""
        self._check_open()
        self._stop_scan()
        for fan in self._fan_dirs():
            for name in self._listdir(fan):
                if is_valid_key(name):
                    self._unlink(os.path.join(fan, name))
                    self._forget(name)
        quarantine = os.path.join(self.root, QUARANTINE_DIR)
        for name in self._listdir(quarantine):
            self._unlink(os.path.join(quarantine, name))
        with self._lock:
            self._lru.clear()
            self._used_bytes = 0
            self._quarantine_objects = self._quarantine_bytes = 0

    def close(self) -> None:
        if self._closed:
            return
        self._stop_scan()
        self._closed = True

    # ---------------------------------------------------------------- extras

    def wait_until_scanned(self, timeout: float | None = None) -> bool:
        """Block until the start-up scan has finished (or was stopped); False on timeout."""
        return self._scanned.wait(timeout)

    def check_integrity(self) -> None:
        """Assert the bookkeeping invariants; tests call it."""
        with self._lock:
            assert self._used_bytes == sum(self._lru.values()), "used bytes != LRU sizes"
            assert self._pending_bytes >= 0, "negative pending bytes"
            assert all(is_valid_key(k) for k in self._lru), "invalid key in the LRU"

    def lru_keys(self) -> list[str]:
        """The known keys, least recently used first (a copy, for tests and debugging)."""
        with self._lock:
            return list(self._lru)

    # ---------------------------------------------------------------- reads

    def _read_one(self, key: str, out: memoryview) -> bool:
        """Read and verify one object into `out`; count it; quarantine it if bad."""
        if self.config.delay_s_per_get > 0:
            time.sleep(self.config.delay_s_per_get)
        with self._lock:
            self._counters.num_reads += 1
            limit = self.config.fail_get_after
            if limit is not None and self._counters.num_hits >= limit:
                self._counters.num_misses += 1
                return False
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                failure = verify_into(f, st.st_size, key, out, self._mac_key)
        except FileNotFoundError:
            self._forget(key, miss=True)  # never stored, or removed by another process
            return False
        except OSError as exc:  # e.g. EIO: a miss, but the object may be fine later
            if self._should_warn("read_error"):
                log.warning("storage read of %s failed: %s (logged once a minute)", key, exc)
            self._forget(key, miss=True)
            return False
        if failure is not None:
            self._quarantine(key, path, st, failure)
            return False
        with self._lock:
            self._counters.num_hits += 1
            self._touch_locked(key, st.st_size)
        return True

    def _quarantine(
        self, key: str, path: str, st: os.stat_result, reason: QuarantineReason
    ) -> None:
        """Move the bad file away from its key's path, unless it was already replaced."""
        target = os.path.join(self.root, QUARANTINE_DIR, f"{key}.{reason}")
        try:
            now = os.stat(path)
            if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
                make_private_dir(os.path.dirname(target))
                os.replace(path, target)
                now_ns = time.time_ns()  # its age in the quarantine counts from now (to the
                os.utime(target, ns=(now_ns, now_ns))  # ns: the clock, not the coarse fs one)
        except FileNotFoundError:
            pass  # another process quarantined or evicted it first
        except OSError as exc:
            log.warning("storage object %s: quarantine failed (%s); deleting it", key, exc)
            target = "(deleted)"
            self._unlink(path)
        with self._lock:
            self._quarantined[reason] += 1
            self._counters.num_misses += 1
            self._forget_locked(key)
        log.warning("storage object %s failed verification (%s): moved to %s", key, reason, target)
        self._trim_quarantine()

    def _trim_quarantine(self) -> None:
        """Drop the oldest quarantined objects beyond the quarantine's bounds; count it."""
        quarantine = os.path.join(self.root, QUARANTINE_DIR)
        entries: list[tuple[int, str, int]] = []  # (mtime_ns, name, size)
        for name in self._listdir(quarantine):
            with contextlib.suppress(OSError):
                st = os.stat(os.path.join(quarantine, name), follow_symlinks=False)
                if stat.S_ISREG(st.st_mode):
                    entries.append((st.st_mtime_ns, name, st.st_size))
        entries.sort()
        count, total, dropped = len(entries), sum(e[2] for e in entries), 0
        max_objects, max_bytes = (
            self.config.quarantine_max_objects,
            self.config.quarantine_max_bytes,
        )
        for _, name, size in entries:
            if count <= max_objects and total <= max_bytes:
                break
            self._unlink(os.path.join(quarantine, name))
            count, total, dropped = count - 1, total - size, dropped + 1
        with self._lock:
            self._quarantine_objects, self._quarantine_bytes = count, total
            self._quarantine_dropped += dropped

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
            self._touch(key, st.st_size)
            return None
        size = file_size(key, payload.nbytes)
        with self._lock:
            victims = self._reserve_locked(size, batch)
        if victims is None:
            return "full"
        for victim in victims:
            self._unlink(self._path(victim))
        try:
            published = self._write_file(key, path, payload, new_dirs)
        except OSError as exc:
            with self._lock:
                self._pending_bytes -= size
            self._log_write_error(key, exc)
            return write_failure_reason(exc)
        with self._lock:
            self._pending_bytes -= size
            if published:
                self._counters.num_written += 1
            self._touch_locked(key, size)
        return None

    def _reserve_locked(self, size: int, batch: set[str]) -> list[str] | None:
        """Make room for `size` bytes: pick and forget least recently used objects (never
        ones this put already stored), reserve the bytes, and return the victims to delete.
        None (nothing changed) when the object cannot fit."""
        cap = self._capacity or 0
        excess = self._used_bytes + self._pending_bytes + size - cap
        victims: list[str] = []
        if cap > 0 and excess > 0:
            for key, key_size in self._lru.items():
                if key in batch:
                    continue
                victims.append(key)
                excess -= key_size
                if excess <= 0:
                    break
            if excess > 0:
                return None
        for key in victims:
            self._forget_locked(key)
        self._counters.num_evictions += len(victims)
        self._pending_bytes += size
        return victims

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
            published = self._link(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        new_dirs.add(fan)
        return published

    @staticmethod
    def _link(tmp: str, path: str) -> bool:
        """Publish the complete temp file under its key's name, never replacing a winner;
        False when another writer published first."""
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False  # the winner's object is complete and has the same content
        except OSError as exc:
            if exc.errno not in _NO_HARD_LINK_ERRNOS:
                raise
            os.replace(tmp, path)
        return True

    @staticmethod
    def _sync_dirs(dirs: Iterable[str]) -> None:
        """fsync directories so new names survive a crash (best effort: not every
        filesystem allows it)."""
        for d in dirs:
            with contextlib.suppress(OSError):
                fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def _record_write_failure(self, reason: WriteFailure, key: str) -> None:
        with self._lock:
            self._write_failures[reason] += 1
        if self._should_warn(reason):
            log.warning(
                "storage put stopped at %s: %s (%s); further %r failures are counted in "
                "stats and logged at most once a minute",
                key,
                reason,
                self.root,
                reason,
            )

    def _should_warn(self, kind: str) -> bool:
        """True at most once per WARN_INTERVAL_S for each kind (rate-limits log lines)."""
        now = time.monotonic()
        with self._lock:
            last = self._last_warned.get(kind)
            if last is not None and now - last < WARN_INTERVAL_S:
                return False
            self._last_warned[kind] = now
            return True

    @staticmethod
    def _log_write_error(key: str, exc: OSError) -> None:
        log.debug("storage put of %s failed: %s", key, exc)

    # ---------------------------------------------------------------- LRU

    def _touch(self, key: str, size: int) -> None:
        with self._lock:
            self._touch_locked(key, size)

    def _touch_locked(self, key: str, size: int) -> None:
        old = self._lru.pop(key, None)
        if old is not None:
            self._used_bytes -= old
        self._lru[key] = size
        self._used_bytes += size

    def _forget(self, key: str, miss: bool = False) -> None:
        with self._lock:
            self._forget_locked(key)
            if miss:
                self._counters.num_misses += 1

    def _forget_locked(self, key: str) -> None:
        size = self._lru.pop(key, None)
        if size is not None:
            self._used_bytes -= size

    # ---------------------------------------------------------------- start-up scan

    def _scan(self) -> None:
        """Learn the objects already in the directory, oldest mtime least recently used."""
        found: list[tuple[int, str, int]] = []  # (mtime_ns, key, size)
        stale_before = time.time() - STALE_TMP_S
        try:
            for fan in self._fan_dirs():
                with os.scandir(fan) as entries:
                    for entry in entries:
                        if self._cancel_scan.is_set():
                            return
                        self._scan_entry(entry, os.path.basename(fan), stale_before, found)
        except OSError as exc:
            log.warning("storage scan of %s stopped: %s", self.root, exc)
        finally:
            if not self._cancel_scan.is_set():
                self._merge_scan(found)
                self._trim_quarantine()
            self._scanned.set()

    @staticmethod
    def _scan_entry(
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

    def _merge_scan(self, found: list[tuple[int, str, int]]) -> None:
        """Put scanned objects behind everything touched while the scan ran; fix the
        default cap now that the store's size is known."""
        found.sort(reverse=True)  # newest first, each moved to the front in turn
        with self._lock:
            for _, key, size in found:
                if key not in self._lru:
                    self._lru[key] = size
                    self._used_bytes += size
                    self._lru.move_to_end(key, last=False)
            used = self._used_bytes
        if self.config.capacity_bytes is None:
            with contextlib.suppress(OSError):
                cap = default_capacity_bytes(self.root, used)
                with self._lock:
                    self._capacity = cap

    def _stop_scan(self) -> None:
        self._cancel_scan.set()
        self._scan_thread.join()

    # ---------------------------------------------------------------- paths

    def _make_root(self) -> None:
        """Create the directory (0700); tighten it to 0700 when this user owns it."""
        try:
            parent = os.path.dirname(os.path.abspath(self.root))
            os.makedirs(parent, exist_ok=True)
            if make_private_dir(self.root):
                return
            st = os.stat(self.root)
            if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) != DIR_MODE:
                os.chmod(self.root, DIR_MODE)
                log.info("storage directory %s: mode set to 0700", self.root)
        except OSError as exc:  # a read-only store may still be read
            log.warning("storage directory %s could not be created: %s", self.root, exc)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key[:2], key)

    def _fan_dirs(self) -> list[str]:
        """The fan-out directories (names not starting with ".")."""
        return [
            os.path.join(self.root, name)
            for name in self._listdir(self.root)
            if not name.startswith(".") and os.path.isdir(os.path.join(self.root, name))
        ]

    @staticmethod
    def _listdir(path: str) -> list[str]:
        try:
            return os.listdir(path)
        except (FileNotFoundError, NotADirectoryError):
            return []

    @staticmethod
    def _unlink(path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"storage backend on {self.root} is closed")


register_backend("file", FileBackend)
