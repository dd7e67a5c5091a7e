"""P/D between real engine processes over a real nats-server, the test playing the router.

Decode admits and answers decode_prefix_len; prefill sends exactly the KV past it in
checksummed frames; decode streams tokens equal to a cold run. Corrupt frames are resent;
a prefill that dies mid-transfer makes decode time out and release its pages.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from types import SimpleNamespace

import nats
import pytest
import torch
from bus_helpers import next_chunk, next_state, spawn_engine, wait_heartbeats
from nats.aio.client import Client as NATS

from bus_schemas import (
    DecodeAdmit,
    DecodeAdmitReply,
    KVChunkAck,
    PrefillRequest,
    Sampling,
    StatsReply,
    StatsRequest,
    StreamCheck,
    TokenChunk,
)
from bus_schemas import subjects as subj
from bus_schemas.kv_frame import HEADER_SIZE
from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.scheduler.request import CachedTokens, KVExport
from services.engine.pd import PDConfig
from services.engine.pd_prefill import PrefillSide
from services.launch.servers import ServerProcess

PAGE = 4
COMMON = [
    "--model",
    "tiny",
    "--page-size",
    str(PAGE),
    "--max-total-tokens",
    "2048",
    "--heartbeat-interval",
    "0.2",
    "--disaggregation-frame-bytes",
    str(HEADER_SIZE + 3 * PAGE * 2048),  # 3 pages a frame: tiny's KV is 2,048 bytes a token
    "--disaggregation-window",
    "2",
]


def spawn(nats_url: str, engine_id: str, *flags: str) -> subprocess.Popen[bytes]:
    return spawn_engine(nats_url, engine_id, *COMMON, *flags)


@pytest.fixture(scope="module")
def engines(nats_server: ServerProcess) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    procs = {
        "pd-prefill": spawn(
            nats_server.url,
            "pd-prefill",
            "--disaggregation-mode",
            "prefill",
            "--enable-hierarchical-cache",
        ),
        "pd-decode": spawn(
            nats_server.url,
            "pd-decode",
            "--disaggregation-mode",
            "decode",
            "--disaggregation-decode-enable-radix-cache",
            "--enable-hierarchical-cache",
        ),
        "pd-decode-off": spawn(nats_server.url, "pd-decode-off", "--disaggregation-mode", "decode"),
        "pd-prefill-bad": spawn(
            nats_server.url,
            "pd-prefill-bad",
            "--disaggregation-mode",
            "prefill",
            "--debug-corrupt-kv-frames",
            "2",
        ),
    }
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


@pytest.fixture
async def nc(nats_server: ServerProcess) -> AsyncIterator[NATS]:
    client = await nats.connect(nats_server.url)
    yield client
    await client.drain()


async def wait_engines(nc: NATS, ids: set[str]) -> None:
    await wait_heartbeats(nc, ids)


async def pd_generate(
    nc: NATS,
    prefill: str,
    decode: str,
    prompt: list[int],
    max_new: int,
    reuse: bool = True,
    timeout_s: float = 30.0,
    asks: int = 1,
    chunk_timeout_s: float = 60.0,
) -> tuple[DecodeAdmitReply, list[TokenChunk]]:
    """One P/D request; `asks` > 1 sends its DecodeAdmit that many times at once, as a router
    asks again after a NATS reconnect, and checks that every answer is the same."""
    rid = uuid.uuid4().hex
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    sampling = Sampling(max_new, ignore_eos=True)
    admit = DecodeAdmit(rid, prompt, sampling, inbox, "", reuse, timeout_s).encode()
    subject = subj.engine_decode_admit(decode)
    msgs = await asyncio.gather(*(nc.request(subject, admit, timeout=30) for _ in range(asks)))
    assert len({m.data for m in msgs}) == 1, [m.data for m in msgs]
    reply = DecodeAdmitReply.decode(msgs[0].data)
    assert reply.error is None, reply.error
    req = PrefillRequest(
        rid, prompt, sampling, "", reply.decode_prefix_len, reply.kv_subject, inbox
    )
    await nc.publish(subj.engine_prefill(prefill), req.encode())
    chunks = []
    while True:
        chunk = await next_chunk(sub, chunk_timeout_s)
        chunks.append(chunk)
        if chunk.finished:
            break
    await sub.unsubscribe()
    return reply, chunks


def cold(prompt: list[int], max_new: int) -> list[int]:
    eng = Engine(EngineConfig(cache=CacheConfig(page_size=PAGE, enable_radix_cache=False)))
    sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    return eng.generate(prompt, sp).output_ids


async def stats(nc: NATS, engine_id: str) -> dict[str, int]:
    msg = await nc.request(subj.engine_stats(engine_id), StatsRequest().encode(), timeout=10)
    return StatsReply.decode(msg.data).stats


async def test_turns_reuse_decode_cache_and_move_only_the_suffix(
    engines: dict[str, subprocess.Popen[bytes]], nc: NATS
) -> None:
    await wait_engines(nc, {"pd-prefill", "pd-decode"})
    turn1 = list(range(30, 71))  # 41 tokens
    turn2 = [*turn1, *range(100, 117)]  # 58 tokens
    for turn, prompt in enumerate((turn1, turn2)):
        reply, chunks = await pd_generate(nc, "pd-prefill", "pd-decode", prompt, 6)
        first = chunks[0]
        assert [t for c in chunks for t in c.token_ids] == cold(prompt, 6)
        assert first.decode_prefix_len == reply.decode_prefix_len
        assert first.transferred_tokens == len(prompt) - reply.decode_prefix_len
        assert first.prefill_engine_id == "pd-prefill"
        if turn == 0:
            assert reply.decode_prefix_len == 0
        else:  # turn 1's prompt, all but its last token, page-aligned: 40
            assert reply.decode_prefix_len == 40
            assert first.prefill_cached_device == 40


async def test_reuse_off_moves_everything_and_returns_every_page(
    engines: dict[str, subprocess.Popen[bytes]], nc: NATS
) -> None:
    await wait_engines(nc, {"pd-prefill", "pd-decode-off"})
    prompt = list(range(1, 46))
    for _ in range(2):
        reply, chunks = await pd_generate(nc, "pd-prefill", "pd-decode-off", prompt, 4)
        assert reply.decode_prefix_len == 0
        assert chunks[0].transferred_tokens == len(prompt)
        assert [t for c in chunks for t in c.token_ids] == cold(prompt, 4)
    s = await stats(nc, "pd-decode-off")
    assert s["device_pages_free"] == s["device_pages"]


async def test_an_admit_asked_again_gets_the_same_answer_and_admits_once(
    engines: dict[str, subprocess.Popen[bytes]], nc: NATS
) -> None:
    """The router asks again when NATS reconnected while it waited for the answer: the
    decode engine answers every copy alike, admits the request once (all its pages come
    back after one request), and refuses the id under another reply subject."""
    await wait_engines(nc, {"pd-prefill", "pd-decode-off"})
    prompt = list(range(3, 40))
    _, chunks = await pd_generate(nc, "pd-prefill", "pd-decode-off", prompt, 3, asks=3)
    assert [t for c in chunks for t in c.token_ids] == cold(prompt, 3)
    s = await stats(nc, "pd-decode-off")
    assert s["device_pages_free"] == s["device_pages"]

    rid, sampling = uuid.uuid4().hex, Sampling(2, ignore_eos=True)
    subject = subj.engine_decode_admit("pd-decode-off")
    first = DecodeAdmit(rid, prompt, sampling, nc.new_inbox(), "", False, 1.0)
    other = DecodeAdmit(rid, prompt, sampling, nc.new_inbox(), "", False, 1.0)
    a = await nc.request(subject, first.encode(), timeout=30)
    b = await nc.request(subject, first.encode(), timeout=30)  # admitted by now: its answer
    c = DecodeAdmitReply.decode((await nc.request(subject, other.encode(), timeout=30)).data)
    assert a.data == b.data and DecodeAdmitReply.decode(a.data).error is None
    assert c.error_code == 400 and "duplicate request id" in (c.error or "")
    for _ in range(50):  # no KV comes: it times out after 1 s and gives its pages back
        s = await stats(nc, "pd-decode-off")
        if s["device_pages_free"] == s["device_pages"]:
            break
        await asyncio.sleep(0.1)
    assert s["device_pages_free"] == s["device_pages"]


async def test_prefill_answers_stream_checks_for_delivered_requests(
    engines: dict[str, subprocess.Popen[bytes]], nc: NATS
) -> None:
    """A router that reconnected asks the prefill engine whether it got a request: one whose
    KV it delivered is held (not lost), an unknown one or another reply subject is not."""
    await wait_engines(nc, {"pd-prefill", "pd-decode-off"})
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    prompt = list(range(7, 30))
    rid = uuid.uuid4().hex
    sampling = Sampling(2, ignore_eos=True)
    admit = DecodeAdmit(rid, prompt, sampling, inbox, "", False, 30.0)
    msg = await nc.request(subj.engine_decode_admit("pd-decode-off"), admit.encode(), timeout=30)
    reply = DecodeAdmitReply.decode(msg.data)
    watch = nc.new_inbox()
    watch_sub = await nc.subscribe(watch)
    req = PrefillRequest(rid, prompt, sampling, "", 0, reply.kv_subject, watch)
    await nc.publish(subj.engine_prefill("pd-prefill"), req.encode())
    while not (await next_chunk(sub)).finished:
        pass
    held = {}
    for name, (request_id, reply_to) in {
        "delivered": (rid, watch),
        "other reply subject": (rid, inbox),
        "unknown": (uuid.uuid4().hex, watch),
    }.items():
        check = StreamCheck(request_id, reply_to)
        await nc.publish(subj.engine_stream_check("pd-prefill"), check.encode())
        state = await next_state(watch_sub if reply_to == watch else sub, 10)
        held[name] = state.held
    assert held == {"delivered": True, "other reply subject": False, "unknown": False}
    await sub.unsubscribe()
    await watch_sub.unsubscribe()


async def test_a_copy_of_a_written_frame_is_acked_again(
    engines: dict[str, subprocess.Popen[bytes]], nc: NATS
) -> None:
    """After a NATS reconnect the prefill engine sends its unACKed frames again: the
    decode engine ACKs a copy of a frame it wrote instead of refusing it (which would end
    the transfer after three refusals), and the output is still the cold run's."""
    await wait_engines(nc, {"pd-prefill", "pd-decode-off"})
    prompt, max_new = list(range(11, 40)), 64
    rid, inbox = uuid.uuid4().hex, nc.new_inbox()
    sub = await nc.subscribe(inbox)
    sampling = Sampling(max_new, ignore_eos=True)
    admit = DecodeAdmit(rid, prompt, sampling, inbox, "", False, 30.0)
    msg = await nc.request(subj.engine_decode_admit("pd-decode-off"), admit.encode(), timeout=30)
    reply = DecodeAdmitReply.decode(msg.data)
    frames = await nc.subscribe(reply.kv_subject)  # a copy of every frame the decode gets
    req = PrefillRequest(rid, prompt, sampling, "", 0, reply.kv_subject, nc.new_inbox())
    await nc.publish(subj.engine_prefill("pd-prefill"), req.encode())
    chunks = [(await next_chunk(sub))]  # every frame written
    first = await frames.next_msg(timeout=10)
    ack = await nc.request(reply.kv_subject, first.data, timeout=10)
    assert KVChunkAck.decode(ack.data).ok, KVChunkAck.decode(ack.data).error
    while not chunks[-1].finished:
        chunks.append(await next_chunk(sub))
    assert [t for c in chunks for t in c.token_ids] == cold(prompt, max_new)
    await frames.unsubscribe()
    await sub.unsubscribe()


async def test_corrupt_frames_are_resent(
    engines: dict[str, subprocess.Popen[bytes]], nc: NATS
) -> None:
    await wait_engines(nc, {"pd-prefill-bad", "pd-decode-off"})
    prompt = list(range(60, 100))
    _, chunks = await pd_generate(nc, "pd-prefill-bad", "pd-decode-off", prompt, 3)
    assert [t for c in chunks for t in c.token_ids] == cold(prompt, 3)
    assert chunks[0].transferred_tokens == len(prompt)
    s = await stats(nc, "pd-decode-off")  # no reuse on this decode: every page comes back
    assert s["device_pages_free"] == s["device_pages"]


async def test_prefill_dying_mid_transfer_times_out_and_releases(
    nats_server: ServerProcess, engines: dict[str, subprocess.Popen[bytes]], nc: NATS
) -> None:
    dying = spawn(
        nats_server.url,
        "pd-prefill-dies",
        "--disaggregation-mode",
        "prefill",
        "--debug-exit-after-kv-frames",
        "1",
    )
    try:
        await wait_engines(nc, {"pd-prefill-dies", "pd-decode-off"})
        before = await stats(nc, "pd-decode-off")
        prompt = list(range(5, 60))  # 55 tokens: 14 pages, 5 frames of 3 pages
        reply, chunks = await pd_generate(
            nc, "pd-prefill-dies", "pd-decode-off", prompt, 3, timeout_s=1.5
        )
        assert reply.decode_prefix_len == 0
        assert chunks[-1].error and chunks[-1].error_code == 503
        assert "timed out" in chunks[-1].error
        assert await asyncio.to_thread(dying.wait, 30) == 1
        for _ in range(50):
            after = await stats(nc, "pd-decode-off")
            if after["device_pages_free"] == before["device_pages_free"]:
                break
            await asyncio.sleep(0.1)
        assert after["device_pages_free"] == before["device_pages_free"]
    finally:
        if dying.poll() is None:
            dying.kill()


async def test_a_prefill_longer_than_the_transfer_timeout_is_waited_for(
    nats_server: ServerProcess, nc: NATS
) -> None:
    """A 4K-token prompt of SmolLM2-sized KV takes the prefill engine seconds on a CPU, more
    than the 2 s the decode engine is told to wait for KV: the prefill engine's `Progress` on
    the KV subject (once per heartbeat interval while it computes) keeps the transfer alive,
    where the decode engine used to give up before the first frame."""
    model = ("--model", "tiny-smollm2-kv", "--max-total-tokens", "8192", "--page-size", "16")
    model += ("--heartbeat-interval", "0.2")
    procs = [
        spawn_engine(nats_server.url, "kv-prefill", *model, "--disaggregation-mode", "prefill"),
        spawn_engine(nats_server.url, "kv-decode", *model, "--disaggregation-mode", "decode"),
    ]
    try:
        await wait_engines(nc, {"kv-prefill", "kv-decode"})
        prompt = [(7 * i + 3) % 256 for i in range(4000)]
        reply, chunks = await pd_generate(
            nc, "kv-prefill", "kv-decode", prompt, 2, timeout_s=2.0, chunk_timeout_s=300
        )
        assert chunks[-1].error is None, chunks[-1].error
        assert chunks[0].transferred_tokens == len(prompt) and reply.decode_prefix_len == 0
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(30)


async def test_prefill_sends_unacked_frames_again_after_a_nats_reconnect() -> None:
    """Frames (or their ACKs) lost while NATS reconnected: at the reconnect the prefill
    side sends its unACKed frames again, every `RESEND_S` until ACKed, instead of failing
    the transfer after `ack_timeout_s` (the fault matrix saw 10 s waits end in 503s)."""
    sent: list[bytes] = []
    closed: list[str] = []

    async def publish(subject: str, data: bytes, reply: str = "") -> None:
        sent.append(data)  # the first two are lost: no ACK ever comes for them

    def fail(request_id: str, message: str, code: int, crashed: bool = False) -> None:
        raise AssertionError(f"the transfer failed: {message}")

    config = PDConfig(frame_bytes=HEADER_SIZE + 4096, window=2, ack_timeout_s=30.0)
    side = PrefillSide(
        "p",
        None,  # type: ignore[arg-type]
        publish,
        config,
        lambda *a: None,
        fail,
        closed.append,
        max_payload=lambda: 1 << 20,
    )
    rid = uuid.uuid4().hex
    req = PrefillRequest(rid, list(range(8)), Sampling(1), "", 0, "kv", "watch")
    side.track(req)
    export = KVExport((torch.zeros(2, 1, 1, 2, 4, 1, 128),), 0, 8, 5)  # 2 pages of 4 KiB: 2 frames
    side.exported(rid, export, CachedTokens())

    async def until(pred: Callable[[], bool]) -> None:
        while not pred():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(until(lambda: len(sent) == 2), 5)
    side.reconnected()
    await asyncio.wait_for(until(lambda: len(sent) >= 4), 5)  # both again at once...
    assert sent[2:4] == sent[:2]
    await asyncio.wait_for(until(lambda: len(sent) >= 6), 5)  # ...and after RESEND_S
    for seq in (0, 1):
        ack = KVChunkAck(rid, seq, True, "")
        await side.on_ack(SimpleNamespace(data=ack.encode()))  # type: ignore[arg-type]
    await asyncio.wait_for(until(lambda: bool(closed)), 5)
    assert closed == [rid] and side.delivered(rid, "watch") and rid not in side.jobs
