"""Every NATS subject, bus message and Redis key of hicache-mesh, typed and versioned."""

from bus_schemas.codec import Message, SchemaError
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
    PrefillRequest,
    Sampling,
    SnapshotRequest,
    StatsReply,
    StatsRequest,
    TokenChunk,
)
from bus_schemas.page_hash import make_namespace, page_hashes

__all__ = [
    "AbortRequest",
    "DecodeAdmit",
    "DecodeAdmitReply",
    "ErrorReply",
    "FlushReply",
    "FlushRequest",
    "GenerateRequest",
    "Heartbeat",
    "KVChunkAck",
    "KVEvent",
    "KVEventBatch",
    "Message",
    "PrefillRequest",
    "Sampling",
    "SchemaError",
    "SnapshotRequest",
    "StatsReply",
    "StatsRequest",
    "TokenChunk",
    "make_namespace",
    "page_hashes",
]
