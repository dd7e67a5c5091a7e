"""P/D prefill side (`PrefillSide`): runs the prompt, then sends its packed KV to the
decode engine as checksummed frames within a window, resending what is NACKed or lost in a
NATS reconnect (see `pd.py`)."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from nats.aio.msg import Msg
from nats.errors import MaxPayloadError

from bus_schemas import KVChunkAck, PrefillRequest, SchemaError
from bus_schemas import subjects as subj
from gpu_worker.engine.engine import InvalidRequestError
from gpu_worker.scheduler.request import CachedTokens, KVExport
from services.engine.bus import brief
from services.engine.pd import TRANSFER_FAILED, FailStream, PDConfig, Publish, TransferError
from services.engine.pd_frames import (
    ByteWindow,
    FramePlan,
    FrameSizeError,
    cut_frames,
    payload_limit,
)
from services.engine.runner import EngineCrashedError, EngineRunner
from services.engine.sampling import sampling_params
from services.tasks import OwnedTasks

log = logging.getLogger(__name__)

DELIVERED_MEMORY = 4096  # prefill: delivered request ids kept for routers' stream checks
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
        self.track(req)
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

    def track(self, req: PrefillRequest) -> None:
        """Hold a job for `req`: its KV goes out once the runner exported it (`exported`),
        and its ACKs come to the job (`on_ack`)."""
        self.jobs[req.request_id] = _PrefillJob(req)

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
            self.fail_stream(rid, f"KV transfer to decode failed: {brief(e)}", 500)
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
            why = brief(e)
            if isinstance(e, MaxPayloadError):
                why += f" (the server's max_payload is {self.max_payload():,} bytes)"
            raise TransferError(
                f"frame {seq} of {len(frames)} ({len(data):,} bytes) could not be sent to "
                f"{job.request.kv_subject}: {why}",
                TRANSFER_FAILED,
            ) from e

    async def stop(self) -> None:
        await self._senders.cancel_all()
