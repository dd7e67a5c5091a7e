"""The index service against a real nats-server and redis-server.

Most tests run it as users do, `python -m services.index`, publish KV event batches and
heartbeats with nats-py, and assert the exact Redis contents. Waiting is by polling with a
deadline; a batch that must change nothing is followed by a barrier batch whose effect is
awaited (the index handles one engine's messages in order; different engines' concurrently).
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import nats
import orjson
import pytest
import redis.asyncio as aioredis
from bus_helpers import barrier
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bus_schemas import redis_keys, subjects
from bus_schemas.codec import Message
from bus_schemas.messages import Heartbeat, KVEvent, KVEventBatch, SnapshotRequest
from bus_schemas.page_hash import page_hashes
from bus_schemas.sentinel import INDEX_SYNCED
from services.index.cli import build_parser
from services.index.fencing import Action, Fence, decide_batch, epoch_order, parse_epoch
from services.index.service import EngineLanes, IndexConfig, IndexService
from services.launch.servers import ServerProcess, start_redis

REPO = Path(__file__).resolve().parents[1]
NS = "tiny|float64|p4"
H = page_hashes(list(range(48)), 4, NS)  # 12 chained page hashes
OTHER = page_hashes(list(range(16)), 4, NS, cache_salt="other")
T = TypeVar("T")


# ----------------------------------------------------------------- messages


def stored(tier: str, hashes: list[str]) -> KVEvent:
    return KVEvent("stored", tier, hashes)


def removed(tier: str, hashes: list[str]) -> KVEvent:
    return KVEvent("removed", tier, hashes)


def batch(
    engine_id: str, epoch: int, seq: int, *events: KVEvent, snapshot: bool = False
) -> KVEventBatch:
    return KVEventBatch(engine_id, "b0", str(epoch), seq, NS, list(events), snapshot)


def heartbeat(engine_id: str, epoch: int, interval_s: float = 10.0) -> Heartbeat:
    return Heartbeat(engine_id, "b0", str(epoch), "tiny", NS, 4, 64, 260, [0], 0, 0, 0, interval_s)


# ----------------------------------------------------------------- harness


@dataclass
class Mesh:
    """A running index with a NATS client and a Redis client of the test's own."""

    nc: NATS
    r: aioredis.Redis
    proc: subprocess.Popen[bytes] | None
    log_path: Path | None

    async def send(self, msg: Message | bytes, subject: str | None = None) -> None:
        """Publish on `subject`, else on the subject of the message's own engine."""
        data = msg if isinstance(msg, bytes) else msg.encode()
        if subject is None:
            eid = getattr(msg, "engine_id", "")
            subject = (subjects.heartbeat if isinstance(msg, Heartbeat) else subjects.kv_events)(
                eid
            )
        await self.nc.publish(subject, data)
        await barrier(self.nc)

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path else ""

    async def pages(self) -> dict[str, dict[str, int]]:
        """Every `hc:page:*` hash: page hash -> {engine id: tier bits}."""
        out: dict[str, dict[str, int]] = {}
        async for key in self.r.scan_iter(match=redis_keys.page("*")):
            fields = await self.r.hgetall(key)
            out[key.removeprefix(redis_keys.page(""))] = {e: int(b) for e, b in fields.items()}
        return out

    async def engine(self, engine_id: str) -> dict[str, Any]:
        return {
            "pages": await self.r.smembers(redis_keys.engine_pages(engine_id)),
            "meta": await self.r.hgetall(redis_keys.engine_meta(engine_id)),
            "alive": await self.r.get(redis_keys.engine_alive(engine_id)),
            "listed": bool(await self.r.sismember(redis_keys.ENGINES, engine_id)),
        }


async def eventually(
    probe: Callable[[], Awaitable[T]], expected: T, timeout_s: float = 5.0
) -> float:
    """Poll until `probe()` returns `expected`; the seconds it took."""
    start = time.monotonic()
    value = await probe()
    while value != expected:
        if time.monotonic() - start > timeout_s:
            assert value == expected, f"still {value!r} after {timeout_s}s"
        await asyncio.sleep(0.02)
        value = await probe()
    return time.monotonic() - start


def start_index_process(nats_url: str, redis_url: str, log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.index",
                "--nats-url",
                nats_url,
                "--redis-url",
                redis_url,
                "--sweep-interval",
                "0.1",
                "--snapshot-retry",
                "0.5",
                "--redis-timeout",
                "0.5",
            ],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


async def wait_ready(proc: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + 15
    while "index ready" not in log_path.read_text():
        assert proc.poll() is None, f"index exited early:\n{log_path.read_text()}"
        assert time.monotonic() < deadline, f"index not ready:\n{log_path.read_text()}"
        await asyncio.sleep(0.02)


def terminate(proc: subprocess.Popen[bytes], signum: int = signal.SIGTERM) -> int:
    if proc.poll() is None:
        proc.send_signal(signum)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@pytest.fixture
async def mesh(
    nats_server: ServerProcess, fresh_redis: ServerProcess, tmp_path: Path
) -> AsyncIterator[Mesh]:
    log_path = tmp_path / "index.log"
    proc = start_index_process(nats_server.url, fresh_redis.url, log_path)
    nc = await nats.connect(nats_server.url)
    r = aioredis.Redis.from_url(fresh_redis.url, decode_responses=True)
    try:
        await wait_ready(proc, log_path)
        yield Mesh(nc, r, proc, log_path)
    finally:
        terminate(proc)
        await nc.drain()
        await r.aclose()


class SnapshotRequests:
    """SnapshotRequests the index sends to one engine, as the engine would receive them."""

    def __init__(self) -> None:
        self.received: list[SnapshotRequest] = []

    async def subscribe(self, nc: NATS, engine_id: str) -> None:
        await nc.subscribe(subjects.engine_snapshot(engine_id), cb=self._on_msg)
        await barrier(nc)

    async def _on_msg(self, msg: Msg) -> None:
        self.received.append(SnapshotRequest.decode(msg.data))

    async def count(self) -> int:
        return len(self.received)

    def at_least(self, n: int) -> Callable[[], Awaitable[bool]]:
        async def probe() -> bool:
            return len(self.received) >= n

        return probe


async def _now(value: T) -> T:
    return value


# ----------------------------------------------------------------- fencing rules (no network)


def test_fencing_rules() -> None:
    f = Fence(10, 3)
    assert decide_batch(f, 10, 4, False).action is Action.APPLY
    assert decide_batch(f, 10, 4, False).fence == Fence(10, 4)
    assert not decide_batch(f, 10, 4, False).clear
    for seq in (3, 2, 5, 9):  # repeated, older, gaps
        d = decide_batch(f, 10, seq, False)
        assert (d.action, d.clear, d.fence) == (Action.RESYNC, True, Fence(10, None, True))
    d = decide_batch(f, 10, 7, True)  # a snapshot of the epoch always replaces
    assert (d.action, d.clear, d.fence) == (Action.APPLY, True, Fence(10, 7))
    assert decide_batch(f, 9, 4, False).action is Action.REJECT
    assert decide_batch(f, 9, 0, True).action is Action.REJECT
    d = decide_batch(f, 11, 0, False)  # new epoch starting at 0: clear, then apply
    assert (d.action, d.clear, d.fence) == (Action.APPLY, True, Fence(11, 0))
    d = decide_batch(f, 11, 5, False)  # new epoch joined late
    assert (d.action, d.clear, d.fence) == (Action.RESYNC, True, Fence(11, None, True))
    waiting = Fence(10, None, True)
    assert decide_batch(waiting, 10, 4, False).action is Action.WAIT
    assert decide_batch(waiting, 10, 4, True).fence == Fence(10, 4)
    assert decide_batch(Fence(10), 10, 0, False).fence == Fence(10, 0)
    assert decide_batch(Fence(10), 10, 1, False).action is Action.RESYNC
    assert decide_batch(None, 10, 0, False).clear  # leftovers of an unknown engine go
    assert decide_batch(None, 10, 3, False).action is Action.RESYNC
    assert [epoch_order(f, e) for e in (9, 10, 11)] == [-1, 0, 1]
    assert epoch_order(None, 0) == 1
    assert parse_epoch("1700000000000000000") == 1700000000000000000
    for bad in ("", "-1", "1.5", "0x10", " 1", "١٢"):
        with pytest.raises(ValueError):
            parse_epoch(bad)


async def test_engine_lanes_keep_order_per_engine_and_do_not_block_others() -> None:
    """Issue 7 defect 7: a batch of engine e2 must not wait behind e1's Redis round trip
    (here: e1's first job blocks on an event), and each engine's jobs run in order."""
    lanes = EngineLanes("test")
    release = asyncio.Event()
    done: list[str] = []

    def job(name: str, wait: bool = False) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            if wait:
                await release.wait()
            done.append(name)

        return run

    lanes.submit("e1", job("e1-0", wait=True))
    lanes.submit("e1", job("e1-1"))
    lanes.submit("e2", job("e2-0"))
    lanes.submit("e2", job("e2-1"))
    for _ in range(10):
        await asyncio.sleep(0)
    assert done == ["e2-0", "e2-1"]  # e2 ran while e1 waits for its round trip
    assert lanes.lock("e1").locked() and not lanes.lock("e2").locked()
    release.set()
    await lanes.join(5.0)
    assert done == ["e2-0", "e2-1", "e1-0", "e1-1"]  # e1 in submission order


def test_help_and_config_validation() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.index", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0
    assert "--nats-url" in out.stdout and "--sweep-interval" in out.stdout
    # the index never loads the GPU side of the mesh
    imported = subprocess.run(
        [sys.executable, "-c", "import sys, services.index; print(*sys.modules)"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    modules = {m.split(".")[0] for m in imported.stdout.split()}
    assert not modules & {"torch", "triton", "gpu_worker", "router"}
    args = build_parser().parse_args(["--sweep-interval", "0.5"])
    assert args.sweep_interval == 0.5
    with pytest.raises(ValueError):
        IndexConfig(sweep_interval_s=0)


# ----------------------------------------------------------------- the service as a process


async def test_stored_and_removed_per_tier(mesh: Mesh) -> None:
    await mesh.send(heartbeat("e1", 1000))
    await mesh.send(batch("e1", 1000, 0, stored("device", H[0:3])))
    await mesh.send(batch("e1", 1000, 1, stored("host", H[0:2])))
    await eventually(mesh.pages, {H[0]: {"e1": 3}, H[1]: {"e1": 3}, H[2]: {"e1": 1}})
    # removing a tier the page is not in changes nothing
    await mesh.send(batch("e1", 1000, 2, removed("device", [H[0]]), removed("host", [H[2]])))
    await eventually(mesh.pages, {H[0]: {"e1": 2}, H[1]: {"e1": 3}, H[2]: {"e1": 1}})
    # within one batch events apply in order: stored then removed leaves nothing
    await mesh.send(
        batch(
            "e1",
            1000,
            3,
            removed("host", [H[0]]),
            removed("device", [H[2]]),
            stored("device", [H[5]]),
            removed("device", [H[5]]),
        )
    )
    await eventually(mesh.pages, {H[1]: {"e1": 3}})
    assert await mesh.engine("e1") == {
        "pages": {H[1]},
        "meta": {"epoch": "1000", "seq": "3", "bucket": "b0", "namespace": NS},
        "alive": "1000",
        "listed": True,
    }
    assert 0 < await mesh.r.pttl(redis_keys.engine_alive("e1")) <= 30_000
    assert await mesh.r.smembers(redis_keys.ENGINES) == {"e1"}


async def test_two_engines_match_the_router_lookup(mesh: Mesh) -> None:
    await mesh.send(
        batch("e1", 1, 0, stored("device", H[0:4]), stored("host", H[0:6]))
    )  # e1: 6 pages, the first 4 also on the device
    await mesh.send(batch("e2", 2, 0, stored("host", H[0:2]), stored("device", H[2:3])))
    await mesh.send(batch("e3", 3, 0, stored("device", OTHER)))  # another cache_salt
    expected = {h: {"e1": 3} for h in H[0:4]} | {h: {"e1": 2} for h in H[4:6]}
    for h in H[0:2]:
        expected[h]["e2"] = 2
    expected[H[2]]["e2"] = 1
    expected |= {h: {"e3": 1} for h in OTHER}
    await eventually(mesh.pages, expected)
    assert await mesh.r.smembers(redis_keys.engine_pages("e2")) == set(H[0:3])
    assert await mesh.r.smembers(redis_keys.ENGINES) == {"e1", "e2", "e3"}

    lookup = mesh.r.register_script(redis_keys.PREFIX_LOOKUP_LUA)
    flat = await lookup(args=redis_keys.lookup_argv(H[0:8]))
    found = {flat[i]: (flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)}
    assert found == {"e1": (6, 4), "e2": (3, 0)}
    flat = await lookup(args=redis_keys.lookup_argv(OTHER))
    assert flat == ["e3", 4, 4]


async def test_old_epoch_is_rejected(mesh: Mesh) -> None:
    await mesh.send(heartbeat("e1", 2000))
    await mesh.send(batch("e1", 2000, 0, stored("device", H[0:2])))
    await mesh.send(batch("e1", 1999, 1, stored("device", [H[7]])))
    await mesh.send(batch("e1", 1999, 0, stored("device", [H[8]]), snapshot=True))
    await mesh.send(heartbeat("e1", 1999))
    await mesh.send(batch("e1", 2000, 1, stored("host", [H[0]])))  # barrier
    await eventually(mesh.pages, {H[0]: {"e1": 3}, H[1]: {"e1": 1}})
    engine = await mesh.engine("e1")
    assert (engine["meta"]["epoch"], engine["meta"]["seq"], engine["alive"]) == (
        "2000",
        "1",
        "2000",
    )
    assert mesh.log().count("rejected: epoch 1999 is older than 2000") == 2


async def test_new_epoch_clears_old_entries(mesh: Mesh) -> None:
    requests = SnapshotRequests()
    await requests.subscribe(mesh.nc, "e1")
    await mesh.send(batch("e1", 100, 0, stored("device", H[0:4])))
    await mesh.send(batch("e2", 100, 0, stored("device", H[0:1])))
    await eventually(mesh.pages, {H[0]: {"e1": 1, "e2": 1}} | {h: {"e1": 1} for h in H[1:4]})
    # a restart that publishes from seq 0: old entries gone, the new batch applied
    await mesh.send(batch("e1", 200, 0, stored("host", [H[0]])))
    await eventually(mesh.pages, {H[0]: {"e1": 2, "e2": 1}})
    assert (await mesh.engine("e1"))["meta"]["epoch"] == "200"
    # a heartbeat of a newer epoch drops the entries at once
    await mesh.send(heartbeat("e1", 300))
    await eventually(mesh.pages, {H[0]: {"e2": 1}})
    assert (await mesh.engine("e1"))["meta"] == {
        "epoch": "300",
        "seq": "-1",
        "bucket": "b0",
        "namespace": NS,
    }
    assert await mesh.r.exists(redis_keys.engine_pages("e1")) == 0
    # a new epoch first seen at seq 5: nothing applied, a snapshot requested
    await mesh.send(batch("e1", 300, 0, stored("device", H[0:2])))
    await mesh.send(batch("e1", 400, 5, stored("device", H[0:3])))
    await eventually(requests.count, 1)
    assert requests.received[0].engine_id == "e1"
    assert await mesh.pages() == {H[0]: {"e2": 1}}
    await mesh.send(batch("e1", 400, 6, stored("device", H[0:2]), snapshot=True))
    await eventually(mesh.pages, {H[0]: {"e1": 1, "e2": 1}, H[1]: {"e1": 1}})


async def test_seq_gap_requests_a_snapshot_that_restores(mesh: Mesh) -> None:
    requests = SnapshotRequests()
    await requests.subscribe(mesh.nc, "e1")
    await mesh.send(heartbeat("e1", 7))
    await mesh.send(batch("e1", 7, 0, stored("device", H[0:4])))
    await eventually(mesh.pages, {h: {"e1": 1} for h in H[0:4]})
    await mesh.send(batch("e1", 7, 2, stored("device", [H[4]])))  # seq 1 was lost
    await eventually(requests.count, 1)
    assert "gap: expected 1, got 2" in requests.received[0].reason
    assert await mesh.pages() == {}
    assert (await mesh.engine("e1"))["meta"]["seq"] == "-1"
    # until the snapshot comes, batches are dropped
    await mesh.send(batch("e1", 7, 3, stored("device", [H[5]])))
    await mesh.send(batch("e2", 7, 0, stored("host", [H[9]])))  # barrier
    await eventually(mesh.pages, {H[9]: {"e2": 2}})
    # the engine answers with a snapshot (the next seq): it replaces everything
    await mesh.send(
        batch("e1", 7, 4, stored("device", H[0:3]), stored("host", H[0:5]), snapshot=True)
    )
    expected = {h: {"e1": 3} for h in H[0:3]} | {h: {"e1": 2} for h in H[3:5]} | {H[9]: {"e2": 2}}
    await eventually(mesh.pages, expected)
    await mesh.send(batch("e1", 7, 5, removed("host", H[3:5])))  # in order again
    for h in H[3:5]:
        del expected[h]
    await eventually(mesh.pages, expected)
    assert (await mesh.engine("e1"))["meta"]["seq"] == "5"
    # a repeated seq is a resync too, and an unanswered request is repeated
    num_requests = len(requests.received)
    await mesh.send(batch("e1", 7, 5, removed("device", [H[0]])))
    await eventually(mesh.pages, {H[9]: {"e2": 2}})
    await eventually(requests.at_least(num_requests + 2), True, timeout_s=3)
    assert "repeated seq" in requests.received[num_requests].reason


async def test_heartbeat_ttl_expiry_clears_a_dead_engine(mesh: Mesh) -> None:
    async def beat(engine_id: str) -> None:
        while True:
            await mesh.send(heartbeat(engine_id, 1, interval_s=0.2))
            await asyncio.sleep(0.1)

    keeper = asyncio.create_task(beat("e2"))
    try:
        await mesh.send(heartbeat("e1", 1, interval_s=0.2))
        await mesh.send(batch("e1", 1, 0, stored("device", H[0:3]), stored("host", [H[0]])))
        await mesh.send(batch("e2", 1, 0, stored("device", H[0:1])))
        await eventually(mesh.pages, {H[0]: {"e1": 3, "e2": 1}} | {h: {"e1": 1} for h in H[1:3]})
        assert 0 < await mesh.r.pttl(redis_keys.engine_alive("e1")) <= 600
        # e1 sends no more heartbeats: gone after its TTL (0.6 s) plus one sweep
        took = await eventually(mesh.pages, {H[0]: {"e2": 1}}, timeout_s=4)
        assert took < 2.5
        assert await mesh.engine("e1") == {
            "pages": set(),
            "meta": {},
            "alive": None,
            "listed": False,
        }
        assert await mesh.r.smembers(redis_keys.ENGINES) == {"e2"}
        assert "engine e1 expired: 3 pages dropped" in mesh.log()
        # the same engine coming back mid-epoch must resync: its entries are gone
        requests = SnapshotRequests()
        await requests.subscribe(mesh.nc, "e1")
        await mesh.send(heartbeat("e1", 1, interval_s=0.2))
        await mesh.send(batch("e1", 1, 1, stored("device", [H[5]])))
        await eventually(requests.count, 1)
        assert (await mesh.engine("e2"))["alive"] == "1"
    finally:
        keeper.cancel()
        with pytest.raises(asyncio.CancelledError):
            await keeper


async def test_malformed_messages_do_not_kill_it(mesh: Mesh) -> None:
    v = KVEventBatch.VERSION
    good = batch("e1", 5, 0, stored("device", H[0:1])).to_dict() | {"type": "kv_events", "v": v}
    bad_bodies: list[Any] = [
        b"",
        b"\xff\xfe",
        b"not json",
        b"[1, 2]",
        b"null",
        good | {"v": v + 1},
        good | {"store_id": "a b"},
        good | {"type": "heartbeat"},
        good | {"seq": "1"},
        good | {"seq": -1},
        good | {"epoch": "abc"},
        good | {"epoch": "-5"},
        good | {"engine_id": "a.b"},
        good | {"extra": 1},
        good | {"events": [{"kind": "moved", "tier": "device", "page_hashes": []}]},
        good | {"events": [{"kind": "stored", "tier": "disk", "page_hashes": []}]},
        good | {"events": [{"kind": "stored", "tier": "device", "page_hashes": ["xyz"]}]},
        good | {"events": [{"kind": "stored", "tier": "device", "page_hashes": [H[0].upper()]}]},
    ]
    for body in bad_bodies:
        data = body if isinstance(body, bytes) else orjson.dumps(body)
        await mesh.send(data, subjects.kv_events("e1"))
    bad_hb = heartbeat("e1", 5).to_dict() | {"type": "heartbeat", "v": Heartbeat.VERSION}
    for body in (bad_hb | {"interval_s": 0}, bad_hb | {"running": None}, b"{}"):
        data = body if isinstance(body, bytes) else orjson.dumps(body)
        await mesh.send(data, subjects.heartbeat("e1"))
    await mesh.send(batch("e1", 5, 0, stored("device", H[0:2])))
    await eventually(mesh.pages, {H[0]: {"e1": 1}, H[1]: {"e1": 1}})
    assert mesh.proc is not None and mesh.proc.poll() is None
    # bus input must not write a log line per message: one per kind per interval
    assert mesh.log().count("invalid message on") == 2
    assert "more like it" not in mesh.log()  # said by the next line of a kind, 10 s on


async def test_storage_pages_are_kept_per_store_with_a_ttl(mesh: Mesh) -> None:
    """Storage events are about the engine's store, not the engine: they land under
    `hc:store:{store_id}:{hash}` with a TTL, outside the engine's own entries (they stay
    when the engine goes)."""
    events = [stored("device", H[0:2]), KVEvent("stored", "storage", H[0:3])]
    b = dataclasses.replace(batch("e1", 5, 0, *events), store_id="s1")
    await mesh.send(b)
    await eventually(mesh.pages, {H[0]: {"e1": 1}, H[1]: {"e1": 1}})
    for h in H[0:3]:
        assert await mesh.r.get(redis_keys.store_page("s1", h)) == "1"
        assert 0 < await mesh.r.ttl(redis_keys.store_page("s1", h)) <= redis_keys.STORE_TTL_S
    assert await mesh.r.exists(redis_keys.store_page("s1", H[3])) == 0
    assert H[2] not in (await mesh.engine("e1"))["pages"]  # not the engine's own


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_signal_exits_zero_promptly(mesh: Mesh, signum: int) -> None:
    await mesh.send(batch("e1", 1, 0, stored("device", H[0:1])))
    await eventually(mesh.pages, {H[0]: {"e1": 1}})
    assert mesh.proc is not None
    start = time.monotonic()
    assert terminate(mesh.proc, signum) == 0
    assert time.monotonic() - start < 3
    assert "index stopped" in mesh.log()


async def test_redis_restart_resyncs_every_engine(
    nats_server: ServerProcess, fresh_redis: ServerProcess, tmp_path: Path
) -> None:
    log_path = tmp_path / "index.log"
    proc = start_index_process(nats_server.url, fresh_redis.url, log_path)
    nc = await nats.connect(nats_server.url)
    restarted: ServerProcess | None = None
    r = aioredis.Redis.from_url(fresh_redis.url, decode_responses=True)
    try:
        await wait_ready(proc, log_path)
        mesh = Mesh(nc, r, proc, log_path)
        requests = SnapshotRequests()
        await requests.subscribe(nc, "e1")
        await mesh.send(heartbeat("e1", 9))
        await mesh.send(batch("e1", 9, 0, stored("device", H[0:3])))
        await eventually(mesh.pages, {h: {"e1": 1} for h in H[0:3]})

        fresh_redis.stop()  # Redis dies: events keep coming and are counted, not fatal
        await mesh.send(batch("e1", 9, 1, removed("device", [H[2]])))
        await mesh.send(heartbeat("e1", 9))
        await asyncio.sleep(0.3)
        assert proc.poll() is None
        restarted = start_redis(fresh_redis.port)  # back, empty
        await r.aclose()
        r = mesh.r = aioredis.Redis.from_url(restarted.url, decode_responses=True)
        await eventually(requests.at_least(1), True, timeout_s=5)
        assert requests.received[0].reason == "index lost redis state"
        await mesh.send(batch("e1", 9, 2, stored("device", H[0:2]), snapshot=True))
        await eventually(mesh.pages, {h: {"e1": 1} for h in H[0:2]})
        await mesh.send(batch("e1", 9, 3, stored("host", H[0:1])))
        await eventually(mesh.pages, {H[0]: {"e1": 3}, H[1]: {"e1": 1}})
        assert "redis failed" in log_path.read_text()
    finally:
        assert terminate(proc) == 0
        await nc.drain()
        await r.aclose()
        if restarted is not None:
            restarted.stop()


async def test_a_redis_that_lacks_the_last_writes_is_resynced_before_it_is_marked(
    nats_server: ServerProcess, fresh_redis: ServerProcess, tmp_path: Path
) -> None:
    """What a Sentinel failover hands the index (issue 24): another server, with another run
    id, that holds the state from before the index's last removal (a replica that had not
    received it), and no write of the index failed in between (it was stopped during the
    swap). The index must treat the unknown run id as a possibly stale view: clear every
    engine's entries and ask each for a snapshot, and write the resync marker for the new
    run id only once the snapshot has come. Without that, the stale page would stay listed
    and routers would trust this server at once."""
    log_path = tmp_path / "index.log"
    proc = start_index_process(nats_server.url, fresh_redis.url, log_path)
    nc = await nats.connect(nats_server.url)
    promoted: ServerProcess | None = None
    r = aioredis.Redis.from_url(fresh_redis.url, decode_responses=True)
    raw = aioredis.Redis.from_url(fresh_redis.url)  # bytes: DUMP / RESTORE
    try:
        await wait_ready(proc, log_path)
        mesh = Mesh(nc, r, proc, log_path)
        requests = SnapshotRequests()
        await requests.subscribe(nc, "e1")
        await mesh.send(heartbeat("e1", 9))  # one heartbeat only: the index writes nothing more
        await mesh.send(batch("e1", 9, 0, stored("device", H[0:3])))
        await eventually(mesh.pages, {h: {"e1": 1} for h in H[0:3]})
        old_run_id = (await r.info("server"))["run_id"]
        await eventually(lambda: r.get(INDEX_SYNCED), old_run_id)
        # what the replica got: every key before the removal
        replica = {k: await raw.dump(k) for k in await raw.keys("*")}
        await mesh.send(batch("e1", 9, 1, removed("device", [H[2]])))
        await eventually(mesh.pages, {h: {"e1": 1} for h in H[0:2]})

        proc.send_signal(signal.SIGSTOP)  # no write of the index fails during the swap
        try:
            fresh_redis.stop()
            promoted = start_redis(fresh_redis.port)  # the replica, promoted: another run id
            await raw.aclose()
            raw = aioredis.Redis.from_url(promoted.url)
            for key, value in replica.items():
                await raw.restore(key, 0, value, replace=True)
            await r.aclose()
            r = mesh.r = aioredis.Redis.from_url(promoted.url, decode_responses=True)
            new_run_id = (await r.info("server"))["run_id"]
            assert new_run_id != old_run_id
            assert H[2] in await mesh.pages()  # the stale page the removal never reached
        finally:
            proc.send_signal(signal.SIGCONT)

        await eventually(mesh.pages, {}, timeout_s=5)  # every engine's entries cleared
        await eventually(requests.at_least(1), True, timeout_s=5)
        assert requests.received[-1].reason == "index lost redis state"
        assert await r.get(INDEX_SYNCED) != new_run_id  # not until the snapshot is in
        await mesh.send(batch("e1", 9, 2, stored("device", H[0:2]), snapshot=True))
        await eventually(mesh.pages, {h: {"e1": 1} for h in H[0:2]})
        await eventually(lambda: r.get(INDEX_SYNCED), new_run_id)
    finally:
        assert terminate(proc) == 0
        await nc.drain()
        await r.aclose()
        await raw.aclose()
        if promoted is not None:
            promoted.stop()


# ----------------------------------------------------------------- in process


async def test_in_process_counts_what_it_refuses(
    nats_server: ServerProcess, fresh_redis: ServerProcess
) -> None:
    service = IndexService(IndexConfig(nats_server.url, fresh_redis.url, sweep_interval_s=0.1))
    await service.start()
    nc = await nats.connect(nats_server.url)
    r = aioredis.Redis.from_url(fresh_redis.url, decode_responses=True)
    try:
        mesh = Mesh(nc, r, None, None)
        await mesh.send(b"garbage", subjects.kv_events("e1"))
        # e1 speaking for e2 (issue 20): refused, whatever the batch says
        await mesh.send(batch("e2", 50, 0, stored("device", H[5:6])), subjects.kv_events("e1"))
        await mesh.send(heartbeat("e2", 50), subjects.heartbeat("e1"))
        await mesh.send(batch("e1", 50, 0, stored("device", H[0:2])))
        await mesh.send(batch("e1", 40, 1, stored("device", H[2:3])))
        await mesh.send(batch("e1", 50, 3, stored("device", H[2:3])))
        await mesh.send(batch("e1", 50, 4, stored("device", H[2:3])))
        await mesh.send(batch("e1", 50, 5, stored("device", H[0:1]), snapshot=True))
        await eventually(mesh.pages, {H[0]: {"e1": 1}})
        stats = service.stats
        await eventually(lambda: _now(stats.snapshots_applied), 1)
        assert (stats.invalid_messages, stats.batches_stale_epoch) == (1, 1)
        assert (stats.batches_applied, stats.snapshots_applied) == (1, 1)
        assert (stats.snapshot_requests, stats.batches_dropped) == (1, 1)
        assert stats.redis_errors == 0
        assert stats.forged_messages == 2
        assert await r.exists(redis_keys.page(H[5]), redis_keys.engine_alive("e2")) == 0
    finally:
        await service.stop()
        await nc.drain()
        await r.aclose()
