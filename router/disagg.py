"""Prefill/decode disaggregation, the router's part (DESIGN.md section 6).

One P/D attempt, hop by hop (`Generation` drives it over one `EngineStream` of the decode
engine D, watching the prefill engine P):
1. `admit`: `DecodeAdmit` to D, request/reply within `pd_admit_timeout_s`. D matches the
   prompt against its own cache (unless `reuse` is False), reserves pages and answers
   `decode_prefix_len` and the `kv_subject` to send KV to.
2. `PrefillRequest` to P: it computes what its own cache lacks and sends KV of positions
   `>= decode_prefix_len` to `kv_subject`. It reports to its own reply subject only when
   something fails.
3. D streams `TokenChunk`s once restore and reception are complete, like a colocated
   engine; the first says what moved (`PDInfo`).

Retries (`retry_kind`), each kind at most once per request and only before the first chunk:
"restore" (D could not restore the prefix it promised: the same engines again, with
`reuse=False`), "prefill" (P failed, could not send its KV, or its KV never arrived: another
prefill engine if one is live, else the same), "decode" (D refused or failed: another decode engine). Never retried:
a request either engine was running when its step loop crashed ("engine_crashed": an error
chunk so marked, or an admit refused with code 500), since it may be the cause.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from bus_schemas import DecodeAdmit, DecodeAdmitReply, ErrorReply, SchemaError, TokenChunk, subjects
from router.stream import EngineFailure, EngineStream


@dataclass(frozen=True, slots=True)
class PDInfo:
    """What a P/D request reused and moved; `usage["disaggregation"]` in responses."""

    prefill_engine: str
    decode_engine: str
    decode_prefix_len: int  # prompt tokens decode reused from its own cache
    transferred_tokens: int  # KV tokens sent from prefill to decode
    transferred_bytes: int
    prefill_cached_device: int  # prompt tokens prefill did not compute, by tier
    prefill_cached_host: int
    prefill_cached_storage: int
    decode_cached_device: int  # decode's own reuse, by tier
    decode_cached_host: int

    @classmethod
    def from_first_chunk(
        cls, chunk: TokenChunk, prefill_engine: str, admitted: DecodeAdmitReply
    ) -> PDInfo:
        """From the decode engine's first chunk (its admit reply where the chunk is silent)."""
        prefix_len = chunk.decode_prefix_len
        return cls(
            prefill_engine=prefill_engine,
            decode_engine=chunk.engine_id,
            decode_prefix_len=prefix_len if prefix_len >= 0 else admitted.decode_prefix_len,
            transferred_tokens=chunk.transferred_tokens,
            transferred_bytes=chunk.transferred_bytes,
            prefill_cached_device=chunk.prefill_cached_device,
            prefill_cached_host=chunk.prefill_cached_host,
            prefill_cached_storage=chunk.prefill_cached_storage,
            decode_cached_device=chunk.cached_device,
            decode_cached_host=chunk.cached_host,
        )

    @property
    def prefill_cached_tokens(self) -> int:
        """Prompt tokens the prefill engine did not compute (its own cache hit)."""
        return self.prefill_cached_device + self.prefill_cached_host + self.prefill_cached_storage

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


async def admit(stream: EngineStream, request: DecodeAdmit, timeout_s: float) -> DecodeAdmitReply:
    """Ask the stream's (decode) engine to admit `request`; its reply, checked.

    Raises EngineFailure: "rejected" (the engine found the request invalid: error_code 400),
    "unavailable" (any other refusal), "timeout", "bad_message" (a reply that does not fit).
    A refusal means the engine holds nothing: the stream will not abort it.
    """
    data = await stream.ask(subjects.engine_decode_admit(stream.engine_id), request, timeout_s)
    try:
        reply = DecodeAdmitReply.decode(data)
    except SchemaError:
        error = _error_reply(data)
        if error is None:
            raise _bad_reply(stream) from None
        stream.finished = True
        raise _refusal(stream, *error) from None
    if reply.error is not None:
        stream.finished = True
        raise _refusal(stream, reply.error_code, reply.error)
    if (
        reply.request_id != request.request_id
        or not 0 <= reply.decode_prefix_len <= len(request.input_ids)
        or not reply.kv_subject
    ):
        raise _bad_reply(stream)
    return reply


def retry_kind(failure: EngineFailure, prefill_engine: str) -> str | None:
    """The retry a failed P/D attempt calls for: "restore", "prefill", "decode", "bus" (on
    any engines: it was lost in a NATS reconnect), or None when it must not be retried (the
    client saw output, or the request itself is bad)."""
    if failure.num_chunks > 0 or failure.status < 500 or failure.kind == "engine_crashed":
        return None
    if failure.kind == "restore_failed":
        return "restore"
    if failure.kind == "bus":
        return "bus"
    if failure.engine_id == prefill_engine or failure.kind == "transfer_timeout":
        return "prefill"
    return "decode"


def _error_reply(data: bytes) -> tuple[int, str] | None:
    """(code, message) of an `ErrorReply`; None when `data` is not one either."""
    try:
        reply = ErrorReply.decode(data)
    except SchemaError:
        return None
    return reply.code, reply.message


def _refusal(stream: EngineStream, code: int, message: str) -> EngineFailure:
    """400: the request is invalid; 500: the engine crashed while admitting it (not to be
    retried); anything else: the engine cannot take it now."""
    kind = {400: "rejected", 500: "engine_crashed"}.get(code, "unavailable")
    eid = stream.engine_id
    return EngineFailure(kind, eid, f"decode engine {eid}: {message}", 0, stream.epochs[eid])


def _bad_reply(stream: EngineStream) -> EngineFailure:
    eid = stream.engine_id
    message = f"decode engine {eid}: bad admit reply"
    return EngineFailure("bad_message", eid, message, 0, stream.epochs[eid])
