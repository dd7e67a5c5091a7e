"""The engine's own thread: rank 0 of the engine's world, fed by commands.

The asyncio service never touches the engine directly. It sends commands through a
thread-safe queue (`submit`, `abort`, `flush`, `write_kv`, `query`), and the runner reports
back through `Outbox` callbacks that it schedules onto the service's event loop: new tokens
per request, KV events, and answers. One thread owns the engine, so the scheduler stays the
one writer of the tree; the engine turns every state-changing input into a command that it
hands to all its ranks at the next step (`gpu_worker/engine/commands.py`), and a command's
result (a KV write, a flush) is answered after that step. `query` runs read-only functions
(stats, snapshots) on rank 0 between steps.

With `--tp-size`/`--pp-size` above 1 the runner launches the other ranks as processes
(`gpu_worker/engine/rank.py`) and watches them: a rank that exits ends the engine at once,
exactly like a crash of the step loop. An idle multi-rank engine still steps every
`KEEPALIVE_S` seconds, so its ranks never wait out a collective's timeout.

A request's own failure (e.g. in its sampling) is the scheduler's to isolate: it finishes
that request with an error. Anything that escapes `engine.step()` kills the step loop: the
runner fails every pending command, then tells the service (`Outbox.crashed`), which stops
heartbeating, fails every request it holds and exits the process. Whether those requests
may be retried on another engine depends on the cause: a crash of the step loop, or a rank
that raised or crashed, may be a request's doing (`suspect`: never retried, so one poison
request cannot take down the fleet); a rank killed from outside (SIGKILL, SIGTERM) or cut
off from its peers is not (`RankExit.external`), and requests with no token sent yet are
answered 503 so the router serves them elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, Protocol

from gpu_worker.cache.kv_events import KVEventRecord
from gpu_worker.engine.commands import WriteKV
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.engine.rank import RankExit, RankProcesses, launch_engine
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.parallel.config import ParallelConfig
from gpu_worker.scheduler.request import CachedTokens, KVExport, Req, ReqState, RequestError
from services.engine.updates import (
    COMPUTING,
    QUEUED,
    Admission,
    Holding,
    LoadInfo,
    ReceivedKV,
    TokenUpdate,
)

log = logging.getLogger(__name__)

RANK_WATCH_S = 0.1  # how often the child ranks are checked for an exit
DEAD_RANK_WAIT_S = 1.0  # after a failed collective: how long to look for the rank that died


_HOLDING = {
    ReqState.WAITING: QUEUED,
    ReqState.LOADING: COMPUTING,
    ReqState.PREFILL: COMPUTING,
    ReqState.DECODE: COMPUTING,
}


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


class EngineCrashedError(RuntimeError):
    """The engine's step loop died; no command runs any more. `held`: the command's request
    was in the engine when it died of a cause a request can have (it may be the culprit:
    never retried elsewhere); False when the command came, or waited in the queue, after
    the engine was already gone, or when a rank was killed from outside (the request cannot
    have caused it: another engine may serve it)."""

    def __init__(self, reason: str, held: bool = True) -> None:
        super().__init__(reason)
        self.held = held


@dataclass(slots=True)
class _Tracked:
    request_id: str
    req: Req
    sent: int = 0
    admitted: Future[Admission] | None = None  # P/D decode: resolves on admission
    holding: Holding = QUEUED  # as last published in EngineRunner.holding


def _nothing() -> None:
    pass


_WAKE: Future[Any] = Future()  # the (never resolved) future of `_wake`'s no-op command


def _run_command(command: Callable[[], None], done: Future[Any]) -> None:
    """Run one command between steps; an error it did not expect goes to its caller (one
    request's submit or write), not to the step loop."""
    try:
        command()
    except Exception as e:
        log.exception("engine command failed")
        _fail(done, e)


def _received(req: Req) -> ReceivedKV | None:
    r = req.remote
    if r is None or r.prefix_len < 0:
        return None
    return ReceivedKV(r.prefix_len, r.received_end - r.prefix_len, r.received_bytes)


class EngineRunner:
    """Owns an Engine on a dedicated thread."""

    def __init__(
        self,
        config: EngineConfig,
        loop: asyncio.AbstractEventLoop,
        outbox: Outbox,
        idle_wait_s: float = 0.02,
        debug_crash_on_token: int | None = None,
    ) -> None:
        self._config = config
        self._loop = loop
        self._outbox = outbox
        self._idle_wait_s = idle_wait_s
        self._debug_crash_on_token = debug_crash_on_token
        self._commands: queue.Queue[tuple[Callable[[], None], Future[Any]]] = queue.Queue()
        self._dead: str | None = None  # why the step loop died; guarded by _lock
        self._suspect = True  # whether the requests it held may have caused it (set with _dead)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._tracked: dict[int, _Tracked] = {}
        self._by_request: dict[str, int] = {}
        self.load = LoadInfo(0, 0, 0)
        # what the engine does with each request it holds, by request id: written by submit
        # (service thread) and after every step (runner thread), read by the service
        self._holding: dict[str, Holding] = {}
        self._holding_lock = threading.Lock()
        self.generated_tokens = 0  # output tokens reported so far (read by heartbeats)
        self.engine: Engine | None = None
        self.ranks: RankProcesses | None = None  # ranks 1..N-1 of a multi-rank engine
        # KV writes answered once the step that applies them ran: (command, bytes, future)
        self._awaiting: list[tuple[WriteKV, int, Future[int]]] = []
        self._ready: Future[None] = Future()
        self._thread = threading.Thread(target=self._main, name="engine-runner", daemon=True)

    # ----------------------------------------------------------------- service side

    def start(self) -> Future[None]:
        """Build the engine on the runner thread; the future resolves when it is ready."""
        self._thread.start()
        return self._ready

    def submit(
        self,
        request_id: str,
        input_ids: Sequence[int],
        sampling: SamplingParams,
        cache_salt: str,
        *,
        decode_reuse: bool | None = None,
        export_from: int | None = None,
    ) -> Future[Admission | None]:
        """Queue a request; the future fails with InvalidRequestError for bad input.

        A P/D decode request (`decode_reuse` set) resolves its future only once admitted,
        with its `Admission`; a P/D prefill request (`export_from` set) reports through
        `Outbox.exported` instead of token updates.
        """
        done: Future[Admission | None] = Future()

        def command() -> None:
            engine = self.engine
            assert engine is not None
            try:
                if export_from is not None:
                    req = engine.submit_prefill(input_ids, sampling, cache_salt, export_from)
                elif decode_reuse is not None:
                    req = engine.submit_decode(input_ids, sampling, cache_salt, decode_reuse)
                else:
                    req = engine.submit(input_ids, sampling, cache_salt=cache_salt)
            except ValueError as e:
                self._set_holding(request_id, None)
                _fail(done, e)
                return
            tracked = _Tracked(request_id, req)
            self._tracked[req.rid] = tracked
            self._by_request[request_id] = req.rid
            if decode_reuse is not None:
                tracked.admitted = done  # type: ignore[assignment]
            else:
                _resolve(done, None)

        self._set_holding(request_id, QUEUED)
        if not self._put(command, done):
            self._set_holding(request_id, None)
        return done

    def write_kv(
        self,
        request_id: str,
        token_start: int,
        token_end: int,
        payload: memoryview,
        first_token: int | None,
        rank: int = 0,
        sender: ParallelConfig | None = None,
    ) -> Future[int]:
        """P/D decode: write world rank `rank`'s shard of a received KV chunk from a prefill
        engine of layout `sender` (at the step after every rank's shard of it came); the
        future gives this shard's bytes, or fails with ValueError if the chunk does not fit
        the request."""
        done: Future[int] = Future()

        def command() -> None:
            assert self.engine is not None
            rid = self._by_request.get(request_id)
            try:
                if rid is None:
                    raise ValueError(f"unknown request {request_id}")
                cmd = self.engine.write_kv(
                    rid, token_start, token_end, payload, first_token, rank, sender
                )
            except ValueError as e:
                _fail(done, e)
                return
            self._awaiting.append((cmd, len(payload), done))
            # the next step writes it (and, the last one, runs its first decode): computing
            tracked = self._tracked[rid]
            if tracked.holding.state == "receiving":
                tracked.holding = COMPUTING
                self._set_holding(request_id, COMPUTING)

        self._put(command, done)
        return done

    def abort(self, request_id: str) -> None:
        def command() -> None:
            rid = self._by_request.get(request_id)
            if rid is not None and self.engine is not None:
                self.engine.abort(rid)

        self._put(command, Future())

    def flush(self) -> Future[bool]:
        """Flush every rank's cache (a command); False while requests are running."""
        return self.query(lambda e: e.flush_cache())

    def query(self, fn: Callable[[Engine], Any]) -> Future[Any]:
        """Run `fn(engine)` on the runner thread between steps: read-only functions (stats,
        snapshots), or the engine API, which turns any change into commands for every rank."""
        done: Future[Any] = Future()

        def command() -> None:
            assert self.engine is not None
            try:
                result = fn(self.engine)
            except Exception as e:  # the caller gets the error through the future
                _fail(done, e)
            else:
                _resolve(done, result)

        self._put(command, done)
        return done

    def _put(self, command: Callable[[], None], done: Future[Any]) -> bool:
        """Queue `command`, whose result goes to `done`; fails `done` at once (False) when
        dead."""
        with self._lock:
            if self._dead is None:
                self._commands.put((command, done))
                return True
            reason = self._dead
        _fail(done, EngineCrashedError(reason, held=False))
        return False

    def holding(self) -> dict[str, Holding]:
        """Every request the engine holds, by request id, as of its last step (a request
        submitted since is `queued`). Any thread."""
        with self._holding_lock:
            return dict(self._holding)

    def _set_holding(self, request_id: str, holding: Holding | None) -> None:
        with self._holding_lock:
            if holding is None:
                self._holding.pop(request_id, None)
            else:
                self._holding[request_id] = holding

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    @property
    def num_active(self) -> int:
        return len(self._tracked)

    # ----------------------------------------------------------------- runner thread

    def _main(self) -> None:
        try:
            self.engine, self.ranks = launch_engine(self._config)
        except Exception as e:
            self._ready.set_exception(e)
            return
        engine = self.engine
        if self._ready.cancelled():  # the service stopped while the engine was being built
            self._close(engine)
            return
        if self.ranks is not None:
            threading.Thread(
                target=self._watch_ranks, args=(self.ranks,), name="rank-watch", daemon=True
            ).start()
        engine.cache.acks.set_listener(self._wake)
        self._ready.set_result(None)
        crashed = False
        try:
            self._loop_steps(engine)
        except Exception as e:
            crashed = True
            log.exception("engine step loop crashed")
            self._die(*self._crash_reason(e))
        finally:
            if self._dead is not None:
                self._fail_local(self._dead, self._suspect)
            if (crashed or self._dead is not None) and self.ranks is not None:
                self.ranks.kill()  # a world that lost a rank or rank 0's loop cannot step on
            self._close(engine)

    def _crash_reason(self, error: Exception) -> tuple[str, bool]:
        """Why the step loop died, for every request it held, and whether they may have
        caused it: a rank that exited (rank 0's collective with it failed) is named rather
        than the collective's error."""
        if self.ranks is not None:
            cause = self.ranks.exit_cause(DEAD_RANK_WAIT_S)
            if cause is not None:
                return _rank_crash(cause)
        return f"engine step loop crashed: {type(error).__name__}: {error}", True

    def _close(self, engine: Engine) -> None:
        try:
            engine.close(stop_ranks=self._dead is None)  # a broken world cannot step again
        finally:
            if self.ranks is not None:
                self.ranks.wait()

    def _watch_ranks(self, ranks: RankProcesses) -> None:
        """A rank that exits ends the engine at once (rank 0 may be blocked in a collective
        with it): the service stops heartbeating, fails every request and exits."""
        while not self._stop.is_set():
            if ranks.dead():
                cause = ranks.exit_cause(DEAD_RANK_WAIT_S)
                if self._stop.is_set() or cause is None:
                    return
                reason, suspect = _rank_crash(cause)
                log.error("%s: the engine is down", reason)
                self._die(reason, suspect)
                return
            self._stop.wait(RANK_WATCH_S)

    def _loop_steps(self, engine: Engine) -> None:
        worked = True
        while not self._stop.is_set() and self._dead is None:
            # Block briefly when there is nothing to compute (idle, or only waiting for
            # loads / P/D KV): commands wake it at once, copies finish within the wait.
            self._run_commands(block=engine.scheduler.idle or not worked)
            idle = engine.scheduler.idle and not engine.has_pending and not engine.has_queued_acks
            if idle and not engine.keepalive_due:
                self._publish_events()
                continue
            self._debug_crash()
            engine.step()
            worked = engine.scheduler.last_step_worked
            self._answer_awaiting()
            self._publish_tokens()
            self._publish_events()

    def _answer_awaiting(self) -> None:
        """Commands applied in the step just run: give their callers the results (a chunk
        whose other ranks' shards have not come yet waits)."""
        waiting = []
        for cmd, size, done in self._awaiting:
            if not cmd.applied:
                waiting.append((cmd, size, done))
            elif cmd.error is not None:
                _fail(done, ValueError(cmd.error))
            else:
                _resolve(done, size)
        self._awaiting = waiting

    def _debug_crash(self) -> None:
        """Test hook (`--debug-crash-on-prompt-token`): a step with a request whose prompt
        holds the token raises, as a bug in the batched forward would."""
        token = self._debug_crash_on_token
        if token is not None and any(token in t.req.prompt_ids for t in self._tracked.values()):
            raise RuntimeError(f"debug crash: a prompt holds token {token}")

    def _wake(self) -> None:
        """A transfer or storage ACK's work finished (on a worker thread): wake a step loop
        that blocks on the command queue, so the ACK is consumed at once, not after
        `idle_wait_s`."""
        self._commands.put((_nothing, _WAKE))

    def _run_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=self._idle_wait_s if block else 0)
        except queue.Empty:
            return
        _run_command(*item)
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
            _run_command(*item)

    def _publish_tokens(self) -> None:
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
                )
            )
            if finished:
                self._untrack(rid, t)
        sched = self.engine.scheduler if self.engine else None
        if sched is not None:
            inflight = sum(r.prompt_len + r.sampling.max_new_tokens for r in sched.running)
            self.load = LoadInfo(len(sched.running), len(sched.waiting), inflight)
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
        self._set_holding(t.request_id, holding)

    def _untrack(self, rid: int, t: _Tracked) -> None:
        del self._tracked[rid]
        self._by_request.pop(t.request_id, None)
        self._set_holding(t.request_id, None)

    def _report_admission(self, t: _Tracked) -> None:
        fut, req = t.admitted, t.req
        if fut is None or fut.done() or req.remote is None:
            return
        if req.remote.prefix_len >= 0:
            _resolve(fut, Admission(req.remote.prefix_len, req.cached.device, req.cached.host))
        elif req.finish_reason is not None:
            _fail(fut, RuntimeError(f"request ended before admission: {req.finish_reason}"))

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

    def _publish_events(self) -> None:
        assert self.engine is not None
        events = self.engine.cache.drain_events()
        if events:
            self._loop.call_soon_threadsafe(self._outbox.kv_events, events)

    def _die(self, reason: str, suspect: bool) -> None:
        """Refuse all further commands, fail the queued ones, then tell the service (after
        any token updates already scheduled). Called once, from the runner thread or the
        rank watcher; the runner thread also fails what only it touches (`_fail_local`)."""
        with self._lock:
            if self._dead is not None:
                return
            self._dead, self._suspect = reason, suspect
        while True:
            try:
                _, done = self._commands.get_nowait()
            except queue.Empty:
                break
            _fail(done, EngineCrashedError(reason, held=False))  # never reached the engine
        if threading.current_thread() is self._thread:
            self._fail_local(reason, suspect)
        self._loop.call_soon_threadsafe(self._outbox.crashed, reason, suspect)

    def _fail_local(self, reason: str, suspect: bool) -> None:
        """Runner thread: fail every admission and command result still awaited."""
        for t in self._tracked.values():
            if t.admitted is not None:
                _fail(t.admitted, EngineCrashedError(reason, held=suspect))
        for _, _, done in self._awaiting:
            _fail(done, EngineCrashedError(reason, held=suspect))
        self._tracked.clear()
        self._by_request.clear()
        self._awaiting.clear()
        with self._holding_lock:
            self._holding.clear()


def _rank_crash(cause: RankExit) -> tuple[str, bool]:
    """The crash reason a dead rank gives, and whether its engine's requests are suspects."""
    return cause.describe(), not cause.external


def _resolve(done: Future[Any], result: Any) -> None:
    """Give `done` its result unless its caller gave up on it (cancelled: a caller's
    asyncio wrapper cancels it on shutdown), which must not fail the command."""
    if not done.done():
        with contextlib.suppress(InvalidStateError):
            done.set_result(result)


def _fail(done: Future[Any], error: BaseException) -> None:
    if not done.done():
        with contextlib.suppress(InvalidStateError):
            done.set_exception(error)
