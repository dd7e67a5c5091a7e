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

The engine decides nothing about idling here: the step loop steps and sleeps through a
`StepLoop` (`gpu_worker/engine/driver.py`), the one idle policy it shares with
`Engine.run`. Each queued command rings the engine's wake-up, as each transfer or storage
ACK's worker does, so a sleeping loop wakes at once for either. The pieces: `CommandInbox`
(`inbox.py`) queues the service's commands, `RequestTracker` (`tracking.py`) reports the
requests the engine holds.

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
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from gpu_worker.engine.commands import WriteKV
from gpu_worker.engine.driver import IdlePolicy, StepLoop
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.engine.nodes import ONE_NODE, NodeLayout
from gpu_worker.engine.rank import RankExit, RankProcesses, launch_engine
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.parallel.config import ParallelConfig
from services.engine.futures import fail, resolve
from services.engine.inbox import CommandInbox, EngineCrashedError
from services.engine.tracking import Outbox, RequestTracker
from services.engine.updates import QUEUED, Admission, Holding, LoadInfo

__all__ = ["EngineCrashedError", "EngineRunner", "Outbox"]

log = logging.getLogger(__name__)

RANK_WATCH_S = 0.1  # how often the child ranks are checked for an exit
DEAD_RANK_WAIT_S = 1.0  # after a failed collective: how long to look for the rank that died


class AwaitedWrites:
    """P/D decode KV writes, answered once the step that applies them ran. Runner thread."""

    def __init__(self) -> None:
        self._awaiting: list[tuple[WriteKV, int, Future[int]]] = []  # (command, bytes, future)

    def add(self, cmd: WriteKV, size: int, done: Future[int]) -> None:
        self._awaiting.append((cmd, size, done))

    def answer(self) -> None:
        """Commands applied in the step just run: give their callers the results (a chunk
        whose other ranks' shards have not come yet waits)."""
        waiting = []
        for cmd, size, done in self._awaiting:
            if not cmd.applied:
                waiting.append((cmd, size, done))
            elif cmd.error is not None:
                fail(done, ValueError(cmd.error))
            else:
                resolve(done, size)
        self._awaiting = waiting

    def fail_all(self, error: Callable[[], BaseException]) -> None:
        for _, _, done in self._awaiting:
            fail(done, error())
        self._awaiting.clear()


class EngineRunner:
    """Owns an Engine on a dedicated thread."""

    def __init__(
        self,
        config: EngineConfig,
        loop: asyncio.AbstractEventLoop,
        outbox: Outbox,
        idle_wait_s: float = 0.02,
        debug_crash_on_token: int | None = None,
        nodes: NodeLayout = ONE_NODE,
    ) -> None:
        """`idle_wait_s`: the step loop's longest sleep; `debug_crash_on_token`: a test hook
        (`--debug-crash-on-prompt-token`): a step with a request whose prompt holds the
        token raises, as a bug in the batched forward would; `nodes`: the hosts the world
        spans (this runner is node 0's rank 0)."""
        self._config = config
        self._loop = loop
        self._outbox = outbox
        self._policy = IdlePolicy(idle_wait_s, input_rings=True)
        self._debug_crash_on_token = debug_crash_on_token
        self._nodes = nodes

        def ring() -> None:  # a queued command wakes the step loop (once the engine exists)
            if self.engine is not None:
                self.engine.wake.ring()

        self._inbox = CommandInbox(ring)
        self._stop = threading.Event()
        self._requests = RequestTracker(loop, outbox)
        self._writes = AwaitedWrites()
        self.engine: Engine | None = None
        self.ranks: RankProcesses | None = None  # ranks 1..N-1 of a multi-rank engine
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
                self._requests.set_holding(request_id, None)
                fail(done, e)
                return
            admitted = done if decode_reuse is not None else None
            self._requests.track(request_id, req, admitted)  # type: ignore[arg-type]
            if admitted is None:
                resolve(done, None)

        self._requests.set_holding(request_id, QUEUED)
        if not self._inbox.put(command, done):
            self._requests.set_holding(request_id, None)
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
        rotation: int = 0,
        draft: int = 0,
    ) -> Future[int]:
        """P/D decode: write world rank `rank`'s shard of a received KV chunk from a prefill
        engine of layout `sender` (at the step after every rank's shard of it came; from a
        CP-sharded sender, the chunk's page 0 is CP rank `rotation`'s; `draft`: its
        speculative draft's digest, `Engine.write_kv`); the future gives
        this shard's bytes, or fails with ValueError if the chunk does not fit the
        request."""
        done: Future[int] = Future()

        def command() -> None:
            assert self.engine is not None
            rid = self._requests.rid_of(request_id)
            try:
                if rid is None:
                    raise ValueError(f"unknown request {request_id}")
                cmd = self.engine.write_kv(
                    rid,
                    token_start,
                    token_end,
                    payload,
                    first_token,
                    rank,
                    sender,
                    rotation,
                    draft,
                )
            except ValueError as e:
                fail(done, e)
                return
            self._writes.add(cmd, len(payload), done)
            self._requests.receiving_to_computing(rid)

        self._inbox.put(command, done)
        return done

    def abort(self, request_id: str) -> None:
        def command() -> None:
            rid = self._requests.rid_of(request_id)
            if rid is not None and self.engine is not None:
                self.engine.abort(rid)

        self._inbox.put(command, Future())

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
                fail(done, e)
            else:
                resolve(done, result)

        self._inbox.put(command, done)
        return done

    def holding(self) -> dict[str, Holding]:
        """Every request the engine holds, by request id, as of its last step (a request
        submitted since is `queued`). Any thread."""
        return self._requests.holding()

    @property
    def load(self) -> LoadInfo:
        """The engine's batch as of its last step (read by heartbeats)."""
        return self._requests.load

    @property
    def generated_tokens(self) -> int:
        """Output tokens reported so far (read by heartbeats)."""
        return self._requests.generated_tokens

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    # ----------------------------------------------------------------- runner thread

    def _main(self) -> None:
        try:
            self.engine, self.ranks = launch_engine(self._config, layout=self._nodes)
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
        self._ready.set_result(None)
        crashed = False
        try:
            self._loop_steps(engine)
        except Exception as e:
            crashed = True
            log.exception("engine step loop crashed")
            self._die(*self._crash_reason(e))
        finally:
            if self._inbox.dead is not None:
                self._fail_local(self._inbox.dead, self._inbox.suspect)
            if (crashed or self._inbox.dead is not None) and self.ranks is not None:
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
            engine.close(stop_ranks=self._inbox.dead is None)  # a broken world cannot step
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
        steps = StepLoop(engine, self._policy)
        engine.wake.ring()  # for commands queued before the engine was built
        while not self._stop.is_set() and self._inbox.dead is None:
            # Sleep when there is nothing to compute (idle, or only waiting for loads or
            # P/D KV): a command or a finished ACK rings the engine's wake-up at once.
            steps.sleep()
            self._inbox.run_all()
            if not steps.due():
                self._publish_events(engine)
                continue
            self._debug_crash()
            steps.step()
            self._writes.answer()
            self._requests.publish(engine.scheduler)
            self._publish_events(engine)

    def _debug_crash(self) -> None:
        """Test hook (`debug_crash_on_token`): raise before a step with a request whose
        prompt holds the token."""
        token = self._debug_crash_on_token
        if token is not None and self._requests.holds_prompt_token(token):
            raise RuntimeError(f"debug crash: a prompt holds token {token}")

    def _publish_events(self, engine: Engine) -> None:
        events = engine.cache.drain_events()
        if events:
            self._loop.call_soon_threadsafe(self._outbox.kv_events, events)

    def _die(self, reason: str, suspect: bool) -> None:
        """Refuse all further commands, fail the queued ones, then tell the service (after
        any token updates already scheduled). Called once, from the runner thread or the
        rank watcher; the runner thread also fails what only it touches (`_fail_local`)."""
        if not self._inbox.close(reason, suspect):
            return
        if threading.current_thread() is self._thread:
            self._fail_local(reason, suspect)
        self._loop.call_soon_threadsafe(self._outbox.crashed, reason, suspect)

    def _fail_local(self, reason: str, suspect: bool) -> None:
        """Runner thread: fail every admission and command result still awaited."""
        self._requests.fail_all(lambda: EngineCrashedError(reason, held=suspect))
        self._writes.fail_all(lambda: EngineCrashedError(reason, held=suspect))


def _rank_crash(cause: RankExit) -> tuple[str, bool]:
    """The crash reason a dead rank gives, and whether its engine's requests are suspects."""
    return cause.describe(), not cause.external
