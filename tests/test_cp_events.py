"""KV events of a CP-sharded engine carry each node's owner rotation (issue 22, build item 10).

Events stay per logical page (the router's index scores logical prefixes); an engine whose
pages are sharded over its CP ranks adds, per event, the CP rank holding the first page
(`TreeNode.owner_rotation`) and its `cp_size`, so another topology or a P/D decode engine can
tell which rank holds each page. A real CP2 sharded world (`tests/multirank.py`) serves
prompts over shared prefixes (so nodes split and children start on either rank), has pages
evicted and flushes; every `stored` and `removed` event must name the rotation of the node it
was recorded for, and that rotation must say where each of its pages really is (the device
page id's owner class). The fields are optional: left out at their defaults, so a CP1
engine's events are what they were, an event of the older schema still parses, a consumer
of the older schema still reads a CP1 engine's events, and the real index process accepts
the new ones.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import orjson
import pytest
from multirank import run_world, shared_prefix_prompts
from test_index_service import NS, H, Mesh, batch, eventually, mesh

from bus_schemas.codec import Message, SchemaError
from bus_schemas.messages import KVEvent, KVEventBatch
from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.cache.kv_events import KVEventRecord
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.parallel.config import ParallelConfig
from services.engine.intake import bus_events

__all__ = ["mesh"]  # the fixture, shared with tests/test_index_service.py

PAGE = 4
GREEDY = SamplingParams(max_new_tokens=3, ignore_eos=True)


def config(cp: int) -> EngineConfig:
    return EngineConfig(
        model="tiny",
        cache=CacheConfig(page_size=PAGE, num_device_pages=128),
        parallel=ParallelConfig(cp_size=cp, kv_sharding=cp > 1),
        batch_invariant=True,
    )


def events_workload(engine: Engine) -> dict[str, Any]:
    """Runs on rank 0 (it records the events): serve, evict, flush; the events of each phase
    and, before the evictions, where each page hash is held and each node's rotation."""
    prompts = shared_prefix_prompts(22, shared=(9, 26), tail=(2, 9))
    engine.generate_batch(prompts, GREEDY)
    engine.generate_batch([[*p[:-1], 3, 1, 4] for p in prompts[::2]], GREEDY)  # more splits
    nodes = [n for n in engine.cache.tree.iter_nodes() if n.device_page_ids is not None]
    held = {
        h.hex(): q for n in nodes for h, q in zip(n.page_hashes, n.device_page_ids, strict=True)
    }
    rotations = {n.page_hashes[0].hex(): n.owner_rotation for n in nodes}
    out = {"held": held, "rotations": rotations, "stored": engine.cache.drain_events()}
    out["snapshot"] = engine.cache.tree.snapshot_events()
    engine.evict_device(5)
    out["evicted"] = engine.cache.drain_events()
    assert engine.flush_cache()
    out["flushed"] = engine.cache.drain_events()
    return out


def test_sharded_engine_events_carry_each_node_rotation() -> None:
    got = run_world(config(2), events_workload)
    held, rotations = got["held"], got["rotations"]
    phases = ("stored", "snapshot", "evicted", "flushed")
    assert [k for k in phases if not got[k]] == []
    assert {e.kind for e in got["evicted"] + got["flushed"]} == {"removed"}
    for phase in phases:
        for e in got[phase]:
            assert (e.tier, e.cp_size) == ("device", 2), (phase, e)
            # the rotation of the node the event was recorded for (a split keeps it upstairs)
            assert e.owner_rotation == rotations[e.page_hashes[0]], (phase, e)
            # and it says where each page is: page i on CP rank (rotation + i) % 2
            owners = [held[h] % 2 for h in e.page_hashes]
            assert owners == [(e.owner_rotation + i) % 2 for i in range(len(owners))], phase
    assert {e.owner_rotation for e in got["stored"]} == {0, 1}  # nodes start on both ranks
    # the service's bus events carry them, and a batch of them round-trips
    events = bus_events(got["stored"])
    assert [(e.owner_rotation, e.cp_size) for e in events] == [
        (r.owner_rotation, r.cp_size) for r in got["stored"]
    ]
    sent = KVEventBatch("e1", "b0", "1", 0, NS, events)
    assert KVEventBatch.decode(sent.encode()) == sent
    assert b'"owner_rotation"' in sent.encode() and b'"cp_size":2' in sent.encode()


def test_a_cp1_engine_events_are_unchanged_on_the_wire() -> None:
    engine = Engine(config(1))
    try:
        engine.generate_batch(shared_prefix_prompts(5, shared=(9, 14), tail=(2, 6)), GREEDY)
        records = engine.cache.drain_events()
    finally:
        engine.close()
    assert records and {(r.owner_rotation, r.cp_size) for r in records} == {(0, 1)}
    wire = orjson.loads(KVEventBatch("e1", "b0", "1", 0, NS, bus_events(records)).encode())
    assert {tuple(e) for e in wire["events"]} == {("kind", "tier", "page_hashes")}


@dataclasses.dataclass(frozen=True, slots=True)
class OldKVEvent(Message):
    """`KVEvent` as a consumer built before the CP fields reads it."""

    TYPE: ClassVar[str] = "kv_event"

    kind: str
    tier: str
    page_hashes: list[str]


@dataclasses.dataclass(frozen=True, slots=True)
class OldKVEventBatch(Message):
    TYPE: ClassVar[str] = "kv_events"
    VERSION: ClassVar[int] = 2

    engine_id: str
    bucket: str
    epoch: str
    seq: int
    namespace: str
    events: list[OldKVEvent]
    snapshot: bool = False
    store_id: str = ""


def test_event_schema_old_and_new() -> None:
    hashes = H[0:3]
    # an event of the older schema (no CP fields) still parses: every rank holds every page
    old = OldKVEventBatch("e1", "b0", "1", 0, NS, [OldKVEvent("stored", "device", hashes)])
    (event,) = KVEventBatch.decode(old.encode()).events
    assert event == KVEvent("stored", "device", hashes) and (
        event.owner_rotation,
        event.cp_size,
    ) == (0, 1)
    # a consumer of the older schema reads events without sharding, and refuses those with
    plain = KVEventBatch("e1", "b0", "1", 0, NS, [KVEvent("removed", "host", hashes)])
    assert OldKVEventBatch.decode(plain.encode()).events == [OldKVEvent("removed", "host", hashes)]
    sharded = KVEventBatch("e1", "b0", "1", 1, NS, [KVEvent("stored", "device", hashes, 1, 2)])
    with pytest.raises(SchemaError, match="unknown field"):
        OldKVEventBatch.decode(sharded.encode())
    assert KVEventBatch.decode(sharded.encode()) == sharded  # a new one reads them back
    body = orjson.loads(sharded.encode())
    body["events"][0]["owner_rotation"] = 2  # not a CP rank of 2
    with pytest.raises(SchemaError, match="owner_rotation 2 is not a CP rank"):
        KVEventBatch.decode(orjson.dumps(body))
    with pytest.raises(ValueError, match="cp_size 0"):
        KVEvent("stored", "device", hashes, 0, 0)
    assert KVEventRecord("stored", "device", hashes) == KVEventRecord(
        "stored", "device", hashes, 0, 1
    )

    @dataclasses.dataclass(frozen=True, slots=True)
    class Bad(Message):
        TYPE: ClassVar[str] = "bad"
        OMIT_DEFAULTS: ClassVar[frozenset[str]] = frozenset({"ids"})

        ids: list[int] = dataclasses.field(default_factory=list)

    with pytest.raises(TypeError, match="without a plain default"):
        Bad().encode()


async def test_the_index_accepts_events_with_owner_rotation(mesh: Mesh) -> None:
    sharded = [KVEvent("stored", "device", H[0:3], 1, 2), KVEvent("stored", "host", H[0:1], 1, 2)]
    await mesh.send(batch("e1", 1000, 0, *sharded))
    await mesh.send(batch("e1", 1000, 1, KVEvent("removed", "device", H[2:3], 1, 2)))
    want = {H[0]: {"e1": 3}, H[1]: {"e1": 1}}  # device bit 1, host bit 2
    await eventually(mesh.pages, want)
    assert "invalid message" not in mesh.log()
