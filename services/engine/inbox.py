"""The runner's commands from the service: queued from any thread, run on the runner thread
between the engine's steps."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from services.engine.futures import fail

log = logging.getLogger(__name__)

Command = Callable[[], None]


class EngineCrashedError(RuntimeError):
    """The engine's step loop died; no command runs any more. `held`: the command's request
    was in the engine when it died of a cause a request can have (it may be the culprit:
    never retried elsewhere); False when the command came, or waited in the queue, after
    the engine was already gone, or when a rank was killed from outside (the request cannot
    have caused it: another engine may serve it)."""

    def __init__(self, reason: str, held: bool = True) -> None:
        super().__init__(reason)
        self.held = held


class CommandInbox:
    """A thread-safe queue of commands, each with the future its caller waits on. Closed
    once the engine died (`close`): a command queued then fails at once."""

    def __init__(self, on_put: Callable[[], object]) -> None:
        """`on_put`: called after each command is queued (wakes the step loop)."""
        self._queue: queue.Queue[tuple[Command, Future[Any]]] = queue.Queue()
        self._on_put = on_put
        self._lock = threading.Lock()
        self.dead: str | None = None  # why the step loop died; guarded by _lock
        self.suspect = True  # whether the requests it held may have caused it (set with dead)

    def put(self, command: Command, done: Future[Any]) -> bool:
        """Queue `command`, whose result goes to `done`; fails `done` at once (False) when
        closed."""
        with self._lock:
            if self.dead is None:
                self._queue.put((command, done))
                reason = None
            else:
                reason = self.dead
        if reason is not None:
            fail(done, EngineCrashedError(reason, held=False))
            return False
        self._on_put()
        return True

    def run_all(self) -> None:
        """Runner thread: run every queued command, in order, without waiting for more."""
        while True:
            try:
                command, done = self._queue.get_nowait()
            except queue.Empty:
                return
            _run_command(command, done)

    def close(self, reason: str, suspect: bool) -> bool:
        """Refuse all further commands and fail the queued ones (they never reached the
        engine). False, changing nothing, when already closed."""
        with self._lock:
            if self.dead is not None:
                return False
            self.dead, self.suspect = reason, suspect
        while True:
            try:
                _, done = self._queue.get_nowait()
            except queue.Empty:
                return True
            fail(done, EngineCrashedError(reason, held=False))


def _run_command(command: Command, done: Future[Any]) -> None:
    """Run one command between steps; an error it did not expect goes to its caller (one
    request's submit or write), not to the step loop."""
    try:
        command()
    except Exception as e:
        log.exception("engine command failed")
        fail(done, e)
