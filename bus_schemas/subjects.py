"""Every NATS subject of the mesh. Nothing else in the code spells a subject."""

from __future__ import annotations

PREFIX = "hicache"

FLUSH_ALL = f"{PREFIX}.flush"  # FlushRequest to every engine (request/reply, many replies)


def heartbeat(engine_id: str) -> str:
    """Heartbeat of one engine: it alone may publish here, and a heartbeat naming another
    engine id is refused (`sender_of`)."""
    return f"{PREFIX}.heartbeat.{engine_id}"


def kv_events(engine_id: str) -> str:
    """KVEventBatch of one engine, to the index (checked against `sender_of` as heartbeats)."""
    return f"{PREFIX}.kv_events.{engine_id}"


HEARTBEAT_ALL = heartbeat("*")  # every engine's heartbeats (router and index subscribe)
KV_EVENTS_ALL = kv_events("*")  # every engine's KV events (the index subscribes)


def sender_of(subject: str) -> str:
    """The engine id a `heartbeat`/`kv_events` subject speaks for (its last token), or ""."""
    parts = subject.split(".")
    kinds = ("heartbeat", "kv_events")
    return parts[2] if len(parts) == 3 and parts[0] == PREFIX and parts[1] in kinds else ""


def engine_generate(engine_id: str) -> str:
    """GenerateRequest to one engine (the router's cache-aware choice)."""
    return f"{PREFIX}.engine.{engine_id}.generate"


def bucket_generate(bucket: str) -> str:
    """GenerateRequest to any engine of a bucket (queue group `bucket_queue(bucket)`)."""
    return f"{PREFIX}.bucket.{bucket}.generate"


def bucket_queue(bucket: str) -> str:
    return f"engines-{bucket}"


def engine_decode_admit(engine_id: str) -> str:
    """DecodeAdmit to a decode engine (request/reply)."""
    return f"{PREFIX}.engine.{engine_id}.decode_admit"


def engine_prefill(engine_id: str) -> str:
    """PrefillRequest to a prefill engine."""
    return f"{PREFIX}.engine.{engine_id}.prefill"


def engine_kv(engine_id: str) -> str:
    """KV frames (bus_schemas.kv_frame) into a decode engine."""
    return f"{PREFIX}.engine.{engine_id}.kv"


def engine_kv_ack(engine_id: str) -> str:
    """KVChunkAck back to a prefill engine."""
    return f"{PREFIX}.engine.{engine_id}.kv_ack"


def engine_abort(engine_id: str) -> str:
    """AbortRequest to one engine (fire and forget)."""
    return f"{PREFIX}.engine.{engine_id}.abort"


def engine_stream_check(engine_id: str) -> str:
    """StreamCheck to one engine (its StreamState goes to the stream's reply subject)."""
    return f"{PREFIX}.engine.{engine_id}.stream_check"


def engine_flush(engine_id: str) -> str:
    return f"{PREFIX}.engine.{engine_id}.flush"


def engine_model_card(engine_id: str) -> str:
    """ModelCardRequest to one engine (request/reply: its ModelCard)."""
    return f"{PREFIX}.engine.{engine_id}.model_card"


def engine_stats(engine_id: str) -> str:
    return f"{PREFIX}.engine.{engine_id}.stats"


def engine_snapshot(engine_id: str) -> str:
    """SnapshotRequest from the index."""
    return f"{PREFIX}.engine.{engine_id}.snapshot"


def engine_of(subject: str) -> str:
    """The engine id in a per-engine subject (`hicache.engine.{id}.*`), or ""."""
    parts = subject.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == [PREFIX, "engine"] else ""


def valid_token(name: str) -> bool:
    """An id usable inside a subject: letters, digits, '-' and '_' only."""
    return bool(name) and all(c.isalnum() or c in "-_" for c in name)
