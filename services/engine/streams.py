"""The reply stream of every request an engine holds (`Streams`), and the `TokenChunk` that
carries a runner's `TokenUpdate` on it (`token_chunk`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from bus_schemas import TokenChunk
from gpu_worker.scheduler.request import RequestError
from services.engine.pd_decode import DecodeTransfer
from services.engine.updates import TokenUpdate


@dataclass(slots=True)
class Stream:
    reply_to: str
    seq: int = 0
    # at the last progress round (`Liveness._progress`): chunks sent, KV received
    seen_seq: int = 0
    seen_received_len: int = 0


class Streams:
    """Request id -> its open `Stream`. A stream opens when the engine takes a request and
    ends with its last chunk or an error chunk; chunks go out on `enqueue` (the bus's
    ordered publisher) with the stream's next `seq`. Ending a request with an error also
    aborts it in the engine (`abort`)."""

    def __init__(
        self,
        engine_id: str,
        enqueue: Callable[[str, bytes], None],
        abort: Callable[[str], None],
    ) -> None:
        self.engine_id = engine_id
        self.enqueue = enqueue
        self.abort = abort
        self._streams: dict[str, Stream] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def __bool__(self) -> bool:
        return bool(self._streams)

    def __iter__(self) -> Iterator[str]:
        """The open streams' request ids, as a copy (ending streams while iterating is fine)."""
        return iter(list(self._streams))

    def get(self, request_id: str) -> Stream | None:
        return self._streams.get(request_id)

    def open(self, request_id: str, reply_to: str) -> None:
        self._streams[request_id] = Stream(reply_to)

    def close(self, request_id: str) -> None:
        """Forget the stream without a chunk (P/D prefill: the decode engine streams on)."""
        self._streams.pop(request_id, None)

    def send(self, request_id: str, chunk: TokenChunk) -> None:
        """Send `chunk` (its seq is the stream's next); the stream ends with a finished one."""
        stream = self._streams[request_id]
        stream.seq += 1
        self.enqueue(stream.reply_to, chunk.encode())
        if chunk.finished:
            del self._streams[request_id]

    def fail(self, request_id: str, message: str, code: int, crashed: bool = False) -> None:
        """End a request with an error chunk (or silently, with an empty message)."""
        if not message:
            self._streams.pop(request_id, None)
            self.abort(request_id)
            return
        self.send_error(request_id, message, code, crashed)

    def send_error(self, request_id: str, message: str, code: int, crashed: bool = False) -> None:
        """End an open stream with an error chunk and abort its request; else nothing."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            error = RequestError(message, code)
            self.refuse(stream.reply_to, request_id, stream.seq, error, crashed)
            self.abort(request_id)

    def refuse(
        self,
        reply_to: str,
        request_id: str,
        seq: int,
        error: RequestError,
        crashed: bool = False,
    ) -> None:
        """Send one last chunk carrying `error` to `reply_to` (no stream needs to be open)."""
        chunk = TokenChunk(
            request_id,
            seq,
            [],
            self.engine_id,
            finished=True,
            error=error.message,
            error_code=error.code,
            engine_crashed=crashed,
        )
        self.enqueue(reply_to, chunk.encode())


def token_chunk(
    u: TokenUpdate, seq: int, engine_id: str, transfer: DecodeTransfer | None
) -> TokenChunk:
    """The chunk of `u` at `seq`; a P/D decode request's first one says what its prefill
    engine sent (`transfer`)."""
    reason = None if u.error else u.finish_reason
    chunk = TokenChunk(
        u.request_id,
        seq,
        u.token_ids,
        engine_id,
        prompt_tokens=u.prompt_tokens,
        cached_device=u.cached_device,
        cached_host=u.cached_host,
        finished=u.finished,
        finish_reason=reason,
        error=u.error.message if u.error else None,
        error_code=u.error.code if u.error else 0,
        cached_storage=u.cached_storage,
        spec_verify_ct=u.spec_verify_ct,
        spec_draft_tokens=u.spec_draft_tokens,
        spec_accepted_tokens=u.spec_accepted_tokens,
        logprobs=[lp for lp, _ in u.logprobs],
        top_logprob_ids=[[i for i, _ in top] for _, top in u.logprobs],
        top_logprobs=[[v for _, v in top] for _, top in u.logprobs],
    )
    if transfer is not None and u.received is not None and seq == 0:
        chunk = dataclasses.replace(
            chunk,
            decode_prefix_len=u.received.prefix_len,
            transferred_tokens=u.received.num_tokens,
            transferred_bytes=u.received.num_bytes,
            prefill_engine_id=transfer.prefill_engine_id,
            prefill_cached_device=transfer.prefill_cached.device,
            prefill_cached_host=transfer.prefill_cached.host,
            prefill_cached_storage=transfer.prefill_cached.storage,
        )
    return chunk
