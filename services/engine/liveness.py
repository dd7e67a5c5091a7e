"""What a live engine tells the mesh on its own: a `Heartbeat` every interval, and a
`Progress` on each request it works on but sends nothing for (`Liveness`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bus_schemas import Heartbeat, Progress
from bus_schemas import subjects as subj
from gpu_worker.engine.engine import Engine
from services.engine.bus import EngineBus
from services.engine.pd_prefill import PrefillSide
from services.engine.runner import EngineRunner
from services.engine.streams import Stream, Streams
from services.tasks import OwnedTasks


@dataclass(frozen=True, slots=True)
class EngineIdentity:
    """What every heartbeat says about the engine itself (fixed once it started)."""

    engine_id: str
    bucket: str
    role: str
    epoch: str  # changes at every start
    served_model_name: str
    namespace: str  # the engine's (with its weights digest)
    page_size: int
    context_len: int
    vocab_size: int
    eos_token_ids: list[int]
    heartbeat_interval_s: float
    card_digest: str
    store_id: str  # "" without external storage


class Liveness:
    """The heartbeat and progress tasks of one engine, owned here (`stop` ends them).

    `alive()` turns false when the engine crashed: both loops end then, and `crashed()`
    cancels the heartbeats at once (a crashed engine never announces itself)."""

    def __init__(
        self,
        identity: EngineIdentity,
        runner: EngineRunner,
        engine: Engine,
        bus: EngineBus,
        streams: Streams,
        prefill: PrefillSide | None,
        alive: Callable[[], bool],
    ) -> None:
        self.identity = identity
        self.runner = runner
        self.engine = engine
        self.bus = bus
        self.streams = streams
        self.prefill = prefill
        self.alive = alive
        self._tasks = OwnedTasks()
        self._heartbeat_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._heartbeat_task = self._tasks.spawn(self._heartbeats(), "heartbeats")
        self._tasks.spawn(self._progress(), "progress")

    def crashed(self) -> None:
        """Stop heartbeating now (the tasks are awaited in `stop`)."""
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()

    async def stop(self) -> None:
        await self._tasks.cancel_all()

    def _cache_gauges(self) -> dict[str, Any]:
        """The heartbeat's cache fields, from `engine.cache_stats()`: plain counters the
        runner thread keeps, read here without a lock (a heartbeat may be one step stale)."""
        engine = self.runner.engine
        if engine is None:
            return {}
        s = engine.cache_stats()
        device_used = s["device_pages"] - s["device_pages_free"]
        host_pages = s["host_pages"]
        return {
            "token_usage": device_used / max(1, s["device_pages"]),
            "host_token_usage": s["host_pages_cached"] / host_pages if host_pages else 0.0,
            "cached_tokens": s["cached_tokens_device"]
            + s["cached_tokens_host"]
            + s["cached_tokens_storage"],
            "storage_pages_read": s["storage_pages_read"],
            "storage_pages_written": s["storage_pages_written"],
            "storage_write_failures": s.get("storage_write_failures", 0),
            "storage_quarantined": s.get("storage_quarantined", 0),
            "num_loads": s["loads"],
            "num_backups": s["backups"],
            "evicted_device_pages": s["evicted_device_pages"],
            "evicted_host_pages": s["evicted_host_pages"],
            "spec_verify_rounds": s.get("spec_verify_rounds", 0),
            "spec_proposed_tokens": s.get("spec_proposed_tokens", 0),
            "spec_accepted_tokens": s.get("spec_accepted_tokens", 0),
            "spec_emitted_tokens": s.get("spec_emitted_tokens", 0),
        }

    async def _heartbeats(self) -> None:
        me, runner = self.identity, self.runner
        since, generated = time.monotonic(), runner.generated_tokens
        while self.alive():  # a crashed engine never announces itself
            load = runner.load
            now, total = time.monotonic(), runner.generated_tokens
            throughput = (total - generated) / max(now - since, 1e-6)
            since, generated = now, total
            hb = Heartbeat(
                me.engine_id,
                me.bucket,
                me.epoch,
                me.served_model_name,
                me.namespace,
                me.page_size,
                me.context_len,
                me.vocab_size,
                me.eos_token_ids,
                load.running,
                load.waiting,
                load.inflight_tokens,
                me.heartbeat_interval_s,
                me.role,
                **self._cache_gauges(),
                card_digest=me.card_digest,
                store_id=me.store_id,
                bus_reconnects=self.bus.reconnects,
                generation_tokens=total,
                gen_throughput=throughput,
            )
            with contextlib.suppress(Exception):
                await self.bus.nc.publish(subj.heartbeat(me.engine_id), hb.encode())
            await asyncio.sleep(me.heartbeat_interval_s)

    async def _progress(self) -> None:
        """Every heartbeat interval, a `Progress` for each request the engine works on but
        has sent no chunk of since the last round, so the router's deadline (and, from a
        P/D prefill engine, the decode engine's KV watchdog) runs only while it does not:
        a long prefill is not a hang. Working means the engine computed (a decoder layer,
        within a step too: `Engine.progress`) for a queued or computing request, and wrote
        more of its KV for a receiving one. A hung step loop sends none while heartbeats
        go on, so the router still times it out."""
        runner, engine = self.runner, self.engine
        interval = self.identity.heartbeat_interval_s
        last = engine.progress
        while self.alive():
            await asyncio.sleep(interval)
            now = engine.progress
            moved, last = now != last, now
            for request_id, holding in runner.holding().items():
                stream = self.streams.get(request_id)
                if stream is None:
                    continue
                quiet, stream.seen_seq = stream.seq == stream.seen_seq, stream.seq
                working = moved
                if holding.state == "receiving":
                    working = holding.received_len != stream.seen_received_len
                    stream.seen_received_len = holding.received_len
                if quiet and working:
                    self._send_progress(request_id, stream, holding.state)

    def _send_progress(self, request_id: str, stream: Stream, state: str) -> None:
        data = Progress(request_id, self.identity.engine_id, state).encode()
        self.bus.enqueue(stream.reply_to, data)
        kv_subject = self.prefill.kv_subject(request_id) if self.prefill is not None else None
        if kv_subject is not None:  # P/D prefill: the decode engine waits for this KV
            self.bus.enqueue(kv_subject, data)
