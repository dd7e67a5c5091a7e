"""The `file` storage backend's object format: encoding a header and verifying an object.

Object file: HEADER, then the key (ASCII), then the payload.

    HEADER = "<8sHHQ32s16s": magic, format version, key length, payload length, digest, MAC

The digest is blake2b-256 of the payload. hashlib's blake2b runs at about a GB/s per core
and releases the GIL on large buffers, so it costs little next to the disk read, and unlike
crc32 it makes an undetected corruption practically impossible, which matters because a
wrong page silently changes outputs. The MAC is keyed blake2b-128 over the header before it
(the digest included) and the key, under the deployment's secret (`file_key.load_key`):
whoever can write into the directory but lacks the key cannot make an object that is
served, e.g. one whose payload is another page's KV with a matching digest. One pass over
the payload serves both checks. A failing MAC is "unauthenticated" (forged, or written under
another key: a deployment sharing the directory with another key file, or an old format), a
failing digest "corrupt". The key is stored so that a file copied or renamed under another
key's name is caught ("misnamed") instead of served as that key's KV.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import struct

from gpu_worker.storage.base import QuarantineReason

MAGIC = b"HICKV\x00\x01\x00"
FORMAT_VERSION = 2  # 2: a payload digest of 32 bytes and a keyed MAC
PREFIX = struct.Struct("<8sHHQ32s")  # magic, version, key_len, payload_len, blake2b-256
HEADER = struct.Struct("<8sHHQ32s16s")  # PREFIX, then the MAC (keyed blake2b-128)
DIGEST_SIZE = 32
MAC_SIZE = 16
MAC_PERSON = b"hicache-l3-mac"


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


def byte_view(buf: bytes | memoryview, writable: bool) -> memoryview:
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
