"""KV chunks on the bus: a binary frame with a small fixed header, then the KV bytes.

Header (little-endian, 100 bytes):
    magic b"HKV5" | request_id (32 bytes, ASCII, NUL-padded) | seq u32 | token_start u32 |
    token_end u32 | first_token i32 (-1 unless last) | last u8 | pad 3 | prefill_cached_device
    u32 | prefill_cached_host u32 | payload_len u32 | crc32 u32 | rank u16 | world_size u16 |
    tp_size u16 | cp_size u8 | rotation u8 | prefill_cached_storage u32 | part_offset u32 |
    shard_len u32 | draft u64
A rank's shard of a chunk is KV of tokens `[token_start, token_end)` in whole pages, in the
unified object order with one KV head per group (DESIGN.md 5): `(pages, kv_head, layer, K/V,
token_in_page, head_dim)` of the sending rank's heads and layers (MLA: one head, the latent
row, and no V plane; every TP rank of a stage sends the same one), in the engines' KV dtype;
the last page of a request may be partly filled. Both ends know the model's shapes from the
namespace they share. The receiver checks `crc32` before using anything.

A frame's payload is bytes `[part_offset, part_offset + payload_len)` of that shard of
`shard_len` bytes: the whole shard (offset 0, `shard_len == payload_len`), or one part of a
shard larger than the NATS server's `max_payload` allows in one message (a big page, or a
small limit), which the receiver puts back together before writing it
(`services/engine/pd_frames.py` cuts frames and reassembles shards).

A multi-rank prefill engine sends its ranks' shards of each chunk: `rank`'s own layers and KV
heads; `world_size`, `tp_size` and `cp_size` give the sender's TP x CP x PP layout, so a
decode engine of another layout can cut from the shards the heads and layers each of its
ranks holds. A sender whose KV is sharded by page over `cp_size` > 1 CP ranks
(`--enable-kv-cache-sharding`) sends each page from its owner only: page `i` of the chunk is
owned by CP rank `(rotation + i) % cp_size`, and a rank's shard holds the pages it owns, in
order (`owned_pages`). A rank that owns none of a chunk's pages sends no frame for it, so
the receiver derives from the header alone which ranks' shards make the chunk whole
(`chunk_senders`). A replicated CP engine sends as its CP1 layout (`cp_size` 1).

Speculative decoding: each page of a shard carries the draft model's rows after the target's
(the draft's heads and layers of the same page, `KVExport.shard_bytes`), so a chunk of whole
pages holds both; `draft` is the draft's digest (`draft_digest` of `Engine.draft_id`, 0
without a draft), and a decode engine refuses a chunk from a draft other than its own.

Versions: HKV4 had no draft field (a speculating decode engine would have read a target-only
shard); HKV3 had no CP fields (cp_size and rotation were reserved bytes): the magic changed
with them so that an HKV3 reader refuses a sharded sender's frames rather than take its CP
ranks for pipeline stages (a shard can have the size it expects and still be cut wrongly).
HKV2 had no parts (84 bytes); HKV1 another payload order. All are refused.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass

from bus_schemas.codec import SchemaError

MAGIC = b"HKV5"
_HEADER = struct.Struct("<4s32sIIIiB3xIIIIHHHBBIIIQ")
HEADER_SIZE = _HEADER.size


@dataclass(frozen=True, slots=True)
class KVFrameHeader:
    request_id: str
    seq: int
    token_start: int
    token_end: int
    first_token: int = -1
    last: bool = False
    prefill_cached_device: int = 0
    prefill_cached_host: int = 0
    rank: int = 0  # the sending rank: its shard of the chunk's KV
    world_size: int = 1  # ranks of the sending engine
    tp_size: int = 1  # of which per TP group (world_size // (tp_size * cp_size) stages)
    prefill_cached_storage: int = 0  # prompt tokens prefill read from external storage
    part_offset: int = 0  # where this frame's payload starts in the rank's shard
    shard_len: int = 0  # bytes of the rank's whole shard of the chunk (0: this payload's)
    cp_size: int = 1  # CP ranks the sender shards pages over (1: every rank holds every page)
    rotation: int = 0  # sharded CP: the CP rank that owns the chunk's first page
    draft: int = 0  # the speculative draft's digest (`draft_digest`); 0: no draft

    def __post_init__(self) -> None:
        if len(self.request_id.encode()) > 32:
            raise ValueError("request_id is longer than 32 bytes")
        if not 0 <= self.token_start <= self.token_end:
            raise ValueError("token range must satisfy 0 <= start <= end")
        if not 0 <= self.rank < self.world_size <= 0xFFFF:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world_size}")
        if self.tp_size < 1 or self.world_size % self.tp_size:
            raise ValueError(f"tp_size {self.tp_size} does not divide world {self.world_size}")
        if not 1 <= self.cp_size <= 0xFF or self.world_size % (self.tp_size * self.cp_size):
            raise ValueError(
                f"cp_size {self.cp_size} x tp_size {self.tp_size} does not divide world "
                f"{self.world_size}"
            )
        if not 0 <= self.rotation < self.cp_size:
            raise ValueError(f"rotation {self.rotation} is not a CP rank of {self.cp_size}")
        if not 0 <= self.part_offset <= 0xFFFFFFFF or not 0 <= self.shard_len <= 0xFFFFFFFF:
            raise ValueError("part_offset and shard_len must fit 32 bits")
        if not 0 <= self.draft < 1 << 64:
            raise ValueError("draft must be a 64-bit digest")

    @property
    def pp_size(self) -> int:
        return self.world_size // (self.tp_size * self.cp_size)

    @property
    def cp_rank(self) -> int:
        """The sending rank's CP rank (ranks are stage-major, TP innermost)."""
        return self.rank // self.tp_size % self.cp_size


def draft_digest(draft_id: str) -> int:
    """The 64-bit digest of a speculative draft's identity (`Engine.draft_id`) a frame
    carries; 0 for "" (no draft), never 0 for a draft."""
    if not draft_id:
        return 0
    return int.from_bytes(hashlib.blake2b(draft_id.encode(), digest_size=8).digest()) or 1


def owned_pages(num_pages: int, cp_size: int, rotation: int, cp_rank: int) -> range:
    """The pages (0-based, of a chunk or transfer of `num_pages` pages whose first page CP
    rank `rotation` owns) that CP rank `cp_rank` owns when pages go round-robin over
    `cp_size` ranks: every `cp_size`-th page from its first. All of them at `cp_size` 1."""
    return range((cp_rank - rotation) % cp_size, num_pages, cp_size)


def chunk_senders(num_pages: int, cp_size: int, rotation: int) -> list[int]:
    """The CP ranks that own at least one of a chunk's `num_pages` pages: the shards that
    make it whole (at `cp_size` 1, or with as many pages as ranks, every rank)."""
    return sorted((rotation + i) % cp_size for i in range(min(num_pages, cp_size)))


def encode_frame(header: KVFrameHeader, payload: bytes | memoryview) -> bytes:
    """The frame of `payload`: a part of `header.shard_len` bytes at `header.part_offset`, or
    the whole shard when `shard_len` is 0."""
    body = memoryview(payload).cast("B")
    shard_len = header.shard_len or len(body)
    if header.part_offset + len(body) > shard_len:
        raise ValueError(
            f"a part of {len(body)} bytes at {header.part_offset} overruns its shard of "
            f"{shard_len} bytes"
        )
    head = _HEADER.pack(
        MAGIC,
        header.request_id.encode(),
        header.seq,
        header.token_start,
        header.token_end,
        header.first_token,
        int(header.last),
        header.prefill_cached_device,
        header.prefill_cached_host,
        len(body),
        zlib.crc32(body),
        header.rank,
        header.world_size,
        header.tp_size,
        header.cp_size,
        header.rotation,
        header.prefill_cached_storage,
        header.part_offset,
        shard_len,
        header.draft,
    )
    return b"".join((head, body))  # one copy of the payload


def decode_frame(data: bytes) -> tuple[KVFrameHeader, memoryview]:
    """Parse and verify a frame; SchemaError for a bad magic (another version), length,
    checksum or part. The header's `shard_len` is as sent (never 0)."""
    if len(data) < HEADER_SIZE:
        raise SchemaError(f"KV frame of {len(data)} bytes is shorter than its header")
    (
        magic,
        rid,
        seq,
        start,
        end,
        first,
        last,
        cached_dev,
        cached_host,
        length,
        crc,
        rank,
        world,
        tp,
        cp,
        rotation,
        cached_storage,
        part_offset,
        shard_len,
        draft,
    ) = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise SchemaError(f"not a KV frame of this version (magic {magic!r}, want {MAGIC!r})")
    payload = memoryview(data)[HEADER_SIZE:]
    if len(payload) != length:
        raise SchemaError(f"KV frame payload is {len(payload)} bytes, header says {length}")
    if zlib.crc32(payload) != crc:
        raise SchemaError("KV frame checksum mismatch")
    if part_offset + length > shard_len:
        raise SchemaError(
            f"KV frame part [{part_offset}, {part_offset + length}) overruns its shard of "
            f"{shard_len} bytes"
        )
    try:
        header = KVFrameHeader(
            rid.rstrip(b"\0").decode(),
            seq,
            start,
            end,
            first,
            bool(last),
            cached_dev,
            cached_host,
            rank,
            world or 1,
            tp or 1,
            cached_storage,
            part_offset,
            shard_len,
            cp or 1,
            rotation,
            draft,
        )
    except (ValueError, UnicodeDecodeError) as e:
        raise SchemaError(f"bad KV frame header: {e}") from None
    return header, payload


def peek_request_id(data: bytes) -> str | None:
    """The request id of a frame without verifying it (to NACK a corrupt one)."""
    peeked = peek_ids(data)
    return None if peeked is None else peeked[0]


def peek_ids(data: bytes) -> tuple[str, int] | None:
    """(request_id, seq) of a frame without verifying its payload (to NACK a corrupt one)."""
    if len(data) < HEADER_SIZE or data[:4] != MAGIC:
        return None
    _, rid, seq, *_ = _HEADER.unpack_from(data)
    return rid.rstrip(b"\0").decode(errors="replace"), seq
