"""Issue 20, finding 2: the router's model cards are bounded (`router.models.ModelCards`).

Any engine on the bus names any card digest, so the router holds at most `max_cards` cards
(the least recently named goes first) and starts at most `FETCHES_PER_S` fetches a second,
`MAX_FETCHES` at once. A fake bus answers every card request at once (or holds them all).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from bus_schemas import ModelCard
from router.metrics import RouterMetrics
from router.models import FETCHES_PER_S, MAX_FETCHES, ModelCards


def card(i: int) -> ModelCard:
    return ModelCard(f"m{i}", f"m{i}", "bytes", "", None, [257], None, 512, 260)


class Bus:
    """Answers `engine_model_card(e<i>)` with card(i); counts the requests, holds them
    while `hold` is not set."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.hold = asyncio.Event()
        self.hold.set()

    async def request(self, subject: str, data: bytes, timeout: float) -> Any:
        self.asked.append(subject)
        await self.hold.wait()
        i = int(subject.split(".")[-2].removeprefix("e"))
        return SimpleNamespace(data=card(i).encode())


async def test_cards_are_bounded_and_the_least_recent_goes_first() -> None:
    now = [0.0]
    bus = Bus()
    cards = ModelCards(bus, RouterMetrics(), lambda: now[0], max_cards=3)  # type: ignore[arg-type]
    for i in range(5):
        now[0] += 1.0  # room by rate for each
        cards.observe(f"e{i}", card(i).digest)
        while cards.get(card(i).digest) is None:
            await asyncio.sleep(0.01)
    held = [i for i in range(5) if cards.get(card(i).digest) is not None]
    assert held == [2, 3, 4]
    await cards.close()


async def test_card_fetches_are_bounded_at_once() -> None:
    bus = Bus()
    bus.hold.clear()  # no answer: every fetch stays in flight
    cards = ModelCards(bus, RouterMetrics(), lambda: 0.0)  # type: ignore[arg-type]
    for i in range(100):  # a flood of new digests
        cards.observe(f"e{i}", card(i).digest)
        await asyncio.sleep(0)
    await asyncio.sleep(0.05)
    assert len(bus.asked) == MAX_FETCHES
    await cards.close()


async def test_card_fetches_are_bounded_by_rate() -> None:
    bus = Bus()  # answers at once
    cards = ModelCards(bus, RouterMetrics(), lambda: 0.0)  # type: ignore[arg-type]
    for i in range(100):  # a flood of new digests in one instant of the clock
        cards.observe(f"e{i}", card(i).digest)
        await asyncio.sleep(0.02)  # each fetch done before the next heartbeat
    assert len(bus.asked) == FETCHES_PER_S
    await cards.close()
