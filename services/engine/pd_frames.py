"""KV frames of one P/D transfer, sized in bytes: how prefill cuts them (`cut_frames`), how
decode puts a shard back together (`ShardAssembler`), and the bytes a prefill engine keeps in
flight (`ByteWindow`).

The NATS server refuses a message larger than its `max_payload`, which it announces in its
INFO (nats-py keeps it as `Client.max_payload`: 1 MiB for a server with no configuration, 8
MiB for the one `hicache-mesh up` starts). So frames are sized in bytes, whatever the model,
dtype, page size or layout: at most `frame_limit` bytes, header included (`HEADER_SIZE`).

A transfer moves `num_pages` pages; each sending rank holds its shard of every page (its KV
heads and layers), or under sharded CP of the pages its CP rank owns (every `cp_size`-th).
A chunk is a run of whole pages: as many as the largest rank's shard of them fits one
frame's payload, at least one (under sharded CP, `cp_size` times that: a rank holds one page
in `cp_size`, so its frames are as full as a CP1 engine's). A rank that owns none of a
chunk's pages sends no frame for it; the decode side derives which ranks' shards make the
chunk from the layout and rotation in its frames (`bus_schemas.kv_frame.chunk_senders`). A rank's shard of a chunk goes out in parts of
at most `payload_limit` bytes: one part, unless a single page's shard is over the limit (a big
page, many layers, a small server limit); the decode side then holds the parts and writes the
shard once it is whole.

Decode ACKs a part once it holds it, and a shard's last part once the chunk is written, which
waits for every rank's last part. So within a chunk every rank's earlier parts go first, then
the last parts of all ranks, which travel as one unit. A prefill engine's transfers share one
`ByteWindow`; a transfer takes window bytes for a whole unit before sending it, so every byte
it holds is released by ACKs that need nothing more from it, and transfers never wait on each
other's frames: no deadlock, and at most `window_bytes` in flight per prefill engine (a
subscriber's pending-bytes limit and the server's slow-consumer limit drop a fast publisher's
big messages: the window keeps well below both).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from bus_schemas.kv_frame import HEADER_SIZE, KVFrameHeader, draft_digest, encode_frame
from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.scheduler.request import CachedTokens, KVExport

MIN_PAYLOAD = 1024  # a frame carries at least this many KV bytes


class FrameSizeError(ValueError):
    """No frame fits: the server's limit is smaller than a header and `MIN_PAYLOAD`."""


def payload_limit(frame_limit: int, num_ranks: int, window_bytes: int) -> int:
    """KV bytes one frame may carry: within `frame_limit` (the server's `max_payload`, or a
    smaller cap), and small enough that one unit (a chunk's last part of each of the
    `num_ranks` sending ranks) fits `window_bytes`."""
    limit = min(frame_limit, window_bytes // max(1, num_ranks)) - HEADER_SIZE
    if limit < MIN_PAYLOAD:
        raise FrameSizeError(
            f"KV frames of at most {frame_limit:,} bytes ({num_ranks} ranks in a window of "
            f"{window_bytes:,} bytes) cannot carry {MIN_PAYLOAD} bytes of KV past their "
            f"{HEADER_SIZE}-byte header"
        )
    return limit


@dataclass(frozen=True, slots=True)
class FramePlan:
    """A transfer's frames in sending order (frame i has seq i), in units sent together."""

    frames: list[bytes]
    units: list[int]  # frames per unit, in order (they sum to len(frames))
    num_ranks: int  # sending ranks: a unit holds up to this many frames
    pages_per_chunk: int

    def unit_bytes(self, first_seq: int, size: int) -> int:
        return sum(len(f) for f in self.frames[first_seq : first_seq + size])


def cut_frames(
    request_id: str,
    export: KVExport,
    cached: CachedTokens,
    tp_size: int,
    limit: int,
) -> FramePlan:
    """The frames of `export` with payloads of at most `limit` bytes (`payload_limit`): chunk
    by chunk, one shard per exporting rank (each rank's heads and layers of the chunk, MLA's
    replicated latent once per stage; a decode engine of any layout cuts its ranks' shards
    from them; under sharded CP only the ranks owning a page of the chunk, each with its
    pages), a shard over `limit` in parts."""
    page_bytes = max(export.page_bytes(i) for i in range(len(export.stagings)))
    cp = export.cp_size
    per = max(1, limit // page_bytes) * cp  # sharded: a rank holds `per // cp` pages of it
    ps, num_pages = export.page_size, export.num_pages
    frames: list[bytes] = []
    units: list[int] = []
    for lo in range(0, num_pages, per):
        hi = min(lo + per, num_pages)
        last = hi == num_pages
        parts = []  # (rank, shard, offset) per part, by rank
        for i, rank in enumerate(export.ranks):
            rows = export.shard_rows(i, lo, hi)
            if rows.start >= rows.stop:  # a CP rank owning none of the chunk's pages
                continue
            shard = memoryview(export.shard_bytes(i, rows))  # with a draft: its rows too
            parts.append([(rank, shard, off) for off in range(0, len(shard), limit)])
        # every rank's earlier parts one by one, then the last parts of all ranks as one unit
        order = [p for rank_parts in parts for p in rank_parts[:-1]]
        units += [1] * len(order)
        order += [rank_parts[-1] for rank_parts in parts]
        units.append(len(parts))
        for rank, shard, off in order:
            header = KVFrameHeader(
                request_id,
                len(frames),
                export.token_start + lo * ps,
                min(export.token_start + hi * ps, export.token_end),
                export.first_token if last else -1,
                last,
                cached.device,
                cached.host,
                rank,
                export.world_size,
                tp_size,
                cached.storage,
                off,
                len(shard),
                cp,
                (export.rotation + lo) % cp,
                draft_digest(export.draft),
            )
            frames.append(encode_frame(header, shard[off : off + limit]))
    return FramePlan(frames, units, len(export.stagings), per)


def sender_layout(header: KVFrameHeader) -> ParallelConfig:
    """The sending engine's KV layout as a frame names it: its TP x CP x PP ranks, its pages
    sharded over the CP ranks when there are more than one (a replicated CP engine sends as
    its CP1 layout), so a decode engine of any layout cuts its ranks' shards from them."""
    cp = header.cp_size
    return ParallelConfig(header.tp_size, header.pp_size, cp, kv_sharding=cp > 1)


@dataclass(slots=True)
class _Shard:
    data: bytearray
    parts: dict[int, int] = field(default_factory=dict)  # offset -> length held
    held: int = 0


class ShardAssembler:
    """Decode side: the parts of each rank's shard of each chunk of one transfer, until whole.

    Parts of a shard come in any order and a part may come again (prefill resends after a
    NATS reconnect); a part that does not fit its shard is refused, changing nothing."""

    def __init__(self) -> None:
        self._shards: dict[tuple[int, int, int], _Shard] = {}

    def add(self, header: KVFrameHeader, payload: memoryview) -> memoryview | bytearray | None:
        """Hold one part: the whole shard once every part of it is held (a copy of a part
        of a whole shard gives it again: a write that failed may be tried again), else None.
        ValueError for a part that overlaps another or disagrees on the shard's length."""
        offset, size, total = header.part_offset, len(payload), header.shard_len
        if offset == 0 and size == total:
            return payload  # the common case: the whole shard in one frame
        key = _key(header)
        shard = self._shards.get(key)
        if shard is None:
            shard = self._shards[key] = _Shard(bytearray(total))
        if len(shard.data) != total:
            raise ValueError(
                f"KV shard of rank {header.rank} for [{header.token_start}, "
                f"{header.token_end}) is {total} bytes in one part, {len(shard.data)} in another"
            )
        if shard.parts.get(offset) != size:
            for start, length in shard.parts.items():
                if offset < start + length and start < offset + size:
                    raise ValueError(
                        f"KV part [{offset}, {offset + size}) overlaps [{start}, {start + length})"
                    )
            shard.data[offset : offset + size] = payload
            shard.parts[offset] = size
            shard.held += size
        return shard.data if shard.held == total else None

    def written(self, header: KVFrameHeader) -> None:
        """The shard of `header`'s part was written: its bytes go."""
        self._shards.pop(_key(header), None)

    @property
    def held_bytes(self) -> int:
        return sum(s.held for s in self._shards.values())


def _key(header: KVFrameHeader) -> tuple[int, int, int]:
    return header.token_start, header.token_end, header.rank


class ByteWindow:
    """KV bytes a prefill engine has sent and not yet had ACKed, over all its transfers (on
    the service's event loop). A transfer takes bytes for a unit before sending it and gives
    each frame's back at its ACK; a unit larger than the whole window goes alone."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._freed = asyncio.Event()

    def try_take(self, num_bytes: int) -> bool:
        if self.used and self.used + num_bytes > self.limit:
            return False
        self.used += num_bytes
        return True

    async def take(self, num_bytes: int) -> None:
        """Wait until `num_bytes` fit (other transfers' frames are ACKed), then take them."""
        while not self.try_take(num_bytes):
            self._freed.clear()
            await self._freed.wait()

    def release(self, num_bytes: int) -> None:
        self.used -= num_bytes
        assert self.used >= 0, "released more bytes than taken"
        self._freed.set()
