"""P/D KV frames sized in bytes (issue 19, defect 1): cut from what the NATS server allows,
put back together on the decode side, bounded in flight; a frame that cannot be sent fails
its transfer at once, naming the cause.

SmolLM2-135M's KV is 46,080 bytes a token (30 layers x 3 KV heads x 64 x K,V x float32): the
fixed 16 pages of 16 tokens a frame the engine used to send were 11.8 MB, over NATS's 8 MiB.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Callable

import nats
import pytest
import torch

from bus_schemas import KVChunkAck, PrefillRequest, Sampling
from bus_schemas.kv_frame import HEADER_SIZE, KVFrameHeader, decode_frame
from gpu_worker.scheduler.request import CachedTokens, KVExport
from services.engine.pd import PDConfig
from services.engine.pd_frames import (
    ByteWindow,
    FrameSizeError,
    ShardAssembler,
    cut_frames,
    payload_limit,
)
from services.engine.pd_prefill import PrefillSide
from services.launch.servers import nats_kind, start_server

SMOLLM2_TOKEN_BYTES = 30 * 3 * 64 * 2 * 4


def export_of(
    page_size: int, num_pages: int, token_bytes: int, num_ranks: int = 1, seed: int = 0
) -> KVExport:
    """An export of `num_pages` pages, each rank holding `token_bytes / num_ranks` bytes a
    token (float32 noise, so every byte's place is checked), the last page half full."""
    gen = torch.Generator().manual_seed(seed)
    per_rank = token_bytes // 4 // num_ranks  # float32 elements a token, per rank
    stagings = tuple(
        torch.rand((num_pages, 1, 1, 1, page_size, 1, per_rank), generator=gen)
        for _ in range(num_ranks)
    )
    end = (num_pages - 1) * page_size + page_size // 2
    return KVExport(stagings, 0, end, 42, tuple(range(num_ranks)), num_ranks)


def reassemble(frames: list[bytes], shuffle: bool) -> dict[int, list[bytes]]:
    """Each rank's shards, chunk by chunk, as the decode side puts them together."""
    decoded = [decode_frame(f) for f in frames]
    if shuffle:
        random.Random(3).shuffle(decoded)
    assembler = ShardAssembler()
    whole: dict[tuple[int, int, int], bytes] = {}
    for header, payload in decoded:
        shard = assembler.add(header, payload)
        if shard is not None:
            whole[(header.rank, header.token_start, header.token_end)] = bytes(shard)
            assembler.written(header)
    assert assembler.held_bytes == 0
    out: dict[int, list[bytes]] = {}
    for (rank, _, _), shard in sorted(whole.items()):
        out.setdefault(rank, []).append(shard)
    return out


@pytest.mark.parametrize(
    ("page_size", "max_payload", "num_ranks"),
    [(16, 8 << 20, 1), (256, 8 << 20, 1), (64, 1 << 20, 2), (16, 1 << 20, 1)],
    ids=["page16-8MiB", "page256-8MiB-split", "page64-1MiB-TP2-split", "page16-1MiB"],
)
@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffled"])
def test_frames_fit_the_server_and_decode_gets_every_byte_back(
    page_size: int, max_payload: int, num_ranks: int, shuffle: bool
) -> None:
    export = export_of(page_size, 5, SMOLLM2_TOKEN_BYTES, num_ranks)
    limit = payload_limit(max_payload, num_ranks, 32 << 20)
    plan = cut_frames("r", export, CachedTokens(3, 2, 1), num_ranks, limit)
    assert all(len(f) <= max_payload for f in plan.frames)
    assert sum(plan.units) == len(plan.frames)
    page_bytes = page_size * SMOLLM2_TOKEN_BYTES // num_ranks
    assert plan.pages_per_chunk == max(1, (max_payload - HEADER_SIZE) // page_bytes)
    split = page_bytes > max_payload - HEADER_SIZE  # one page's shard over the limit
    num_chunks = -(-5 // plan.pages_per_chunk)
    assert split == (len(plan.frames) > num_chunks * num_ranks)
    headers = [decode_frame(f)[0] for f in plan.frames]
    assert [h.seq for h in headers] == list(range(len(plan.frames)))
    assert all(h.last == (h.token_end == export.token_end) for h in headers)
    assert {h.first_token for h in headers if h.last} == {42}
    assert {(h.prefill_cached_device, h.prefill_cached_storage) for h in headers} == {(3, 1)}
    # each unit of several frames is a chunk's last part of every rank
    seq = 0
    for size in plan.units:
        unit = headers[seq : seq + size]
        if size > 1:
            assert [h.rank for h in unit] == list(range(num_ranks))
            assert all(
                h.part_offset + (len(plan.frames[h.seq]) - HEADER_SIZE) == h.shard_len for h in unit
            )
        seq += size
    shards = reassemble(plan.frames, shuffle)
    for rank, staging in enumerate(export.stagings):
        per = plan.pages_per_chunk
        want = [staging[lo : lo + per].numpy().tobytes() for lo in range(0, 5, per)]
        assert shards[rank] == want


def test_smollm2s_kv_in_the_old_16_page_frames_is_over_nats_8_mib() -> None:
    """What broke: 16 pages of 16 tokens of SmolLM2's KV in one frame."""
    assert 16 * 16 * SMOLLM2_TOKEN_BYTES > 8 << 20
    limit = payload_limit(8 << 20, 1, 32 << 20)
    plan = cut_frames("r", export_of(16, 16, SMOLLM2_TOKEN_BYTES), CachedTokens(), 1, limit)
    assert max(len(f) for f in plan.frames) <= 8 << 20 and plan.pages_per_chunk == 11


def test_the_limit_takes_the_smallest_of_server_cap_and_window() -> None:
    assert payload_limit(8 << 20, 1, 32 << 20) == (8 << 20) - HEADER_SIZE
    assert payload_limit(8 << 20, 8, 32 << 20) == (4 << 20) - HEADER_SIZE  # 8 last parts fit
    with pytest.raises(FrameSizeError, match="cannot carry"):
        payload_limit(HEADER_SIZE + 100, 1, 32 << 20)


def test_the_assembler_refuses_parts_that_do_not_fit() -> None:
    assembler = ShardAssembler()
    part = KVFrameHeader("r", 0, 0, 16, part_offset=0, shard_len=10)
    assert assembler.add(part, memoryview(b"abcdef")) is None
    assert assembler.add(part, memoryview(b"abcdef")) is None  # a copy: nothing changes
    with pytest.raises(ValueError, match="overlaps"):
        assembler.add(KVFrameHeader("r", 1, 0, 16, part_offset=4, shard_len=10), memoryview(b"xy"))
    with pytest.raises(ValueError, match="12 bytes in one part, 10 in another"):
        assembler.add(KVFrameHeader("r", 1, 0, 16, part_offset=6, shard_len=12), memoryview(b"x"))
    rest = KVFrameHeader("r", 2, 0, 16, part_offset=6, shard_len=10)
    assert bytes(assembler.add(rest, memoryview(b"ghij")) or b"") == b"abcdefghij"
    # a copy of the last part (its write failed, prefill sends it again) gives it again
    assert bytes(assembler.add(rest, memoryview(b"ghij")) or b"") == b"abcdefghij"
    assembler.written(rest)
    assert assembler.held_bytes == 0


async def test_the_byte_window_holds_transfers_to_its_bytes() -> None:
    window = ByteWindow(100)
    assert window.try_take(60) and not window.try_take(50) and window.try_take(40)
    waiting = asyncio.create_task(window.take(70))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    window.release(60)
    await asyncio.sleep(0.01)
    assert not waiting.done()  # 40 + 70 > 100
    window.release(40)
    await asyncio.wait_for(waiting, 5)
    assert window.used == 70
    window.release(70)
    assert window.try_take(500) and window.used == 500  # too big for any window: alone


def side_for(
    publish: Callable[..., object],
    config: PDConfig,
    failed: list[tuple[str, str, int]],
    closed: list[str],
    max_payload: Callable[[], int],
) -> PrefillSide:
    def fail(request_id: str, message: str, code: int, crashed: bool = False) -> None:
        failed.append((request_id, message, code))

    return PrefillSide(
        "prefill-x",
        None,  # type: ignore[arg-type]
        publish,  # type: ignore[arg-type]
        config,
        lambda *a: None,
        fail,
        closed.append,
        max_payload=max_payload,
    )


async def test_frames_in_flight_stay_within_the_byte_window() -> None:
    """Frames of 64 KiB, a window of 8 frames but 200 KiB: 3 frames go out before an ACK,
    one more per ACK, and every byte comes back to the window at the end."""
    sent: list[bytes] = []

    async def publish(subject: str, data: bytes, reply: str = "") -> None:
        sent.append(data)

    failed: list[tuple[str, str, int]] = []
    closed: list[str] = []
    config = PDConfig(frame_bytes=HEADER_SIZE + 65536, window=8, window_bytes=200 * 1024)
    side = side_for(publish, config, failed, closed, lambda: 8 << 20)
    rid = uuid.uuid4().hex
    side.track(PrefillRequest(rid, [1] * 40, Sampling(1), "", 0, "kv", "w"))
    export = export_of(4, 10, 16384)  # 64 KiB pages: one a frame
    side.exported(rid, export, CachedTokens())
    for acked in range(10):
        for _ in range(100):
            if len(sent) == min(10, acked + 3):
                break
            await asyncio.sleep(0.01)
        assert len(sent) == min(10, acked + 3)
        assert side.window.used <= 200 * 1024
        header, _ = decode_frame(sent[acked])
        ack = KVChunkAck(rid, header.seq, True, "").encode()
        await side.on_ack(_Msg(ack))  # type: ignore[arg-type]
    for _ in range(100):
        if closed:
            break
        await asyncio.sleep(0.01)
    assert closed == [rid] and not failed and side.window.used == 0


async def test_a_frame_the_server_refuses_fails_the_transfer_at_once() -> None:
    """A server whose max_payload is below what the engine believes (as after a reconnect to
    another server): the real client refuses the frame with MaxPayloadError, and the
    transfer fails now with a message naming it, instead of an unretrieved task exception
    and a decode engine waiting out its transfer timeout."""
    server = start_server(nats_kind(64 * 1024))
    nc = await nats.connect(server.url)
    try:
        assert nc.max_payload == 64 * 1024

        async def publish(subject: str, data: bytes, reply: str = "") -> None:
            await nc.publish(subject, data, reply=reply)

        failed: list[tuple[str, str, int]] = []
        closed: list[str] = []
        # frames planned for 1 MiB (the INFO of the server before), sent to this one
        planned = [1 << 20]
        side = side_for(
            publish,
            PDConfig(),
            failed,
            closed,
            lambda: planned.pop() if planned else nc.max_payload,
        )
        rid = uuid.uuid4().hex
        req = PrefillRequest(rid, [1] * 40, Sampling(1), "", 0, "hicache.engine.d.kv", "w")
        side.track(req)
        side.exported(rid, export_of(4, 10, 16384), CachedTokens())  # 64 KiB pages
        for _ in range(200):
            if failed:
                break
            await asyncio.sleep(0.01)
        ((request_id, message, code),) = failed
        assert request_id == rid and code == 502 and not closed
        assert "KV transfer to decode failed" in message and "MaxPayloadError" in message
        assert "max_payload is 65,536 bytes" in message, message
        await side.stop()
        assert side.window.used == 0 and not side.jobs
    finally:
        await nc.close()
        server.stop()


class _Msg:
    def __init__(self, data: bytes) -> None:
        self.data = data
