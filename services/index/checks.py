"""Checks of bus input beyond the schema, before the index takes a message."""

from __future__ import annotations

from bus_schemas import subjects
from bus_schemas.codec import SchemaError
from bus_schemas.messages import Heartbeat, KVEventBatch
from services.index.fencing import parse_epoch
from services.index.store import valid_page_hash

TTL_HEARTBEATS = 3  # an engine is alive for this many heartbeat intervals after its last one
DEFAULT_HEARTBEAT_S = 1.0  # assumed until an engine's first heartbeat says otherwise


def check_batch(batch: KVEventBatch) -> int:
    """Checks beyond the schema; returns the epoch as an integer. Raises SchemaError."""
    _check_engine_id(batch.engine_id)
    if batch.seq < 0:
        raise SchemaError(f"kv_events: seq must be >= 0, got {batch.seq}")
    if batch.store_id and not subjects.valid_token(batch.store_id):
        raise SchemaError(f"kv_events: invalid store id {batch.store_id[:64]!r}")
    for event in batch.events:
        for page_hash in event.page_hashes:
            if not valid_page_hash(page_hash):
                raise SchemaError(f"kv_events: invalid page hash {page_hash[:64]!r}")
    return _epoch(batch.epoch)


def check_heartbeat(hb: Heartbeat) -> int:
    """Checks beyond the schema; returns the epoch as an integer. Raises SchemaError."""
    _check_engine_id(hb.engine_id)
    if not 0 < hb.interval_s < 86400:
        raise SchemaError(f"heartbeat: interval_s must be in (0, 86400), got {hb.interval_s}")
    return _epoch(hb.epoch)


def alive_ttl_ms(hb: Heartbeat) -> int:
    return max(1, round(TTL_HEARTBEATS * hb.interval_s * 1000))


def _check_engine_id(engine_id: str) -> None:
    if not subjects.valid_token(engine_id):
        raise SchemaError(f"invalid engine id {engine_id[:64]!r}")


def _epoch(epoch: str) -> int:
    try:
        return parse_epoch(epoch)
    except ValueError as e:
        raise SchemaError(str(e)) from None
