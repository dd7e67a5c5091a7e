"""Prefill/decode disaggregation on the engine service's side of the bus.

`DecodeSide` (role decode): admits a request (the engine matches, locks, reserves and starts
restoring its own prefix), answers `decode_prefix_len`, writes each KV frame into the
reserved pages and ACKs it in order, and gives up (releasing everything) when the prefill
engine goes quiet on the request for its transfer timeout: no frame, and no `Progress` (which
the prefill engine sends on the same subject while it queues or computes the request).

`PrefillSide` (role prefill): runs the prompt, gets the packed KV past `decode_prefix_len`,
and sends it as checksummed frames with a window of frames in flight, resending a NACKed
frame; the staging buffer is dropped once the last frame is ACKed.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from nats.aio.msg import Msg

from bus_schemas import (
    DecodeAdmit,
    DecodeAdmitReply,
    ErrorReply,
    KVChunkAck,
    PrefillRequest,
    Progress,
    SchemaError,
)
from bus_schemas import subjects as subj
from bus_schemas.kv_frame import MAGIC, KVFrameHeader, decode_frame, encode_frame, peek_ids
from gpu_worker.engine.engine import InvalidRequestError
from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.scheduler.request import CachedTokens, KVExport
from services.engine.runner import Admission, EngineCrashedError, EngineRunner
from services.engine.sampling import sampling_params
from services.tasks import OwnedTasks

log = logging.getLogger(__name__)

DELIVERED_MEMORY = 4096  # prefill: delivered request ids kept for routers' stream checks
Publish = Callable[..., Awaitable[None]]  # (subject, data, reply="") -> None


class FailStream(Protocol):
    """End a request's stream with an error chunk (silently with an empty message);
    `crashed`: the engine's step loop died with it (the router retries it nowhere)."""

    def __call__(self, request_id: str, message: str, code: int, crashed: bool = False) -> None: ...


@dataclass(frozen=True, slots=True)
class PDConfig:
    chunk_pages: int = 16  # pages of KV per frame
    window: int = 8  # frames in flight before waiting for ACKs
    ack_timeout_s: float = 10.0  # prefill: an ACK must come within this
    max_attempts: int = 3  # sends of one frame before the transfer fails
    debug_corrupt_frames: int = 0  # test hook: corrupt the first N frames this engine sends
    debug_exit_after_frames: int = 0  # test hook: the process dies after sending N frames


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
    # frame seqs written (ACKed ok) and being written: a copy (prefill sends the frames in
    # flight again after a NATS reconnect) is ACKed again, or left to the first's ACK
    written: set[int] = field(default_factory=set)
    writing: set[int] = field(default_factory=set)


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
        """Write one KV frame and ACK it; NACK (ok=False) a corrupt or out-of-order one. A
        `Progress` of the prefill engine on the request (not a frame) keeps it waiting."""
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
        first = header.first_token if header.last else None
        sender = ParallelConfig(header.tp_size, header.pp_size)  # any layout: cut on write
        written = self.runner.write_kv(
            header.request_id,
            header.token_start,
            header.token_end,
            payload,
            first,
            header.rank,
            sender,
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


# put on every sending job's ACK queue when this engine's NATS connection came back
_RECONNECTED = KVChunkAck("", -1, False, "NATS reconnected")
RESEND_S = 0.5  # after a reconnect: frames in flight are sent again this often until ACKed


@dataclass(slots=True)
class _PrefillJob:
    request: PrefillRequest
    acks: asyncio.Queue[KVChunkAck] = field(default_factory=asyncio.Queue)


class PrefillSide:
    def __init__(
        self,
        engine_id: str,
        runner: EngineRunner,
        publish: Publish,
        config: PDConfig,
        open_stream: Callable[[str, str], None],
        fail_stream: FailStream,
        close_stream: Callable[[str], None],
        tp_size: int = 1,
    ) -> None:
        self.engine_id = engine_id
        self.tp_size = tp_size  # of this engine: its frames carry it (world = its stagings)
        self.runner = runner
        self.publish = publish
        self.config = config
        self.open_stream = open_stream
        self.fail_stream = fail_stream
        self.close_stream = close_stream
        self.jobs: dict[str, _PrefillJob] = {}
        # requests whose KV was delivered, newest last: (request id -> reply subject)
        self._delivered: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._senders = OwnedTasks()
        self._frames_sent = 0
        self._corrupt_left = config.debug_corrupt_frames

    async def on_prefill(self, msg: Msg) -> None:
        try:
            req = PrefillRequest.decode(msg.data)
        except SchemaError as e:
            log.warning("bad PrefillRequest: %s", e)
            return
        self.open_stream(req.request_id, req.reply_to)
        try:
            sampling = sampling_params(req.sampling)
        except ValueError as e:
            self.fail_stream(req.request_id, str(e), 400)
            return
        self.jobs[req.request_id] = _PrefillJob(req)
        future = self.runner.submit(
            req.request_id,
            req.input_ids,
            sampling,
            req.cache_salt,
            export_from=req.decode_prefix_len,
        )
        try:
            await asyncio.wrap_future(future)
        except InvalidRequestError as e:
            self.jobs.pop(req.request_id, None)
            self.fail_stream(req.request_id, str(e), 400)
        except EngineCrashedError as e:
            self.jobs.pop(req.request_id, None)
            self.fail_stream(req.request_id, str(e), 500 if e.held else 503, e.held)

    async def on_ack(self, msg: Msg) -> None:
        try:
            ack = KVChunkAck.decode(msg.data)
        except SchemaError as e:
            log.warning("bad KVChunkAck: %s", e)
            return
        job = self.jobs.get(ack.request_id)
        if job is not None:
            job.acks.put_nowait(ack)

    def reconnected(self) -> None:
        """This engine's NATS connection came back: frames and ACKs in flight may have been
        lost, so every transfer sends its unACKed frames again (decode ACKs copies alike)."""
        for job in self.jobs.values():
            job.acks.put_nowait(_RECONNECTED)

    def exported(self, request_id: str, export: KVExport, cached: CachedTokens) -> None:
        """Runner callback (on the loop): the KV is packed; send it."""
        job = self.jobs.get(request_id)
        if job is None:
            return
        self._senders.spawn(self._send(job, export, cached), f"kv-send-{request_id}")

    def _frames(self, rid: str, export: KVExport, cached: CachedTokens) -> list[bytes]:
        """Chunk by chunk, one frame per exported rank (each rank's heads and layers of the
        chunk, MLA's replicated latent once per stage; a decode engine of any layout cuts
        its ranks' shards from them)."""
        per, world = self.config.chunk_pages, export.world_size
        ps, num_pages = export.page_size, export.num_pages
        frames: list[bytes] = []
        for lo in range(0, num_pages, per):
            hi = min(lo + per, num_pages)
            last = hi == num_pages
            for rank, staging in zip(export.ranks, export.stagings, strict=True):
                header = KVFrameHeader(
                    rid,
                    len(frames),
                    export.token_start + lo * ps,
                    min(export.token_start + hi * ps, export.token_end),
                    export.first_token if last else -1,
                    last,
                    cached.device,
                    cached.host,
                    rank,
                    world,
                    self.tp_size,
                    cached.storage,
                )
                payload = staging[lo:hi].contiguous().numpy().tobytes()
                frames.append(encode_frame(header, payload))
        return frames

    async def _send(self, job: _PrefillJob, export: KVExport, cached: CachedTokens) -> None:
        rid = job.request.request_id
        frames = self._frames(rid, export, cached)
        # decode writes a chunk once every rank's frame of it came: they must fit the window
        window = max(self.config.window, len(export.stagings))
        attempts = [0] * len(frames)
        inflight: set[int] = set()
        next_seq = acked = 0
        loop = asyncio.get_running_loop()
        deadline = resend_until = 0.0  # for the next ACK; of re-sending after a reconnect
        try:
            while acked < len(frames):
                while next_seq < len(frames) and len(inflight) < window:
                    await self._send_frame(job, frames, attempts, next_seq)
                    inflight.add(next_seq)
                    next_seq += 1
                    deadline = loop.time() + self.config.ack_timeout_s
                now = loop.time()
                wait = deadline - now if now >= resend_until else min(RESEND_S, deadline - now)
                try:
                    ack = await asyncio.wait_for(job.acks.get(), max(wait, 0.0))
                except TimeoutError:
                    if loop.time() >= deadline:
                        raise
                    await self._resend(job, frames, inflight)
                    continue
                if ack is _RECONNECTED:
                    deadline = resend_until = loop.time() + self.config.ack_timeout_s
                    await self._resend(job, frames, inflight)
                    continue
                if ack.seq not in inflight:
                    continue
                deadline = loop.time() + self.config.ack_timeout_s
                if ack.ok:
                    inflight.discard(ack.seq)
                    acked += 1
                elif attempts[ack.seq] >= self.config.max_attempts:
                    raise RuntimeError(f"frame {ack.seq} refused: {ack.error}")
                else:
                    await self._send_frame(job, frames, attempts, ack.seq)
        except (TimeoutError, RuntimeError) as e:
            why = str(e) or f"no ACK within {self.config.ack_timeout_s:g} s"
            log.warning("KV transfer of %s failed: %s", rid, why)
            self.fail_stream(rid, f"KV transfer to decode failed: {why}", 503)
        else:
            self.close_stream(rid)
            self._delivered[rid] = job.request.reply_to
            while len(self._delivered) > DELIVERED_MEMORY:
                self._delivered.popitem(last=False)
        finally:
            self.jobs.pop(rid, None)  # the staging buffer goes with the job

    def kv_subject(self, request_id: str) -> str | None:
        """Where the request's KV goes (its decode engine), while this engine holds it."""
        job = self.jobs.get(request_id)
        return None if job is None else job.request.kv_subject

    def delivered(self, request_id: str, reply_to: str) -> bool:
        """Whether this engine sent all of the request's KV (one of the last
        `DELIVERED_MEMORY`): a router that asks after a reconnect learns it was not lost."""
        return self._delivered.get(request_id) == reply_to

    async def _resend(self, job: _PrefillJob, frames: list[bytes], seqs: set[int]) -> None:
        """Send the frames in flight again (not counted as attempts: none was refused)."""
        for seq in sorted(seqs):
            await self.publish(
                job.request.kv_subject, frames[seq], subj.engine_kv_ack(self.engine_id)
            )

    async def _send_frame(
        self, job: _PrefillJob, frames: list[bytes], attempts: list[int], seq: int
    ) -> None:
        data = frames[seq]
        if self._corrupt_left > 0:  # test hook: flip one payload byte after the checksum
            self._corrupt_left -= 1
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        attempts[seq] += 1
        await self.publish(job.request.kv_subject, data, subj.engine_kv_ack(self.engine_id))
        self._frames_sent += 1
        if self.config.debug_exit_after_frames and (
            self._frames_sent >= self.config.debug_exit_after_frames
        ):
            log.error("debug: exiting after %d frames", self._frames_sent)
            await asyncio.sleep(0.2)  # let the client flush what was published
            os._exit(1)

    async def stop(self) -> None:
        await self._senders.cancel_all()
