"""KV chunks on the bus: a binary frame with a small fixed header, then the KV bytes.

Header (little-endian, 84 bytes):
    magic b"HKV2" | request_id (32 bytes, ASCII, NUL-padded) | seq u32 | token_start u32 |
    token_end u32 | first_token i32 (-1 unless last) | last u8 | pad 3 | prefill_cached_device
    u32 | prefill_cached_host u32 | payload_len u32 | crc32 u32 | rank u16 | world_size u16 |
    tp_size u16 | reserved 2 | prefill_cached_storage u32
The payload holds KV of tokens `[token_start, token_end)` in whole pages, in the unified
object order with one KV head per group (DESIGN.md 5): `(pages, kv_head, layer, K/V,
token_in_page, head_dim)` of the sending rank's heads and layers (MLA: one head, the latent
row, and no V plane; every TP rank of a stage sends the same one), in the engines' KV dtype;
the last page of a request may be partly filled. Both ends know the model's shapes from the
namespace they share. The receiver checks `crc32` before writing anything.

A multi-rank prefill engine sends one frame per rank for each chunk: `rank`'s own layers
and KV heads; `world_size` and `tp_size` give the sender's TP x PP layout, so a decode engine
of another layout can cut from the frames the heads and layers each of its ranks holds.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from bus_schemas.codec import SchemaError

MAGIC = b"HKV2"
_HEADER = struct.Struct("<4s32sIIIiB3xIIIIHHH2xI")
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
    tp_size: int = 1  # of which per pipeline stage (world_size // tp_size stages)
    prefill_cached_storage: int = 0  # prompt tokens prefill read from external storage

    def __post_init__(self) -> None:
        if len(self.request_id.encode()) > 32:
            raise ValueError("request_id is longer than 32 bytes")
        if not 0 <= self.token_start <= self.token_end:
            raise ValueError("token range must satisfy 0 <= start <= end")
        if not 0 <= self.rank < self.world_size <= 0xFFFF:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world_size}")
        if self.tp_size < 1 or self.world_size % self.tp_size:
            raise ValueError(f"tp_size {self.tp_size} does not divide world {self.world_size}")

    @property
    def pp_size(self) -> int:
        return self.world_size // self.tp_size


def encode_frame(header: KVFrameHeader, payload: bytes | memoryview) -> bytes:
    body = bytes(payload)
    return (
        _HEADER.pack(
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
            header.prefill_cached_storage,
        )
        + body
    )


def decode_frame(data: bytes) -> tuple[KVFrameHeader, memoryview]:
    """Parse and verify a frame; SchemaError for a bad magic, length or checksum."""
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
        cached_storage,
    ) = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise SchemaError(f"not a KV frame (magic {magic!r})")
    payload = memoryview(data)[HEADER_SIZE:]
    if len(payload) != length:
        raise SchemaError(f"KV frame payload is {len(payload)} bytes, header says {length}")
    if zlib.crc32(payload) != crc:
        raise SchemaError("KV frame checksum mismatch")
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
