"""Answering a command's `concurrent.futures.Future` from the runner thread."""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, InvalidStateError
from typing import Any


def resolve(done: Future[Any], result: Any) -> None:
    """Give `done` its result unless its caller gave up on it (cancelled: a caller's
    asyncio wrapper cancels it on shutdown), which must not fail the command."""
    if not done.done():
        with contextlib.suppress(InvalidStateError):
            done.set_result(result)


def fail(done: Future[Any], error: BaseException) -> None:
    if not done.done():
        with contextlib.suppress(InvalidStateError):
            done.set_exception(error)
