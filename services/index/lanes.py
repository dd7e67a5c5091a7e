"""One ordered job queue per engine (`EngineLanes`): the index's one writer per engine."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from services.tasks import OwnedTasks

log = logging.getLogger("hicache.index")

Job = Callable[[], Awaitable[None]]


@dataclass(slots=True)
class _Lane:
    jobs: asyncio.Queue[Job] = field(default_factory=asyncio.Queue)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # the engine's one writer


class EngineLanes:
    """One ordered job queue per engine, each drained by its own task: jobs of one engine
    run one at a time in submission order, jobs of different engines run concurrently.
    A lane's task ends when its queue is empty (an engine that went quiet costs nothing);
    its lock stays, for maintenance (`lock(engine_id)`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lanes: dict[str, _Lane] = {}
        self._draining: set[str] = set()
        self._tasks = OwnedTasks()

    def submit(self, engine_id: str, job: Job) -> None:
        lane = self._lane(engine_id)
        lane.jobs.put_nowait(job)
        if engine_id not in self._draining:
            self._draining.add(engine_id)
            self._tasks.spawn(self._drain(engine_id, lane), f"{self.name}-{engine_id}")

    def lock(self, engine_id: str) -> asyncio.Lock:
        return self._lane(engine_id).lock

    def has(self, engine_id: str) -> bool:
        return engine_id in self._lanes

    def __len__(self) -> int:
        return len(self._lanes)

    def forget(self, engine_id: str) -> None:
        """Drop an idle engine's lane (after it expired)."""
        lane = self._lanes.get(engine_id)
        if lane is not None and engine_id not in self._draining and not lane.lock.locked():
            del self._lanes[engine_id]

    async def join(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) for every queued job, then end the lane tasks."""
        try:
            async with asyncio.timeout(timeout_s):
                for lane in list(self._lanes.values()):
                    await lane.jobs.join()
        except TimeoutError:
            log.warning("%s: queued work not finished within %.1f s", self.name, timeout_s)
        await self._tasks.cancel_all()

    def _lane(self, engine_id: str) -> _Lane:
        lane = self._lanes.get(engine_id)
        if lane is None:
            lane = self._lanes[engine_id] = _Lane()
        return lane

    async def _drain(self, engine_id: str, lane: _Lane) -> None:
        try:
            while not lane.jobs.empty():
                job = lane.jobs.get_nowait()
                try:
                    async with lane.lock:
                        await job()
                except Exception:  # one bad job must not stop the engine's lane
                    log.exception("%s: job for engine %s failed", self.name, engine_id)
                finally:
                    lane.jobs.task_done()
        finally:
            self._draining.discard(engine_id)
