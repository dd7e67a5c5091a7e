"""The one step driver (issue 21 item 4): `IdlePolicy` decides for both loops that drive an
engine on rank 0, and a ring wakes a sleeping loop at once.

The rules written down here are those the two loops had before they shared a policy:
`Engine.run` slept only after a step that computed nothing while ACK work was under way and
none of it had finished; the service's runner slept (on its command queue) after any step
that computed nothing or left the engine without requests, and skipped a step with nothing
to compute, hand out or consume unless a multi-rank keepalive was due.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.engine.driver import (
    ACK_WAIT_S,
    RUN_POLICY,
    IdlePolicy,
    Outlook,
    StepLoop,
    StepResult,
    Wake,
)
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams

RUNNER = IdlePolicy(0.02, input_rings=True)


def outlooks() -> list[Outlook]:
    return [Outlook(*flags) for flags in itertools.product((False, True), repeat=5)]


@pytest.mark.parametrize("worked", [False, True])
def test_engine_run_sleeps_only_while_an_ack_is_under_way_and_unfinished(worked: bool) -> None:
    for o in outlooks():
        want = not worked and o.acks_queued and not o.acks_ready
        assert RUN_POLICY.should_sleep(worked, o) is want, o
        assert RUN_POLICY.should_step(o)  # asked to step, it steps


@pytest.mark.parametrize("worked", [False, True])
def test_the_runner_sleeps_after_a_step_that_did_nothing_or_left_no_request(
    worked: bool,
) -> None:
    for o in outlooks():
        want = not worked or not o.holds_requests
        assert RUNNER.should_sleep(worked, o) is want, o
        idle = not (o.holds_requests or o.commands_pending or o.acks_queued)
        assert RUNNER.should_step(o) is (not idle or o.keepalive_due), o


class FakeEngine:
    """Steps that compute nothing while one ACK's work is under way on a worker thread."""

    def __init__(self) -> None:
        self.wake = Wake()
        self.ready = False
        self.steps = 0

    def step(self) -> StepResult:
        self.steps += 1
        return StepResult([], worked=False)

    def outlook(self) -> Outlook:
        return Outlook(True, False, acks_queued=True, acks_ready=self.ready, keepalive_due=False)

    def finish_ack(self) -> None:  # the worker: the ACK's work is done, then it rings
        self.ready = True
        self.wake.ring()


def test_an_ack_finishing_on_a_worker_wakes_a_sleeping_loop_at_once() -> None:
    engine = FakeEngine()
    loop = StepLoop(engine, IdlePolicy(max_sleep_s=30.0, input_rings=False))
    worker = threading.Timer(0.2, engine.finish_ack)
    worker.start()
    start = time.monotonic()
    loop.step_or_wait()  # sleeps: the ACK is under way
    woke = time.monotonic() - start
    worker.join()
    assert 0.15 < woke < 5.0  # woken by the ring, not by the 30 s timeout
    start = time.monotonic()
    loop.step_or_wait()  # the ACK is ready: the next step consumes it, no sleep
    assert time.monotonic() - start < 0.1
    assert engine.steps == 2


def test_a_ring_before_the_loop_sleeps_is_not_lost() -> None:
    engine = FakeEngine()
    loop = StepLoop(engine, IdlePolicy(max_sleep_s=30.0, input_rings=True))
    loop.step()
    engine.wake.ring()  # a command queued between the step and the sleep
    start = time.monotonic()
    loop.sleep()
    assert time.monotonic() - start < 1.0
    start = time.monotonic()
    engine.wake.ring()
    engine.wake.reset()  # looked at: a loop that then sleeps waits for the next ring
    threading.Timer(0.2, engine.wake.ring).start()
    loop.sleep()
    assert 0.15 < time.monotonic() - start < 5.0


def test_engine_run_wakes_on_backups_instead_of_polling() -> None:
    """A real engine: the transfer workers ring the engine's wake-up, so a step loop that
    waits for backups of a finished request returns long before ACK_WAIT_S per step."""
    cache = CacheConfig(page_size=4, num_device_pages=64, enable_hierarchical_cache=True)
    engine = Engine(EngineConfig(cache=cache))
    try:
        engine.generate(list(range(1, 30)), SamplingParams(max_new_tokens=2))
        loop = StepLoop(engine)
        start = time.monotonic()
        for _ in range(20):
            if not engine.outlook().acks_queued:
                break
            loop.step_or_wait()
        assert not engine.outlook().acks_queued
        assert time.monotonic() - start < 20 * ACK_WAIT_S
        assert engine.step() == StepResult([], worked=False)
        engine.check_integrity()
    finally:
        engine.close()
