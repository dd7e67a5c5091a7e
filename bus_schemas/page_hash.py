"""Page identity shared by router and engines.

`page_hash(i) = blake2b(page_hash(i - 1) || tokens of page i as little-endian uint32)`, with
`page_hash(-1) = blake2b("hicache-root" || namespace || 0x00 || cache_salt)`. Only whole pages
are hashed. Hashes are 16-byte digests written as 32 hex characters.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

DIGEST_SIZE = 16


def root_hash(namespace: str, cache_salt: str = "") -> bytes:
    data = b"hicache-root" + namespace.encode() + b"\x00" + cache_salt.encode()
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest()


def chain_hashes(parent: bytes, token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """Hashes of the whole pages of `token_ids`, chained from `parent`."""
    out: list[bytes] = []
    num_pages = len(token_ids) // page_size
    pack = struct.Struct(f"<{page_size}I").pack
    for i in range(num_pages):
        page = token_ids[i * page_size : (i + 1) * page_size]
        parent = hashlib.blake2b(parent + pack(*page), digest_size=DIGEST_SIZE).digest()
        out.append(parent)
    return out


def page_hashes(
    token_ids: Sequence[int], page_size: int, namespace: str, cache_salt: str = ""
) -> list[str]:
    """Hex hashes of every whole page of `token_ids`."""
    if page_size <= 0:
        raise ValueError("page_size must be positive")
    root = root_hash(namespace, cache_salt)
    return [h.hex() for h in chain_hashes(root, token_ids, page_size)]


def make_namespace(model: str, kv_dtype: str, page_size: int) -> str:
    """What engines must share to reuse each other's pages (not TP/PP)."""
    return f"{model}|{kv_dtype}|p{page_size}"
