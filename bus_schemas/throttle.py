"""One log line per cause per interval, for warnings that bus input can trigger at will.

A process that logs every malformed heartbeat, refused engine or failed card fetch lets
whoever reaches the bus fill its log (3,000 fake heartbeats were 3,000 lines). Router and
services share this (both import only `bus_schemas`): the first occurrence of a cause is
logged at once, later ones within `interval_s` are counted, and the next line of that cause
says how many were suppressed. Causes are few and fixed by the caller (never an engine id),
so the table stays small.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class LogThrottle:
    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[str, float] = {}  # cause -> clock of its last line
        self._suppressed: dict[str, int] = {}  # cause -> lines not written since

    def log(self, level: int, cause: str, msg: str, *args: object) -> bool:
        """Log `msg % args` under `cause` unless one was logged less than `interval_s` ago;
        True when it was logged."""
        now = self.clock()
        last = self._last.get(cause)
        if last is not None and now - last < self.interval_s:
            self._suppressed[cause] = self._suppressed.get(cause, 0) + 1
            return False
        self._last[cause] = now
        suppressed = self._suppressed.pop(cause, 0)
        if suppressed:
            msg += " (and %d more like it in the last %gs)"
            args = (*args, suppressed, self.interval_s)
        self.logger.log(level, msg, *args)
        return True

    def warning(self, cause: str, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, cause, msg, *args)
