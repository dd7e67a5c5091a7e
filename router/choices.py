"""The `n` choices of one request, generated side by side and merged into one stream.

Choice 0 runs first. Once it has its first token, its prompt has been prefilled and
inserted into its engine's radix tree, so the other choices start then and prefer that
engine: each of them reuses the prompt's KV from the cache instead of computing it again
(on the P/D path they go wherever routing sends them, which the index steers to the cached
prompt). Their deltas come out tagged with their choice index, in arrival order.

A choice that fails fails the request (the others are aborted); so does closing the
iterator early (`contextlib.aclosing`): every choice's engine gets an abort.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable

from router.generation import Generation
from router.outcome import Delta

MakeChoice = Callable[[int, str | None], Generation]  # (choice, preferred engine) -> choice


class Choices:
    def __init__(self, make: MakeChoice, n: int) -> None:
        self.n = n
        self._make = make
        self.gens = [make(0, None)]  # choices started so far, by index

    @property
    def first(self) -> Generation:
        return self.gens[0]

    async def run(self) -> AsyncGenerator[tuple[int, Delta], None]:
        """(choice, delta) until every choice finished; raises the first choice's ApiError."""
        if self.n == 1:
            async with contextlib.aclosing(self.first.run()) as deltas:
                async for delta in deltas:
                    yield 0, delta
            return
        queue: asyncio.Queue[tuple[int, Delta | Exception | None]] = asyncio.Queue()
        tasks: list[asyncio.Task[None]] = []

        async def pump(i: int, gen: Generation) -> None:
            try:
                async with contextlib.aclosing(gen.run()) as deltas:
                    async for delta in deltas:
                        queue.put_nowait((i, delta))
            except Exception as e:  # ApiError: the consumer raises it
                queue.put_nowait((i, e))
            else:
                queue.put_nowait((i, None))

        def start(gen: Generation) -> None:
            i = len(tasks)
            tasks.append(asyncio.create_task(pump(i, gen), name=f"choice-{i}"))

        start(self.first)
        running = 1
        try:
            while running:
                i, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if i == 0 and len(self.gens) == 1 and (item is None or item.token_ids):
                    running += self._start_rest(start)
                if item is None:
                    running -= 1
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _start_rest(self, start: Callable[[Generation], None]) -> int:
        engine = self.first.outcome.engine_id or None
        for k in range(1, self.n):
            gen = self._make(k, engine)
            self.gens.append(gen)
            start(gen)
        return self.n - 1
