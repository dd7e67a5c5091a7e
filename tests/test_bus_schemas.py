"""bus_schemas: pinned page hashes, strict message decoding, and the router's Redis lookup script.

The page-hash vectors are pinned twice: as literal hex strings, and recomputed here from the
documented definition with hashlib, so changing either the implementation or the definition
fails a test. The lookup script runs on a real Redis against a brute-force Python oracle.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import inspect
import logging
import random
import struct
from array import array
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus_schemas import messages, redis_keys, subjects
from bus_schemas.codec import Message, SchemaError
from bus_schemas.kv_frame import KVFrameHeader, decode_frame, encode_frame, peek_request_id
from bus_schemas.messages import (
    AbortRequest,
    DecodeAdmit,
    DecodeAdmitReply,
    ErrorReply,
    FlushReply,
    FlushRequest,
    GenerateRequest,
    Heartbeat,
    KVChunkAck,
    KVEvent,
    KVEventBatch,
    ModelCard,
    ModelCardRequest,
    PrefillRequest,
    Progress,
    Sampling,
    SnapshotRequest,
    StatsReply,
    StatsRequest,
    StreamCheck,
    StreamState,
    TokenChunk,
)
from bus_schemas.page_hash import DIGEST_SIZE, make_namespace, page_hashes
from bus_schemas.throttle import LogThrottle
from bus_schemas.token_ids import as_token_ids
from services.launch.servers import ServerProcess

NS = "tiny|float64|p4"

# ----------------------------------------------------------------- page hashes

# page_hashes(range(8), page_size=4, namespace=NS, cache_salt=...)
PINNED = {
    "": ["54680cf4a30779426082be130750f51a", "5e8d848532d0bbd94c84b6e8be698a6e"],
    "s": ["f693dccf564cd58cedf5db875d9abb22", "af827dd17be7a7a19da9127306520a1b"],
}


def reference_hashes(tokens: list[int], page_size: int, namespace: str, salt: str) -> list[str]:
    """The documented definition, written out independently of bus_schemas.page_hash."""
    parent = hashlib.blake2b(
        b"hicache-root" + namespace.encode() + b"\x00" + salt.encode(), digest_size=16
    ).digest()
    out = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = b"".join(struct.pack("<I", t) for t in tokens[start : start + page_size])
        parent = hashlib.blake2b(parent + page, digest_size=16).digest()
        out.append(parent.hex())
    return out


@pytest.mark.parametrize("salt", ["", "s"])
def test_page_hashes_pinned_vectors(salt: str) -> None:
    assert page_hashes(range(8), 4, NS, salt) == PINNED[salt]
    assert reference_hashes(list(range(8)), 4, NS, salt) == PINNED[salt]


@pytest.mark.parametrize("seed", range(4))
def test_page_hashes_match_the_definition(seed: int) -> None:
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 4, 16])
    tokens = [rng.randrange(2**32) for _ in range(rng.randrange(0, 70))]
    salt = rng.choice(["", "user-7", "ü"])
    ns = make_namespace("m", "bfloat16", page_size)
    assert page_hashes(tokens, page_size, ns, salt) == reference_hashes(tokens, page_size, ns, salt)


def test_page_hash_properties() -> None:
    tokens = list(range(40))
    full = page_hashes(tokens, 4, NS)
    assert len(full) == 10 and len(set(full)) == 10
    assert all(len(h) == 32 and int(h, 16) >= 0 for h in full)
    # partial pages are not hashed
    assert page_hashes(tokens[:11], 4, NS) == full[:2]
    assert page_hashes(tokens[:3], 4, NS) == []
    # a prefix's hashes are a prefix of the hashes
    for n in range(0, 41):
        assert page_hashes(tokens[:n], 4, NS) == full[: n // 4]
    # salts and namespaces never share a page
    other_salt = page_hashes(tokens, 4, NS, "s")
    other_ns = page_hashes(tokens, 4, make_namespace("tiny", "float32", 4))
    assert not set(full) & set(other_salt)
    assert not set(full) & set(other_ns)
    assert not set(other_salt) & set(other_ns)
    # the same page after a different prefix is a different page
    assert page_hashes([9, 9, 9, 9, *tokens[4:8]], 4, NS)[1] != full[1]
    assert make_namespace("tiny", "float64", 4) == NS
    with pytest.raises(ValueError):
        page_hashes(tokens, 0, NS)


# ----------------------------------------------------------------- codec

SAMPLES: dict[type[Message], Message] = {
    Sampling: Sampling(8, 0.7, 0.9, 42, [2, 3], True, 5, 0.1, 1.2, 0.5, -0.5, {"7": -3.0}, 2),
    ModelCardRequest: ModelCardRequest(),
    ModelCard: ModelCard(
        "smol", "smollm2", "json", '{"model": {}}', "{{ m }}", [2], 1, 8192, 49152
    ),
    GenerateRequest: GenerateRequest("r1", [1, 2, 3], Sampling(seed=None), "inbox.1", "salt"),
    TokenChunk: TokenChunk("r1", 3, [5, 6], "e1", 3, 4, 0, True, "stop", None, 0),
    Heartbeat: Heartbeat(
        "e1",
        "b0",
        "1700000000000000000",
        "tiny",
        NS,
        4,
        64,
        260,
        [0],
        1,
        2,
        30,
        0.2,
        "decode",
        0.25,
        0.5,
        96,
        3,
        4,
    ),
    KVEvent: KVEvent("removed", "host", ["ab" * 16]),
    KVEventBatch: KVEventBatch(
        "e1",
        "b0",
        "17",
        5,
        NS,
        [KVEvent("stored", "device", ["ab" * 16, "cd" * 16]), KVEvent("removed", "host", [])],
        True,
    ),
    SnapshotRequest: SnapshotRequest("e1", "gap"),
    AbortRequest: AbortRequest("r1"),
    StreamCheck: StreamCheck("r1", "_INBOX.x.1"),
    StreamState: StreamState("r1", "e1", True, 3),
    Progress: Progress("r1", "e1", "computing"),
    FlushRequest: FlushRequest(),
    FlushReply: FlushReply("e1", False, "busy"),
    StatsRequest: StatsRequest(),
    StatsReply: StatsReply("e1", "b0", "17", {"hits": 3, "misses": 0}),
    ErrorReply: ErrorReply("bad", 422),
    DecodeAdmit: DecodeAdmit("r2", [1, 2], Sampling(), "inbox.2", "s", False, 5.0),
    DecodeAdmitReply: DecodeAdmitReply("r2", "d0", 8, "hicache.engine.d0.kv", 4, 4),
    PrefillRequest: PrefillRequest("r2", [1, 2], Sampling(), "", 0, "kv.d0", "inbox.3"),
    KVChunkAck: KVChunkAck("r2", 3, False, "checksum"),
}


def test_kv_frame_round_trip_and_corruption() -> None:
    header = KVFrameHeader("0123456789abcdef0123456789abcdef", 2, 16, 27, 99, True, 8, 4)
    frame = encode_frame(header, b"\x01\x02" * 50)
    got, payload = decode_frame(frame)
    assert got == dataclasses.replace(header, shard_len=100) and bytes(payload) == b"\x01\x02" * 50
    assert peek_request_id(frame) == header.request_id
    corrupt = bytearray(frame)
    corrupt[-3] ^= 0xFF
    with pytest.raises(SchemaError, match="checksum"):
        decode_frame(bytes(corrupt))
    for bad in (frame[:40], b"XXXX" + frame[4:], frame + b"\0"):
        with pytest.raises(SchemaError):
            decode_frame(bad)


def test_model_card_digest_and_tokenizer_kinds() -> None:
    card = SAMPLES[ModelCard]
    assert isinstance(card, ModelCard)
    assert card.digest == ModelCard.decode(card.encode()).digest and len(card.digest) == 24
    other = ModelCard("smol", "smollm2", "json", '{"model": {}}', None, [2], 1, 8192, 49152)
    assert other.digest != card.digest  # any change of content changes the digest
    with pytest.raises(ValueError, match="tokenizer_json"):
        ModelCard("t", "tiny", "bytes", "{}", None, [257], 256, 8192, 260)
    with pytest.raises(ValueError, match="'bytes' or 'json'"):
        ModelCard("t", "tiny", "spm", "", None, [257], 256, 8192, 260)


def test_kv_frame_carries_its_rank_and_layout() -> None:
    header = KVFrameHeader("r", 0, 0, 8, rank=3, world_size=4, tp_size=2)
    got, _ = decode_frame(encode_frame(header, b"kv"))
    assert (got.rank, got.world_size, got.tp_size, got.pp_size) == (3, 4, 2, 2)
    zeros = bytearray(encode_frame(KVFrameHeader("r", 0, 0, 8), b"kv"))
    zeros[72:78] = bytes(6)  # zeros read as a world of one
    assert decode_frame(bytes(zeros))[0].world_size == 1
    with pytest.raises(ValueError, match="not in a world"):
        KVFrameHeader("r", 0, 0, 8, rank=2, world_size=2)
    with pytest.raises(ValueError, match="does not divide"):
        KVFrameHeader("r", 0, 0, 8, rank=0, world_size=4, tp_size=3)
    older = bytearray(encode_frame(header, b"kv"))
    for magic in (b"HKV1", b"HKV2"):  # another payload order; no parts: refused, never misread
        older[:4] = magic
        with pytest.raises(SchemaError, match="magic"):
            decode_frame(bytes(older))


def test_kv_frame_carries_a_part_of_its_shard() -> None:
    header = KVFrameHeader("r", 5, 16, 32, part_offset=4096, shard_len=10_000)
    got, payload = decode_frame(encode_frame(header, b"\x07" * 3000))
    assert got == header and bytes(payload) == b"\x07" * 3000
    with pytest.raises(ValueError, match="overruns"):  # 4096 + 6000 > 10000
        encode_frame(header, b"\x07" * 6000)
    frame = bytearray(encode_frame(header, b"\x07" * 3000))
    frame[88:92] = (5000).to_bytes(4, "little")  # a shard too short for the part: refused
    with pytest.raises(SchemaError, match="overruns"):
        decode_frame(bytes(frame))


def all_message_classes() -> set[type[Message]]:
    return {
        cls
        for _, cls in inspect.getmembers(messages, inspect.isclass)
        if issubclass(cls, Message) and cls is not Message and cls.__module__ == messages.__name__
    }


def body_of(msg: Message) -> dict[str, Any]:
    return dict(orjson.loads(msg.encode()))


def test_samples_cover_every_message_class() -> None:
    assert set(SAMPLES) == all_message_classes()
    assert len({cls.TYPE for cls in SAMPLES}) == len(SAMPLES)


@pytest.mark.parametrize("cls", list(SAMPLES), ids=lambda c: c.__name__)
def test_round_trip(cls: type[Message]) -> None:
    msg = SAMPLES[cls]
    data = msg.encode()
    assert cls.decode(data) == msg
    assert cls.decode(data.decode()) == msg  # str works as well as bytes
    body = orjson.loads(data)
    assert (body["type"], body["v"]) == (cls.TYPE, cls.VERSION)
    defaults = {
        f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
        for f in dataclasses.fields(cls)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    }
    minimal = {k: v for k, v in body.items() if k not in defaults}
    decoded = cls.decode(orjson.dumps(minimal))
    for name, value in defaults.items():
        assert getattr(decoded, name) == value


def test_ints_are_accepted_for_floats() -> None:
    body = body_of(SAMPLES[Heartbeat]) | {"interval_s": 2}
    hb = Heartbeat.decode(orjson.dumps(body))
    assert hb.interval_s == 2.0 and isinstance(hb.interval_s, float)


def _bad(cls: type[Message], **changes: Any) -> tuple[type[Message], bytes]:
    body = body_of(SAMPLES[cls])
    for key, value in changes.items():
        if value is dataclasses.MISSING:
            del body[key]
        else:
            body[key] = value
    return cls, orjson.dumps(body)


GEN = GenerateRequest
BATCH = KVEventBatch
EVENT = {"kind": "stored", "tier": "device", "page_hashes": []}
REJECTED: dict[str, tuple[type[Message], bytes]] = {
    "not json": (GEN, b"{"),
    "empty": (GEN, b""),
    "invalid utf-8": (GEN, b"\xff\xfe"),
    "array": (GEN, b"[]"),
    "number": (GEN, b"1"),
    "string": (GEN, b'"generate"'),
    "null": (GEN, b"null"),
    "other type": (GEN, SAMPLES[Heartbeat].encode()),
    "no type": _bad(GEN, type=dataclasses.MISSING),
    "type not a string": _bad(GEN, type=1),
    "unknown version": _bad(GEN, v=4),
    "version 1 (ids as a JSON list)": _bad(GEN, v=1, input_ids=[1, 2, 3]),
    "version 2 (before the OpenAI sampling fields)": _bad(GEN, v=2),
    "version as string": _bad(GEN, v="1"),
    "no version": _bad(GEN, v=dataclasses.MISSING),
    "missing field": _bad(GEN, input_ids=dataclasses.MISSING),
    "missing nested message": _bad(GEN, sampling=dataclasses.MISSING),
    "unknown field": _bad(GEN, priority=1),
    "str for int": _bad(BATCH, seq="5"),
    "bool for int": _bad(BATCH, seq=True),
    "float for int": _bad(BATCH, seq=5.0),
    "null for int": _bad(BATCH, seq=None),
    "null for str": _bad(BATCH, engine_id=None),
    "int for str": _bad(BATCH, epoch=17),
    "bool for float": _bad(Heartbeat, interval_s=True),
    "str for float": _bad(Heartbeat, interval_s="0.2"),
    "int for bool": _bad(BATCH, snapshot=1),
    "object for list": _bad(BATCH, events={}),
    "str in list[int]": _bad(TokenChunk, token_ids=[1, "2"]),
    "bool in list[int]": _bad(TokenChunk, token_ids=[1, False]),
    "float in list[int]": _bad(TokenChunk, token_ids=[1.5]),
    "null list": _bad(TokenChunk, token_ids=None),
    "list for token ids": _bad(GEN, input_ids=[1, 2, 3]),
    "null token ids": _bad(GEN, input_ids=None),
    "int for token ids": _bad(GEN, input_ids=7),
    "token ids not base64": _bad(GEN, input_ids="AQAA!AAA"),
    "token ids unpadded base64": _bad(GEN, input_ids="AQAAAAI"),
    "token ids base64 with a newline": _bad(GEN, input_ids="AQAA\nAAA="),
    "token ids non-ascii": _bad(GEN, input_ids="AQAAAAé="),
    "token ids 3 bytes": _bad(DecodeAdmit, input_ids="AQID"),
    "token ids 5 bytes": _bad(PrefillRequest, input_ids="AQIDBAU="),
    "nested wrong type": _bad(GEN, sampling={"max_new_tokens": "8"}),
    "nested unknown field": _bad(GEN, sampling={"beam": 2}),
    "nested not an object": _bad(GEN, sampling=[1]),
    "optional wrong type": _bad(Sampling, seed="42"),
    "str in dict[str, int]": _bad(StatsReply, stats={"hits": "3"}),
    "list for dict": _bad(StatsReply, stats=[1]),
    "event not an object": _bad(BATCH, events=["stored"]),
    "event missing field": _bad(BATCH, events=[{"kind": "stored", "tier": "device"}]),
    "event hash not a string": _bad(BATCH, events=[EVENT | {"page_hashes": [1]}]),
    "event kind": _bad(BATCH, events=[EVENT | {"kind": "moved"}]),
    "event kind null": _bad(BATCH, events=[EVENT | {"kind": None}]),
    "event tier": _bad(BATCH, events=[EVENT | {"tier": "disk"}]),
    "standalone event tier": _bad(KVEvent, tier="l3"),
    "standalone event kind": _bad(KVEvent, kind="STORED"),
}


@pytest.mark.parametrize("case", list(REJECTED))
def test_decode_rejects(case: str) -> None:
    cls, data = REJECTED[case]
    with pytest.raises(SchemaError):
        cls.decode(data)


@pytest.mark.parametrize("version", [True, 1.0])
def test_decode_rejects_non_integer_version(version: Any) -> None:
    with pytest.raises(SchemaError):
        FlushRequest.decode(orjson.dumps({"type": "flush", "v": version}))


def test_kv_event_constructor_validates() -> None:
    with pytest.raises(ValueError):
        KVEvent("stored", "disk", [])
    with pytest.raises(ValueError):
        KVEvent("evicted", "device", [])


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def mutated_bodies(draw: st.DrawFn, cls: type[Message]) -> bytes:
    """A valid body of `cls` with a few fields replaced, removed or added at random."""
    body = body_of(SAMPLES[cls])
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from([*body, "extra"]))
        if draw(st.booleans()) and key in body:
            del body[key]
        else:
            body[key] = draw(json_values)
    return orjson.dumps(body)


def any_bytes(cls: type[Message]) -> st.SearchStrategy[bytes | str]:
    return (
        st.binary(max_size=64)
        | st.text(max_size=64)
        | json_values.map(orjson.dumps)
        | mutated_bodies(cls)
    )


FUZZ = settings(
    max_examples=400,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _decode_or_schema_error(cls: type[Message], data: bytes | str) -> None:
    try:
        msg = cls.decode(data)
    except SchemaError:
        return
    assert cls.decode(msg.encode()) == msg  # what decodes also round-trips


@FUZZ
@given(any_bytes(GenerateRequest))
def test_fuzz_generate_request_only_raises_schema_error(data: bytes | str) -> None:
    _decode_or_schema_error(GenerateRequest, data)


@FUZZ
@given(any_bytes(KVEventBatch))
def test_fuzz_kv_event_batch_only_raises_schema_error(data: bytes | str) -> None:
    _decode_or_schema_error(KVEventBatch, data)


# ----------------------------------------------------------------- subjects and keys


def test_subjects_and_keys() -> None:
    assert subjects.engine_snapshot("e1") == "hicache.engine.e1.snapshot"
    assert subjects.valid_token("engine-1_a")
    for bad in ("", "a.b", "a b", "a*", "a>"):
        assert not subjects.valid_token(bad)
    assert redis_keys.page("ab") == "hc:page:ab"
    assert redis_keys.engine_pages("e1") == "hc:engine:e1:pages"
    assert redis_keys.engine_meta("e1") == "hc:engine:e1:meta"
    assert redis_keys.engine_alive("e1") == "hc:engine:e1:alive"
    assert redis_keys.TIER_BITS == {"device": 1, "host": 2}


# ----------------------------------------------------------------- the lookup script


def brute_force_lookup(
    hashes: list[str], table: dict[str, dict[str, int]]
) -> dict[str, tuple[int, int]]:
    """For every engine holding the first page: (leading pages in any tier, leading on device)."""
    out: dict[str, tuple[int, int]] = {}
    for engine in table.get(hashes[0], {}):
        held = [table.get(h, {}).get(engine, 0) for h in hashes]
        total = next((i for i, bits in enumerate(held) if not bits), len(held))
        device = next(
            (i for i, bits in enumerate(held) if not bits & redis_keys.DEVICE_BIT), len(held)
        )
        out[engine] = (total, device)
    return out


async def write_table(r: aioredis.Redis, table: dict[str, dict[str, int]]) -> None:
    async with r.pipeline(transaction=False) as pipe:
        for h, holders in table.items():
            if holders:
                pipe.hset(redis_keys.page(h), mapping=holders)
        await pipe.execute()


def parse_lookup(flat: list[Any]) -> dict[str, tuple[int, int]]:
    assert len(flat) % 3 == 0
    return {str(flat[i]): (int(flat[i + 1]), int(flat[i + 2])) for i in range(0, len(flat), 3)}


@pytest.fixture
async def r(fresh_redis: ServerProcess) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(fresh_redis.url, decode_responses=True)
    yield client
    await client.aclose()


async def test_lookup_script_fixed_cases(r: aioredis.Redis) -> None:
    h = page_hashes(list(range(32)), 4, NS)  # 8 pages
    dev, host, both = redis_keys.DEVICE_BIT, redis_keys.HOST_BIT, 3
    table: dict[str, dict[str, int]] = {p: {} for p in h}
    for i in range(6):  # e1: 6 pages, device for the first 3
        table[h[i]]["e1"] = both if i < 3 else host
    for i in range(2):  # e2: host only
        table[h[i]]["e2"] = host
    for i in range(4):  # e3: device only, 4 pages
        table[h[i]]["e3"] = dev
    for i in range(1, 8):  # e4: never the first page
        table[h[i]]["e4"] = both
    for i in range(8):  # e5: every page on both tiers; e6: every page, the first 5 on device
        table[h[i]]["e5"] = both
        table[h[i]]["e6"] = both if i < 5 else host
    await write_table(r, table)
    expected = {"e1": (6, 3), "e2": (2, 0), "e3": (4, 4), "e5": (8, 8), "e6": (8, 5)}
    assert brute_force_lookup(h, table) == expected

    argv = redis_keys.lookup_argv(h)
    assert parse_lookup(await r.eval(redis_keys.PREFIX_LOOKUP_LUA, 0, *argv)) == expected
    sha = await r.script_load(redis_keys.PREFIX_LOOKUP_LUA)
    assert parse_lookup(await r.evalsha(sha, 0, *argv)) == expected
    one = await r.evalsha(sha, 0, *redis_keys.lookup_argv(h[:1]))
    assert parse_lookup(one) == {e: (1, int(e != "e2")) for e in ("e1", "e2", "e3", "e5", "e6")}
    missing = redis_keys.lookup_argv(["0" * 32, *h])
    assert parse_lookup(await r.evalsha(sha, 0, *missing)) == {}
    assert parse_lookup(await r.evalsha(sha, 0, "")) == {}
    with pytest.raises(aioredis.ResponseError, match="32 hex chars"):
        await r.evalsha(sha, 0, h[0][:-1])
    assert redis_keys.HASH_HEX_LEN == 2 * DIGEST_SIZE


@pytest.mark.parametrize("seed", range(8))
async def test_lookup_script_matches_brute_force(r: aioredis.Redis, seed: int) -> None:
    rng = random.Random(seed)
    num_pages = 40
    h = page_hashes(list(range(4 * num_pages)), 4, NS, cache_salt=str(seed))
    table: dict[str, dict[str, int]] = {p: {} for p in h}
    for engine in ("e0", "e1", "e2", "e3"):
        # what a radix tree can hold: each tier prefix-closed along the chain
        on_device, on_host = rng.randrange(num_pages + 1), rng.randrange(num_pages + 1)
        for i in range(max(on_device, on_host)):
            table[h[i]][engine] = (i < on_device) * 1 + (i < on_host) * 2
    for i in range(1, num_pages):  # an engine that lacks the first page counts for nothing
        if rng.random() < 0.5:
            table[h[i]]["late"] = 3
    await r.flushdb()
    await write_table(r, table)
    sha = await r.script_load(redis_keys.PREFIX_LOOKUP_LUA)
    for _ in range(6):
        query = h[: rng.randrange(1, num_pages + 1)]
        got = parse_lookup(await r.evalsha(sha, 0, *redis_keys.lookup_argv(query)))
        assert got == brute_force_lookup(query, table), (seed, len(query))


# ----------------------------------------------------------------- compact token ids

TOKEN_ID_MESSAGES = [GenerateRequest, DecodeAdmit, PrefillRequest]


def test_token_ids_are_array_uint32_without_copies() -> None:
    ids = as_token_ids([1, 2, 2**32 - 1])
    assert isinstance(ids, array) and ids.typecode == "I" and ids.itemsize == 4
    assert as_token_ids(ids) is ids  # already compact: no copy
    assert list(as_token_ids(range(3))) == [0, 1, 2]
    assert list(as_token_ids(b"\x01\x00\x00\x00\xff\xff\xff\xff")) == [1, 2**32 - 1]
    assert list(as_token_ids(array("i", [5]))) == [5]
    for bad in ([-1], [2**32], [1.5], ["1"], b"\x01\x02\x03", array("i", [-1])):
        with pytest.raises(ValueError):
            as_token_ids(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", TOKEN_ID_MESSAGES, ids=lambda c: c.__name__)
def test_input_ids_travel_as_base64_uint32_le(cls: type[Message]) -> None:
    msg = SAMPLES[cls]
    assert isinstance(msg.input_ids, array) and msg.input_ids.typecode == "I"  # type: ignore[attr-defined]
    body = body_of(msg)
    raw = base64.b64decode(body["input_ids"], validate=True)
    assert raw == struct.pack(f"<{len(raw) // 4}I", *msg.input_ids)  # type: ignore[attr-defined]
    assert cls.VERSION == 3  # 2: ids as base64; 3: the OpenAI sampling fields
    decoded = cls.decode(msg.encode())
    assert decoded.input_ids.typecode == "I"  # type: ignore[attr-defined]


def test_input_ids_wire_bytes_are_pinned() -> None:
    body = body_of(GenerateRequest("r", [1, 2, 3, 2**32 - 1], Sampling(), "inbox"))
    assert body["input_ids"] == "AQAAAAIAAAADAAAA/////w=="
    assert body["v"] == 3


def test_message_constructors_convert_lists_once_and_reject_bad_ids() -> None:
    ids = array("I", [4, 5])
    assert GenerateRequest("r", ids, Sampling(), "inbox").input_ids is ids
    assert GenerateRequest("r", [4, 5], Sampling(), "inbox") == GenerateRequest(
        "r", ids, Sampling(), "inbox"
    )
    for bad in ([-1], [2**32], [0.5]):
        with pytest.raises(ValueError):
            GenerateRequest("r", bad, Sampling(), "inbox")


def test_long_prompt_round_trips_exactly() -> None:
    rng = random.Random(7)
    ids = [rng.randrange(2**32) for _ in range(32768)]
    msg = PrefillRequest("r", ids, Sampling(), "", 64, "kv", "inbox")
    assert list(PrefillRequest.decode(msg.encode()).input_ids) == ids


@pytest.mark.parametrize("salt", ["", "s"])
def test_page_hashes_of_an_array_equal_the_pinned_vectors(salt: str) -> None:
    assert page_hashes(array("I", range(8)), 4, NS, salt) == PINNED[salt]
    assert page_hashes(array("I", range(10)), 4, NS, salt) == PINNED[salt]  # partial page
    with pytest.raises(ValueError):
        page_hashes([2**32, 0, 0, 0], 4, NS)


@pytest.mark.parametrize("interval_s", [0.0, 0.001, 60.5, 100.0, 1e9, float("nan")])
def test_a_heartbeat_interval_outside_its_range_is_refused(interval_s: float) -> None:
    """Liveness (and what an engine holds in the router and the index) lasts a few
    intervals: a fake engine must not pin itself for hours (issue 20, finding 2)."""
    good = Heartbeat("e1", "b", "1", "m", "ns", 4, 64, 260, [0], 0, 0, 0, 1.0)
    body = orjson.loads(good.encode())
    assert Heartbeat.decode(orjson.dumps(body)) == good
    body["interval_s"] = interval_s
    with pytest.raises(SchemaError, match="interval_s"):
        Heartbeat.decode(orjson.dumps(body))  # (NaN goes as null: refused as a type)
    body["interval_s"], body["model"] = 1.0, "m" * (messages.MAX_NAME_LEN + 1)
    with pytest.raises(SchemaError, match="model"):
        Heartbeat.decode(orjson.dumps(body))


def test_log_throttle_writes_one_line_per_cause_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    throttle = LogThrottle(logging.getLogger("throttle-test"), 10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "throttle-test"):
        assert throttle.warning("a", "bad %s", 1)
        assert not throttle.warning("a", "bad %s", 2)
        assert not throttle.warning("a", "bad %s", 3)
        assert throttle.warning("b", "other")
        now[0] = 10.0
        assert throttle.warning("a", "bad %s", 4)
    assert [r.getMessage() for r in caplog.records] == [
        "bad 1",
        "other",
        "bad 4 (and 2 more like it in the last 10s)",
    ]
