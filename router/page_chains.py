"""Page-hash chains of recent prompts, so a prompt that repeats or extends one the router has
seen hashes only its new pages.

Agents resend their whole history every turn. Hashing a prompt's pages is one blake2b call
per page in a Python loop: 0.33 ms at 32K tokens (512 pages of 64), the largest part of the
router's own work at that length, spent again on every resend. `PageChains` keeps, per
namespace, cache_salt, page size and first page, the last few prompts' token bytes and page
digests; a new prompt takes the digests of the pages it shares with the best of them from the
start (found with one `startswith` in C, else one vectorised page compare) and hashes only
the rest. The result is exact: a digest is reused only for a page whose bytes, and every
byte before it, equal the cached prompt's under the same chain seed (namespace and
cache_salt, `bus_schemas.page_hash`), so it is the digest `chain_hashes` computes.

Memory is bounded by `max_bytes` (token bytes plus digests); the least recently used first
pages go first. `max_bytes=0` turns the cache off.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from bus_schemas.page_hash import DIGEST_SIZE, chain_hashes, root_hash
from bus_schemas.token_ids import TokenIds

CHAINS_PER_HEAD = 4  # prompts kept per first page (conversations sharing a system prompt)

_Head = tuple[str, str, int, bytes]  # namespace, cache_salt, page_size, first page's bytes
# (parent digest, whole pages' token bytes, page_size) -> the pages' chained digests
HashPages = Callable[[bytes, bytes, int], bytes]


@dataclass(frozen=True, slots=True)
class _Chain:
    data: bytes  # the prompt's whole pages, uint32 little-endian
    digests: bytes  # DIGEST_SIZE bytes per page, in order

    @property
    def num_bytes(self) -> int:
        return len(self.data) + len(self.digests)


class PageChains:
    """Page hashes of prompts, reusing those of recent prompts with the same start."""

    def __init__(self, max_bytes: int, hash_pages: HashPages | None = None) -> None:
        """`hash_pages`: what hashes pages (default `chain_digests`; tests count its calls)."""
        self.max_bytes = max_bytes
        self._hash_pages = chain_digests if hash_pages is None else hash_pages
        self.num_bytes = 0  # held now
        self._heads: OrderedDict[_Head, list[_Chain]] = OrderedDict()  # oldest first

    def hex_hashes(self, ids: TokenIds, page_size: int, namespace: str, cache_salt: str) -> str:
        """The hex page hashes of every whole page of `ids`, concatenated (32 characters per
        page): `"".join(page_hashes(ids, page_size, namespace, cache_salt))`."""
        page_bytes = 4 * page_size
        data = ids.tobytes()
        num_pages = len(data) // page_bytes
        if num_pages == 0:
            return ""
        data = data[: num_pages * page_bytes]
        if self.max_bytes <= 0:
            return self._hash_pages(root_hash(namespace, cache_salt), data, page_size).hex()
        head = (namespace, cache_salt, page_size, data[:page_bytes])
        chains = self._heads.get(head)
        best, shared = None, 0
        for chain in chains or ():
            n = _shared_pages(chain.data, data, page_bytes)
            if n > shared:
                best, shared = chain, n
        if best is None:
            digests = self._hash_pages(root_hash(namespace, cache_salt), data, page_size)
        elif shared == num_pages:
            digests = best.digests[: shared * DIGEST_SIZE]
        else:
            known = best.digests[: shared * DIGEST_SIZE]
            rest = data[shared * page_bytes :]
            digests = known + self._hash_pages(known[-DIGEST_SIZE:], rest, page_size)
        self._keep(head, chains, best, _Chain(data, digests))
        return digests.hex()

    def _keep(
        self, head: _Head, chains: list[_Chain] | None, best: _Chain | None, new: _Chain
    ) -> None:
        """Remember `new` under `head`, in place of `best` when it extends it (the turn
        after), unless `best` already covers it (a repeat, or a prefix of it)."""
        if chains is None:
            chains = self._heads[head] = []
        else:
            self._heads.move_to_end(head)
        if best is not None and best.data.startswith(new.data):
            chains.remove(best)
            chains.insert(0, best)  # the most recently used first
            return
        if best is not None and new.data.startswith(best.data):
            chains.remove(best)
            self.num_bytes -= best.num_bytes
        chains.insert(0, new)
        self.num_bytes += new.num_bytes
        while len(chains) > CHAINS_PER_HEAD:
            self.num_bytes -= chains.pop().num_bytes
        while self.num_bytes > self.max_bytes and self._heads:
            _, evicted = self._heads.popitem(last=False)
            self.num_bytes -= sum(c.num_bytes for c in evicted)


def _shared_pages(cached: bytes, data: bytes, page_bytes: int) -> int:
    """How many whole pages `cached` and `data` share from the start."""
    n = min(len(cached), len(data))
    if data.startswith(cached) or cached.startswith(data):
        return n // page_bytes
    n_pages = n // page_bytes
    a = np.frombuffer(cached, np.uint8, n_pages * page_bytes).reshape(n_pages, page_bytes)
    b = np.frombuffer(data, np.uint8, n_pages * page_bytes).reshape(n_pages, page_bytes)
    return int(np.argmax((a != b).any(axis=1)))  # some page differs: startswith failed


def chain_digests(parent: bytes, data: bytes, page_size: int) -> bytes:
    """The chained digests of `data`'s pages (whole pages of uint32 token ids) after `parent`."""
    ids = TokenIds("I")
    ids.frombytes(data)
    return b"".join(chain_hashes(parent, ids, page_size))
