"""Prefill/decode disaggregation on the engine service's side of the bus.

`DecodeSide` (role decode): admits a request (the engine matches, locks, reserves and starts
restoring its own prefix), answers `decode_prefix_len`, writes each KV frame into the
reserved pages and ACKs it in order, and gives up (releasing everything) when the prefill
engine goes quiet on the request for its transfer timeout: no frame, and no `Progress` (which
the prefill engine sends on the same subject while it queues or computes the request).

`PrefillSide` (role prefill): runs the prompt (the service tells the decode engine that it
still works on it: a long prefill on a CPU is not a lost one), gets the packed KV past `decode_prefix_len`, and sends it as checksummed frames sized in bytes
from the NATS server's `max_payload` (`pd_frames.py`), with a window of frames per transfer
and of bytes per engine in flight, resending a NACKed frame; the staging buffer is dropped
once the last frame is ACKed. A frame that cannot be published (any publish error) fails the
transfer at once, naming the cause.
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
from nats.errors import MaxPayloadError

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
from bus_schemas.kv_frame import HEADER_SIZE, MAGIC, KVFrameHeader, decode_frame, peek_ids
from gpu_worker.engine.engine import InvalidRequestError
from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.scheduler.request import CachedTokens, KVExport
from services.engine.pd_frames import (
    MIN_PAYLOAD,
    ByteWindow,
    FramePlan,
    FrameSizeError,
    ShardAssembler,
    cut_frames,
    payload_limit,
)
from services.engine.runner import EngineCrashedError, EngineRunner
from services.engine.sampling import sampling_params
from services.engine.updates import Admission
from services.tasks import OwnedTasks

log = logging.getLogger(__name__)

DELIVERED_MEMORY = 4096  # prefill: delivered request ids kept for routers' stream checks
Publish = Callable[..., Awaitable[None]]  # (subject, data, reply="") -> None


class FailStream(Protocol):
    """End a request's stream with an error chunk (silently with an empty message);
    `crashed`: the engine's step loop died with it (the router retries it nowhere)."""

    def __call__(self, request_id: str, message: str, code: int, crashed: bool = False) -> None: ...


TRANSFER_FAILED = 502  # error code of a transfer that failed on the prefill side


@dataclass(frozen=True, slots=True)
class PDConfig:
    """How a prefill engine sends KV (the decode side's transfer timeout comes with each
    request from the router)."""

    frame_bytes: int = 0  # largest KV frame, header included; 0: the server's max_payload
    window: int = 8  # frames in flight per transfer before waiting for ACKs
    window_bytes: int = 32 * 1024 * 1024  # KV bytes in flight per prefill engine
    ack_timeout_s: float = 10.0  # prefill: an ACK must come within this
    max_attempts: int = 3  # sends of one frame before the transfer fails
    debug_corrupt_frames: int = 0  # test hook: corrupt the first N frames this engine sends
    debug_exit_after_frames: int = 0  # test hook: the process dies after sending N frames

    def __post_init__(self) -> None:
        smallest = HEADER_SIZE + MIN_PAYLOAD
        if self.frame_bytes and self.frame_bytes < smallest:
            raise ValueError(f"--disaggregation-frame-bytes must be 0 or >= {smallest}")
        if self.window < 1:
            raise ValueError("--disaggregation-window must be >= 1")
        if self.window_bytes < smallest:
            raise ValueError(f"--disaggregation-window-bytes must be >= {smallest}")
        if not self.ack_timeout_s > 0:
            raise ValueError("--disaggregation-ack-timeout must be positive")


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
        sender = ParallelConfig(header.tp_size, header.pp_size)  # any layout: cut on write
        written = self.runner.write_kv(
            header.request_id,
            header.token_start,
            header.token_end,
            memoryview(shard),
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


class TransferError(RuntimeError):
    """A KV transfer failed on the prefill side; `code` is the error code its request gets:
    503 (decode did not take the frames) or `TRANSFER_FAILED` (a frame could not be sent)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _brief(e: BaseException) -> str:
    """An exception in one line (nats.py errors often have an empty str())."""
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


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
        *,
        max_payload: Callable[[], int],
    ) -> None:
        """`max_payload`: the NATS server's limit on one message, now (the connection's, from
        the server's INFO; read for every transfer, as a reconnect may reach another server)."""
        self.engine_id = engine_id
        self.tp_size = tp_size  # of this engine: its frames carry it (world = its stagings)
        self.runner = runner
        self.publish = publish
        self.config = config
        self.max_payload = max_payload
        self.window = ByteWindow(config.window_bytes)  # shared by this engine's transfers
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

    def finished(self, request_id: str) -> None:
        """The request ended without KV to send (an error, an abort): forget it."""
        self.jobs.pop(request_id, None)

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

    def plan(self, rid: str, export: KVExport, cached: CachedTokens) -> FramePlan:
        """The request's frames, sized for the server this engine is connected to now."""
        cap = self.config.frame_bytes
        server = self.max_payload()
        frame_limit = min(server, cap) if cap else server
        try:
            limit = payload_limit(frame_limit, len(export.stagings), self.config.window_bytes)
        except FrameSizeError as e:
            raise TransferError(str(e), TRANSFER_FAILED) from None
        return cut_frames(rid, export, cached, self.tp_size, limit)

    async def _send(self, job: _PrefillJob, export: KVExport, cached: CachedTokens) -> None:
        rid = job.request.request_id
        try:
            await self._transfer(job, self.plan(rid, export, cached))
        except TransferError as e:
            log.warning("KV transfer of %s failed: %s", rid, e)
            self.fail_stream(rid, f"KV transfer to decode failed: {e}", e.code)
        except Exception as e:  # a bug: the request fails with it, the engine serves on
            log.exception("KV transfer of %s failed", rid)
            self.fail_stream(rid, f"KV transfer to decode failed: {_brief(e)}", 500)
        else:
            self.close_stream(rid)
            self._delivered[rid] = job.request.reply_to
            while len(self._delivered) > DELIVERED_MEMORY:
                self._delivered.popitem(last=False)
        finally:
            self.jobs.pop(rid, None)  # the staging buffer goes with the job

    async def _transfer(self, job: _PrefillJob, plan: FramePlan) -> None:
        """Send `plan`'s frames unit by unit within both windows, until every frame is ACKed;
        TransferError when a frame cannot be sent, is refused too often, or no ACK comes."""
        frames = plan.frames
        # decode writes a chunk once every rank's last part of it came: they must fit
        window = max(self.config.window, plan.num_ranks)
        attempts = [0] * len(frames)
        inflight: set[int] = set()
        next_unit = next_seq = acked = 0
        loop = asyncio.get_running_loop()
        deadline = resend_until = 0.0  # for the next ACK; of re-sending after a reconnect
        try:
            while acked < len(frames):
                while next_unit < len(plan.units):
                    size = plan.units[next_unit]
                    num_bytes = plan.unit_bytes(next_seq, size)
                    if not inflight:  # nothing of ours to wait for: wait for the window
                        await self.window.take(num_bytes)
                    elif len(inflight) + size > window or not self.window.try_take(num_bytes):
                        break
                    seqs = range(next_seq, next_seq + size)
                    inflight.update(seqs)  # in flight from here: released on the way out
                    for seq in seqs:
                        await self._send_frame(job, frames, attempts, seq)
                    next_seq, next_unit = next_seq + size, next_unit + 1
                    deadline = loop.time() + self.config.ack_timeout_s
                now = loop.time()
                wait = deadline - now if now >= resend_until else min(RESEND_S, deadline - now)
                try:
                    ack = await asyncio.wait_for(job.acks.get(), max(wait, 0.0))
                except TimeoutError:
                    if loop.time() >= deadline:
                        raise TransferError(
                            f"no ACK within {self.config.ack_timeout_s:g} s", 503
                        ) from None
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
                    self.window.release(len(frames[ack.seq]))
                    acked += 1
                elif attempts[ack.seq] >= self.config.max_attempts:
                    raise TransferError(f"frame {ack.seq} refused: {ack.error}", 503)
                else:
                    await self._send_frame(job, frames, attempts, ack.seq)
        finally:
            self.window.release(sum(len(frames[seq]) for seq in inflight))

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
            await self._publish(job, frames, seq, frames[seq])

    async def _send_frame(
        self, job: _PrefillJob, frames: list[bytes], attempts: list[int], seq: int
    ) -> None:
        data = frames[seq]
        if self._corrupt_left > 0:  # test hook: flip one payload byte after the checksum
            self._corrupt_left -= 1
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        attempts[seq] += 1
        await self._publish(job, frames, seq, data)
        self._frames_sent += 1
        if self.config.debug_exit_after_frames and (
            self._frames_sent >= self.config.debug_exit_after_frames
        ):
            log.error("debug: exiting after %d frames", self._frames_sent)
            await asyncio.sleep(0.2)  # let the client flush what was published
            os._exit(1)

    async def _publish(self, job: _PrefillJob, frames: list[bytes], seq: int, data: bytes) -> None:
        """Publish one frame; any error fails the transfer now, naming it (waiting for an ACK
        that cannot come would only delay the router's retry)."""
        try:
            await self.publish(job.request.kv_subject, data, subj.engine_kv_ack(self.engine_id))
        except Exception as e:
            why = _brief(e)
            if isinstance(e, MaxPayloadError):
                why += f" (the server's max_payload is {self.max_payload():,} bytes)"
            raise TransferError(
                f"frame {seq} of {len(frames)} ({len(data):,} bytes) could not be sent to "
                f"{job.request.kv_subject}: {why}",
                TRANSFER_FAILED,
            ) from e

    async def stop(self) -> None:
        await self._senders.cancel_all()
