"""P/D decode side (`DecodeSide`): admits a request, writes its KV frames and ACKs them in
order, and gives up when the prefill engine goes quiet on it (see `pd.py`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from nats.aio.msg import Msg

from bus_schemas import (
    DecodeAdmit,
    DecodeAdmitReply,
    ErrorReply,
    KVChunkAck,
    Progress,
    SchemaError,
)
from bus_schemas import subjects as subj
from bus_schemas.kv_frame import MAGIC, KVFrameHeader, decode_frame, peek_ids
from gpu_worker.engine.engine import InvalidRequestError
from gpu_worker.scheduler.request import CachedTokens
from services.engine.pd import FailStream, Publish
from services.engine.pd_frames import ShardAssembler, sender_layout
from services.engine.runner import EngineCrashedError, EngineRunner
from services.engine.sampling import sampling_params
from services.engine.updates import Admission
from services.tasks import OwnedTasks

log = logging.getLogger(__name__)


@dataclass(slots=True)
class DecodeTransfer:
    """What a decode engine knows about one incoming transfer."""

    prefix_len: int
    timeout_s: float
    last_heard: float  # loop time of the last frame or Progress of the prefill engine
    prefill_engine_id: str = ""
    transferred_bytes: int = 0
    prefill_cached: CachedTokens = field(default_factory=CachedTokens)
    complete: bool = False
    nacks: int = 0
    admitted: tuple[str, bytes] = ("", b"")  # (reply_to, DecodeAdmitReply): for a re-ask
    # frame seqs written or held (ACKed ok) and being written: a copy (prefill sends the
    # frames in flight again after a NATS reconnect) is ACKed again, or left to the first's ACK
    written: set[int] = field(default_factory=set)
    writing: set[int] = field(default_factory=set)
    shards: ShardAssembler = field(default_factory=ShardAssembler)  # shards sent in parts


def _done(data: bytes) -> asyncio.Future[bytes]:
    answer = asyncio.get_running_loop().create_future()
    answer.set_result(data)
    return answer


class DecodeSide:
    def __init__(
        self,
        engine_id: str,
        runner: EngineRunner,
        publish: Publish,
        open_stream: Callable[[str, str], None],
        fail_stream: FailStream,
    ) -> None:
        self.engine_id = engine_id
        self.runner = runner
        self.publish = publish
        self.open_stream = open_stream
        self.fail_stream = fail_stream
        self.transfers: dict[str, DecodeTransfer] = {}
        # admissions under way: (reply_to, the reply to come), for a question asked again
        self._admitting: dict[str, tuple[str, asyncio.Future[bytes]]] = {}
        self._watchdogs = OwnedTasks()
        self._writes = OwnedTasks()  # frames written and ACKed in the background

    async def on_admit(self, msg: Msg) -> None:
        """Admit a request (its KV is to come from a prefill engine). A question asked again
        (the router asks again after a NATS reconnect: the first or its answer may have been
        lost) gets the first one's answer; the request is admitted once."""
        try:
            req = DecodeAdmit.decode(msg.data)
        except SchemaError as e:
            await self._reply(msg, ErrorReply(str(e)).encode())
            return
        again = self._answer_of(req)
        if again is not None:
            await self._reply(msg, await again)
            return
        answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._admitting[req.request_id] = (req.reply_to, answer)
        try:
            data = await self._admit(req)
        except BaseException:  # a bug or a stop: a question asked again is refused, not hung
            answer.set_result(self._refusal(req.request_id, "admission failed", 503))
            raise
        finally:
            self._admitting.pop(req.request_id, None)
        answer.set_result(data)
        await self._reply(msg, data)

    def _answer_of(self, req: DecodeAdmit) -> Awaitable[bytes] | None:
        """The answer to a question asked before, or None for a new one."""
        admitting = self._admitting.get(req.request_id)
        transfer = self.transfers.get(req.request_id)
        if admitting is not None:
            reply_to, answer = admitting
        elif transfer is not None:
            reply_to, answer = transfer.admitted[0], _done(transfer.admitted[1])
        else:
            return None
        if reply_to != req.reply_to:  # another request under the same id: not ours to merge
            return _done(self._refusal(req.request_id, "duplicate request id", 400))
        return asyncio.shield(answer)

    async def _admit(self, req: DecodeAdmit) -> bytes:
        """Submit `req` for admission; the DecodeAdmitReply to send (a refusal included)."""
        try:
            sampling = sampling_params(req.sampling)
        except ValueError as e:
            return self._refusal(req.request_id, str(e), 400)
        self.open_stream(req.request_id, req.reply_to)
        future = self.runner.submit(
            req.request_id, req.input_ids, sampling, req.cache_salt, decode_reuse=req.reuse
        )
        try:
            admission = await asyncio.wrap_future(future)
        except InvalidRequestError as e:
            self.fail_stream(req.request_id, "", 0)
            return self._refusal(req.request_id, str(e), 400)
        except EngineCrashedError as e:  # 500 (never retried elsewhere) when it held it
            self.fail_stream(req.request_id, "", 0)
            return self._refusal(req.request_id, str(e), 500 if e.held else 503)
        except RuntimeError as e:
            self.fail_stream(req.request_id, "", 0)
            return self._refusal(req.request_id, str(e), 503)
        assert isinstance(admission, Admission)
        reply = DecodeAdmitReply(
            req.request_id,
            self.engine_id,
            admission.decode_prefix_len,
            subj.engine_kv(self.engine_id),
            admission.cached_device,
            admission.cached_host,
        ).encode()
        loop = asyncio.get_running_loop()
        self.transfers[req.request_id] = DecodeTransfer(
            admission.decode_prefix_len,
            req.transfer_timeout_s,
            loop.time(),
            admitted=(req.reply_to, reply),
        )
        self._watchdogs.spawn(self._watchdog(req.request_id), f"kv-watch-{req.request_id}")
        return reply

    def _refusal(self, request_id: str, message: str, code: int) -> bytes:
        return DecodeAdmitReply(
            request_id, self.engine_id, 0, "", error=message, error_code=code
        ).encode()

    async def _reply(self, msg: Msg, data: bytes) -> None:
        if msg.reply:
            await self.publish(msg.reply, data)

    async def on_frame(self, msg: Msg) -> None:
        """Write one KV frame and ACK it (a part of a shard: hold it and ACK it, the shard is
        written once whole); NACK (ok=False) a corrupt or out-of-order one. A `Progress` of
        the prefill engine on the request (not a frame) keeps it waiting."""
        if not msg.data.startswith(MAGIC):
            self._on_progress(msg.data)
            return
        ids = peek_ids(msg.data)
        try:
            header, payload = decode_frame(msg.data)
        except SchemaError as e:
            if ids is not None:
                await self._ack(msg, ids[0], ids[1], False, str(e))
                if ids[0] in self.transfers:
                    self.transfers[ids[0]].nacks += 1
            return
        transfer = self.transfers.get(header.request_id)
        if transfer is None:
            await self._ack(msg, header.request_id, header.seq, False, "unknown request")
            return
        transfer.last_heard = asyncio.get_running_loop().time()
        if header.seq in transfer.written:  # a copy of a written frame: its ACK was lost
            await self._ack(msg, header.request_id, header.seq, True, "")
            return
        if header.seq in transfer.writing:  # a copy of one being written: its ACK will come
            return
        transfer.writing.add(header.seq)
        transfer.prefill_engine_id = subj.engine_of(msg.reply or "")
        if header.last:  # before the write: the first token may go out right after it
            transfer.prefill_cached = CachedTokens(
                header.prefill_cached_device,
                header.prefill_cached_host,
                header.prefill_cached_storage,
            )
        try:
            shard = transfer.shards.add(header, payload)
        except ValueError as e:
            transfer.writing.discard(header.seq)
            transfer.nacks += 1
            await self._ack(msg, header.request_id, header.seq, False, str(e))
            return
        if shard is None:  # a part held: the shard is written once its last part comes
            transfer.writing.discard(header.seq)
            transfer.written.add(header.seq)
            await self._ack(msg, header.request_id, header.seq, True, "")
            return
        first = header.first_token if header.last else None
        sender = sender_layout(header)  # any layout: cut on write
        written = self.runner.write_kv(
            header.request_id,
            header.token_start,
            header.token_end,
            memoryview(shard),
            first,
            header.rank,
            sender,
            header.rotation,
            header.draft,
        )
        # ACKed once written, off this callback: NATS delivers a subscription's messages one
        # at a time, and a multi-rank chunk is written only when its other ranks' frames came
        self._writes.spawn(self._ack_written(msg, header, transfer, written), "kv-write")

    def _on_progress(self, data: bytes) -> None:
        try:
            progress = Progress.decode(data)
        except SchemaError as e:
            log.warning("bad message on the KV subject: %s", e)
            return
        transfer = self.transfers.get(progress.request_id)
        if transfer is not None:
            transfer.last_heard = asyncio.get_running_loop().time()

    async def _ack_written(
        self, msg: Msg, header: KVFrameHeader, transfer: DecodeTransfer, written: Future[int]
    ) -> None:
        try:
            size = await asyncio.wrap_future(written)
        except ValueError as e:
            transfer.nacks += 1
            await self._ack(msg, header.request_id, header.seq, False, str(e))
            return
        except EngineCrashedError as e:
            await self._ack(msg, header.request_id, header.seq, False, str(e))
            return
        finally:
            transfer.writing.discard(header.seq)
        transfer.shards.written(header)
        transfer.written.add(header.seq)
        transfer.transferred_bytes += size
        transfer.complete = transfer.complete or header.last
        await self._ack(msg, header.request_id, header.seq, True, "")

    async def _ack(self, msg: Msg, request_id: str, seq: int, ok: bool, error: str) -> None:
        if msg.reply:
            await self.publish(msg.reply, KVChunkAck(request_id, seq, ok, error).encode())

    async def _watchdog(self, request_id: str) -> None:
        loop = asyncio.get_running_loop()
        while (transfer := self.transfers.get(request_id)) is not None and not transfer.complete:
            if transfer.writing:  # frames came; this engine is slow to write them, not prefill
                transfer.last_heard = loop.time()
            idle = loop.time() - transfer.last_heard
            if idle > transfer.timeout_s:
                log.warning("KV transfer for %s timed out after %.1fs", request_id, idle)
                self.fail_stream(request_id, "KV transfer from prefill timed out", 503)
                self.transfers.pop(request_id, None)
                return
            await asyncio.sleep(min(0.1, transfer.timeout_s / 4))

    def finished(self, request_id: str) -> DecodeTransfer | None:
        return self.transfers.pop(request_id, None)

    async def stop(self) -> None:
        await self._watchdogs.cancel_all()
        await self._writes.cancel_all()
