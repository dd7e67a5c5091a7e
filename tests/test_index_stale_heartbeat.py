"""An old-epoch heartbeat changes nothing in Redis, not even the liveness expiry (issue 7).

A heartbeat from an older epoch comes from a dead incarnation of the engine (a process that
was restarted, still draining its outbox). If the index let it through, it would keep the
new incarnation "alive" past its own heartbeats (a longer TTL), or overwrite its bucket and
namespace. Runs the real index process against real nats-server and redis-server.
"""

from __future__ import annotations

from typing import Any

from test_index_service import NS, H, Mesh, batch, eventually, heartbeat, mesh, stored

from bus_schemas import redis_keys
from bus_schemas.messages import Heartbeat

__all__ = ["mesh"]  # the fixture, shared with tests/test_index_service.py


async def alive(m: Mesh, engine_id: str) -> str:
    """The engine's alive key ("" when absent)."""
    return str(await m.r.get(redis_keys.engine_alive(engine_id)) or "")


async def e1_state(m: Mesh) -> dict[str, Any]:
    """Everything the index keeps about engine e1 (e2 is the barrier engine)."""
    return {
        "engine": await m.engine("e1"),
        "pages": await m.pages(),
        "engines": await m.r.smembers(redis_keys.ENGINES) - {"e2"},
    }


async def test_old_epoch_heartbeat_changes_nothing(mesh: Mesh) -> None:
    await mesh.send(heartbeat("e1", 1000))  # epoch A, interval 10 s: TTL 30 s
    await mesh.send(batch("e1", 1000, 0, stored("device", H[0:2])))
    await mesh.send(heartbeat("e1", 2000))  # epoch B: a restart, A's entries dropped
    await mesh.send(batch("e1", 2000, 0, stored("device", H[0:3]), stored("host", [H[0]])))
    want = {H[0]: {"e1": 3}, H[1]: {"e1": 1}, H[2]: {"e1": 1}}
    await eventually(mesh.pages, want)
    before = await e1_state(mesh)
    assert before["engine"]["meta"] == {
        "epoch": "2000",
        "seq": "0",
        "bucket": "b0",
        "namespace": NS,
    }
    assert before["engine"]["alive"] == "2000"
    ttl_before = await mesh.r.pttl(redis_keys.engine_alive("e1"))
    assert 0 < ttl_before <= 30_000

    # epoch A again, with another bucket and namespace and a 60 s interval (the longest a
    # heartbeat may have): accepting any of it would show (TTL 180 s, other meta)
    stale = Heartbeat("e1", "b-old", "1000", "tiny", "old|ns", 4, 64, 260, [0], 0, 0, 0, 60.0)
    await mesh.send(stale)
    await mesh.send(heartbeat("e2", 5))  # barrier: heartbeats are handled in order
    await eventually(lambda: alive(mesh, "e2"), "5")

    assert await e1_state(mesh) == before
    ttl_after = await mesh.r.pttl(redis_keys.engine_alive("e1"))
    assert 0 < ttl_after <= ttl_before, "an old-epoch heartbeat extended the liveness TTL"
