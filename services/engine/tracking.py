"""The requests an engine runner holds, and what it reports of them after every step.

The runner thread publishes each request's new tokens, its admission (P/D decode) or its
packed KV (P/D prefill) to the service through the `Outbox`; the service thread reads what
the engine does with each request (`holding`) and the engine's load between steps.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from gpu_worker.cache.kv_events import KVEventRecord
from gpu_worker.scheduler.request import CachedTokens, KVExport, Req, ReqState, RequestError
from gpu_worker.scheduler.scheduler import Scheduler
from services.engine.futures import fail, resolve
from services.engine.updates import (
    COMPUTING,
    QUEUED,
    Admission,
    Holding,
    LoadInfo,
    ReceivedKV,
    TokenUpdate,
)


class Outbox(Protocol):
    """Where the runner reports; called on the service's event loop, in order."""

    def tokens(self, updates: list[TokenUpdate]) -> None: ...

    def exported(self, request_id: str, export: KVExport, cached: CachedTokens) -> None:
        """P/D prefill: a request's KV is packed and ready to send."""
        ...

    def kv_events(self, events: list[KVEventRecord]) -> None: ...

    def crashed(self, reason: str, suspect: bool) -> None:
        """The step loop died: this runner takes no more work. `suspect`: the requests it
        held may have caused it (see `EngineCrashedError.held`)."""
        ...


_HOLDING = {
    ReqState.WAITING: QUEUED,
    ReqState.LOADING: COMPUTING,
    ReqState.PREFILL: COMPUTING,
    ReqState.DECODE: COMPUTING,
}


@dataclass(slots=True)
class _Tracked:
    request_id: str
    req: Req
    sent: int = 0
    admitted: Future[Admission] | None = None  # P/D decode: resolves on admission
    holding: Holding = QUEUED  # as last published in RequestTracker.holding


class RequestTracker:
    """The runner's requests by engine rid and by request id. Runner thread, except
    `holding`, `set_holding` and the plain counters (`load`, `generated_tokens`), which the
    service thread uses too."""

    def __init__(self, loop: asyncio.AbstractEventLoop, outbox: Outbox) -> None:
        self._loop = loop
        self._outbox = outbox
        self._tracked: dict[int, _Tracked] = {}
        self._by_request: dict[str, int] = {}
        self.load = LoadInfo(0, 0, 0)
        # what the engine does with each request it holds, by request id: written by submit
        # (service thread) and after every step (runner thread), read by the service
        self._holding: dict[str, Holding] = {}
        self._holding_lock = threading.Lock()
        self.generated_tokens = 0  # output tokens reported so far (read by heartbeats)

    def track(self, request_id: str, req: Req, admitted: Future[Admission] | None) -> None:
        """Report on `req` from now on; a P/D decode request resolves `admitted` once
        admitted."""
        self._tracked[req.rid] = _Tracked(request_id, req, admitted=admitted)
        self._by_request[request_id] = req.rid

    def rid_of(self, request_id: str) -> int | None:
        return self._by_request.get(request_id)

    def holds_prompt_token(self, token: int) -> bool:
        return any(token in t.req.prompt_ids for t in self._tracked.values())

    def receiving_to_computing(self, rid: int) -> None:
        """A received KV chunk is queued: the next step writes it (and, the last one, runs
        its first decode), so a receiving request is computing."""
        tracked = self._tracked[rid]
        if tracked.holding.state == "receiving":
            tracked.holding = COMPUTING
            self.set_holding(tracked.request_id, COMPUTING)

    def holding(self) -> dict[str, Holding]:
        """Every request the engine holds, by request id, as of its last step (a request
        submitted since is `queued`). Any thread."""
        with self._holding_lock:
            return dict(self._holding)

    def set_holding(self, request_id: str, holding: Holding | None) -> None:
        with self._holding_lock:
            if holding is None:
                self._holding.pop(request_id, None)
            else:
                self._holding[request_id] = holding

    def publish(self, scheduler: Scheduler | None) -> None:
        """After a step: every request's new tokens (finished ones untracked), admissions,
        exports and holdings; the engine's load."""
        updates = []
        for rid, t in list(self._tracked.items()):
            req = t.req
            new = req.output_ids[t.sent :]
            finished = req.finish_reason is not None
            self._report_admission(t)
            self._note_holding(t)
            if req.export_from is not None:  # P/D prefill: no tokens, the KV is the result
                if finished:
                    self._report_export(rid, t)
                continue
            if not new and not finished:
                continue
            logprobs = tuple(req.logprobs[t.sent : t.sent + len(new)])
            t.sent += len(new)
            self.generated_tokens += len(new)
            updates.append(
                TokenUpdate(
                    t.request_id,
                    list(new),
                    prompt_tokens=req.prompt_len,
                    cached_device=req.cached.device,
                    cached_host=req.cached.host,
                    finished=finished,
                    finish_reason=req.finish_reason,
                    error=req.error,
                    received=_received(req),
                    logprobs=logprobs,
                    cached_storage=req.cached.storage,
                    spec_verify_ct=len(req.spec_rounds),
                    spec_draft_tokens=req.spec_proposed,
                    spec_accepted_tokens=req.spec_accepted,
                )
            )
            if finished:
                self._untrack(rid, t)
        if scheduler is not None:
            running = scheduler.running
            inflight = sum(r.prompt_len + r.sampling.max_new_tokens for r in running)
            self.load = LoadInfo(len(running), len(scheduler.waiting), inflight)
        if updates:
            self._loop.call_soon_threadsafe(self._outbox.tokens, updates)

    def _note_holding(self, t: _Tracked) -> None:
        """Publish what the engine now does with `t` (for `holding`), when it changed."""
        req = t.req
        holding = _HOLDING.get(req.state)
        if holding is None:  # receiving, or finished (untracked below)
            remote = req.remote
            if req.state is not ReqState.RECEIVING or remote is None:
                return
            received = max(remote.received_end - max(remote.prefix_len, 0), 0)
            if t.holding.state == "receiving" and t.holding.received_len == received:
                return
            holding = Holding("receiving", received)
        elif holding is t.holding:
            return
        t.holding = holding
        self.set_holding(t.request_id, holding)

    def _untrack(self, rid: int, t: _Tracked) -> None:
        del self._tracked[rid]
        self._by_request.pop(t.request_id, None)
        self.set_holding(t.request_id, None)

    def _report_admission(self, t: _Tracked) -> None:
        fut, req = t.admitted, t.req
        if fut is None or fut.done() or req.remote is None:
            return
        if req.remote.prefix_len >= 0:
            resolve(fut, Admission(req.remote.prefix_len, req.cached.device, req.cached.host))
        elif req.finish_reason is not None:
            fail(fut, RuntimeError(f"request ended before admission: {req.finish_reason}"))

    def _report_export(self, rid: int, t: _Tracked) -> None:
        req = t.req
        self._untrack(rid, t)
        if req.export is not None:
            export, cached = req.export, req.cached
            self._loop.call_soon_threadsafe(self._outbox.exported, t.request_id, export, cached)
            return
        error = req.error or RequestError(f"prefill ended without KV ({req.finish_reason})", 500)
        update = TokenUpdate(
            t.request_id,
            [],
            prompt_tokens=req.prompt_len,
            cached_device=0,
            cached_host=0,
            finished=True,
            finish_reason=None,
            error=error,
        )
        self._loop.call_soon_threadsafe(self._outbox.tokens, [update])

    def fail_all(self, error: Callable[[], BaseException]) -> None:
        """The engine died: fail every admission still awaited (with a new `error()` each)
        and forget every request."""
        for t in self._tracked.values():
            if t.admitted is not None:
                fail(t.admitted, error())
        self._tracked.clear()
        self._by_request.clear()
        with self._holding_lock:
            self._holding.clear()


def _received(req: Req) -> ReceivedKV | None:
    r = req.remote
    if r is None or r.prefix_len < 0:
        return None
    return ReceivedKV(r.prefix_len, r.received_end - r.prefix_len, r.received_bytes)
