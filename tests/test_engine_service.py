"""The engine service as a real process on a real nats-server.

Tokens streamed over the bus equal the in-process engine's; KV events describe what the
tree holds; cache_salt isolates; abort, flush and SIGTERM behave.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator

import nats
import pytest
from bus_helpers import chunk_of, next_chunk, spawn_engine, wait_heartbeats
from nats.aio.client import Client as NATS

from bus_schemas import (
    AbortRequest,
    FlushReply,
    FlushRequest,
    GenerateRequest,
    Heartbeat,
    KVEventBatch,
    Sampling,
    SchemaError,
    StatsReply,
    StatsRequest,
    StreamCheck,
    StreamState,
    TokenChunk,
    page_hashes,
)
from bus_schemas import subjects as subj
from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from services.launch.servers import ServerProcess

PAGE = 4
ENGINE_FLAGS = [
    "--model",
    "tiny",
    "--page-size",
    str(PAGE),
    "--max-total-tokens",
    "1024",
    "--enable-hierarchical-cache",
    "--heartbeat-interval",
    "0.2",
]


def start_engine(nats_url: str, engine_id: str) -> subprocess.Popen[bytes]:
    return spawn_engine(nats_url, engine_id, *ENGINE_FLAGS)


@pytest.fixture(scope="module")
def engine_proc(nats_server: ServerProcess) -> Iterator[str]:
    proc = start_engine(nats_server.url, "svc-test")
    yield "svc-test"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


@pytest.fixture
async def nc(nats_server: ServerProcess) -> AsyncIterator[NATS]:
    client = await nats.connect(nats_server.url)
    yield client
    await client.drain()


async def wait_heartbeat(nc: NATS, engine_id: str) -> Heartbeat:
    return (await wait_heartbeats(nc, {engine_id}))[engine_id]


async def generate(
    nc: NATS, engine_id: str, ids: list[int], max_new: int, salt: str = ""
) -> list[TokenChunk]:
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    rid = uuid.uuid4().hex
    req = GenerateRequest(rid, ids, Sampling(max_new, ignore_eos=True), inbox, salt)
    await nc.publish(subj.engine_generate(engine_id), req.encode())
    chunks = []
    while True:
        chunk = await next_chunk(sub)
        chunks.append(chunk)
        if chunk.finished:
            break
    await sub.unsubscribe()
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    return chunks


def reference(prompts: list[list[int]], max_new: int) -> list[list[int]]:
    eng = Engine(EngineConfig(cache=CacheConfig(page_size=PAGE, enable_radix_cache=False)))
    sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    return [eng.generate(p, sp).output_ids for p in prompts]


async def test_streams_match_in_process_engine_and_cache_counts(engine_proc: str, nc: NATS) -> None:
    hb = await wait_heartbeat(nc, engine_proc)
    assert (hb.page_size, hb.vocab_size) == (PAGE, 260)
    prompt = list(range(10, 47))  # 37 tokens
    want = reference([prompt], 7)[0]
    first = await generate(nc, engine_proc, prompt, 7)
    assert [t for c in first for t in c.token_ids] == want
    assert first[-1].finish_reason == "length" and first[0].cached_device == 0
    again = await generate(nc, engine_proc, prompt, 7)
    assert [t for c in again for t in c.token_ids] == want
    assert again[0].cached_device == 36  # (37 - 1) // 4 * 4
    other_salt = await generate(nc, engine_proc, prompt, 7, salt="tenant-b")
    assert [t for c in other_salt for t in c.token_ids] == want
    assert other_salt[0].cached_device + other_salt[0].cached_host == 0


async def test_kv_events_carry_the_router_page_hashes(engine_proc: str, nc: NATS) -> None:
    await wait_heartbeat(nc, engine_proc)
    batches: list[KVEventBatch] = []

    async def on(msg) -> None:  # type: ignore[no-untyped-def]
        batches.append(KVEventBatch.decode(msg.data))

    sub = await nc.subscribe(subj.KV_EVENTS_ALL, cb=on)
    prompt = list(range(100, 141))
    await generate(nc, engine_proc, prompt, 3, salt="events")
    for _ in range(100):
        stored = {h for b in batches for e in b.events if e.kind == "stored" for h in e.page_hashes}
        if len(stored) >= 10:
            break
        await asyncio.sleep(0.05)
    await sub.unsubscribe()
    namespace = batches[0].namespace
    expected = page_hashes(prompt[:40], PAGE, namespace, "events")
    assert set(expected) <= stored
    seqs = [b.seq for b in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert all(b.epoch == batches[0].epoch and b.engine_id == engine_proc for b in batches)


async def test_abort_flush_and_stats(engine_proc: str, nc: NATS) -> None:
    await wait_heartbeat(nc, engine_proc)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    req = GenerateRequest("abort-me", list(range(50)), Sampling(400, ignore_eos=True), inbox)
    await nc.publish(subj.engine_generate(engine_proc), req.encode())
    await next_chunk(sub)
    await nc.publish(subj.engine_abort(engine_proc), AbortRequest("abort-me").encode())
    last = None
    for _ in range(500):
        last = await next_chunk(sub)
        if last.finished:
            break
    assert last is not None and last.finish_reason == "abort"
    reply = await nc.request(subj.engine_flush(engine_proc), FlushRequest().encode(), timeout=10)
    assert FlushReply.decode(reply.data).success
    stats = await nc.request(subj.engine_stats(engine_proc), StatsRequest().encode(), timeout=10)
    s = StatsReply.decode(stats.data).stats
    assert s["device_pages_free"] == s["device_pages"]


async def test_stream_check_answers_after_the_chunks_it_counts(engine_proc: str, nc: NATS) -> None:
    """A router's StreamCheck after a NATS reconnect: the engine's StreamState comes on the
    stream's own subject after every chunk it counts (so the router can tell what it lost),
    says the request is held while it runs, and not held once it finished or for a reply
    subject that is not the stream's."""
    await wait_heartbeat(nc, engine_proc)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    rid = "checked"
    req = GenerateRequest(rid, list(range(60, 80)), Sampling(300, ignore_eos=True), inbox)
    await nc.publish(subj.engine_generate(engine_proc), req.encode())
    await next_chunk(sub)  # it runs
    check = subj.engine_stream_check(engine_proc)
    await nc.publish(check, StreamCheck(rid, inbox).encode())
    chunks = 1
    while True:
        data = (await sub.next_msg(timeout=30)).data
        try:
            state = StreamState.decode(data)
        except SchemaError:
            chunk = chunk_of(data)
            assert chunk is None or not chunk.finished, "finished before the check came"
            chunks += chunk is not None
            continue
        break
    assert state.held and state.request_id == rid and state.engine_id == engine_proc
    assert state.next_seq == chunks  # every chunk it counts came first
    other = nc.new_inbox()
    other_sub = await nc.subscribe(other)
    await nc.publish(check, StreamCheck(rid, other).encode())
    assert not StreamState.decode((await other_sub.next_msg(timeout=30)).data).held
    await nc.publish(subj.engine_abort(engine_proc), AbortRequest(rid).encode())
    while not (await next_chunk(sub)).finished:
        pass
    await nc.publish(check, StreamCheck(rid, inbox).encode())
    assert not StreamState.decode((await sub.next_msg(timeout=30)).data).held
    await sub.unsubscribe()
    await other_sub.unsubscribe()


async def test_bad_request_gets_an_error_chunk(engine_proc: str, nc: NATS) -> None:
    await wait_heartbeat(nc, engine_proc)
    chunks = await generate(nc, engine_proc, [1, 2, 999], 3)
    assert chunks[-1].error and chunks[-1].error_code == 400
    assert "[0, 260)" in chunks[-1].error
    # a garbage payload does not kill the engine
    await nc.publish(subj.engine_generate(engine_proc), b"{not json")
    ok = await generate(nc, engine_proc, [1, 2, 3, 4, 5], 2)
    assert len([t for c in ok for t in c.token_ids]) == 2


async def test_sigterm_finishes_running_requests(nats_server: ServerProcess, nc: NATS) -> None:
    proc = start_engine(nats_server.url, "svc-term")
    await wait_heartbeat(nc, "svc-term")
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    req = GenerateRequest("term-1", list(range(30)), Sampling(40, ignore_eos=True), inbox)
    await nc.publish(subj.engine_generate("svc-term"), req.encode())
    await next_chunk(sub)
    proc.send_signal(signal.SIGTERM)
    tokens, last = 1, None
    while True:
        last = await next_chunk(sub)
        tokens += len(last.token_ids)
        if last.finished:
            break
    assert last.finish_reason == "length" and tokens == 40
    assert await asyncio.to_thread(proc.wait, 30) == 0
