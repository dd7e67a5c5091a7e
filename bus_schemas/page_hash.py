"""Page identity shared by router and engines.

`page_hash(i) = blake2b(page_hash(i - 1) || tokens of page i as little-endian uint32)`, with
`page_hash(-1) = blake2b("hicache-root" || namespace || 0x00 || cache_salt)`. Only whole pages
are hashed. Hashes are 16-byte digests written as 32 hex characters.

The ids are taken as `TokenIds` (array('I')): its bytes are already the uint32 little-endian
page input, so each page is hashed from a memoryview slice, with no packing per page.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from bus_schemas.token_ids import as_token_ids

DIGEST_SIZE = 16


def root_hash(namespace: str, cache_salt: str = "") -> bytes:
    data = b"hicache-root" + namespace.encode() + b"\x00" + cache_salt.encode()
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest()


def chain_hashes(parent: bytes, token_ids: Sequence[int] | array, page_size: int) -> list[bytes]:
    """Hashes of the whole pages of `token_ids`, chained from `parent`.

    A list is converted once (ValueError for ids outside [0, 2**32)); an array('I') is used
    as is.
    """
    data = memoryview(as_token_ids(token_ids)).cast("B")
    page_bytes = 4 * page_size
    out: list[bytes] = []
    blake2b = hashlib.blake2b
    for start in range(0, len(data) - page_bytes + 1, page_bytes):
        h = blake2b(parent, digest_size=DIGEST_SIZE)
        h.update(data[start : start + page_bytes])
        parent = h.digest()
        out.append(parent)
    return out


def page_hashes(
    token_ids: Sequence[int] | array, page_size: int, namespace: str, cache_salt: str = ""
) -> list[str]:
    """Hex hashes of every whole page of `token_ids`."""
    if page_size <= 0:
        raise ValueError("page_size must be positive")
    root = root_hash(namespace, cache_salt)
    return [h.hex() for h in chain_hashes(root, token_ids, page_size)]


def make_namespace(model: str, kv_dtype: str, page_size: int, weights: str = "") -> str:
    """What engines must share to reuse each other's pages (not TP/PP). `weights`: a digest
    of the weights (`gpu_worker.model.weights_digest`), so that engines serving other weights
    under the same `--model` name (another seed, another file) never share a page hash."""
    return f"{model}|{kv_dtype}|p{page_size}" + (f"|w{weights}" if weights else "")
