"""When rank 0's step loop steps and when it sleeps: one policy for every loop that drives an
engine.

Two loops drive an engine on its rank 0: `Engine.run` on the caller's own thread (the CLI,
tests, benchmarks), and the service's runner thread (`services/engine/runner.py`), which
also takes commands from the service between steps. Both drive it through a `StepLoop`: the
engine only answers (a step's `StepResult`, and its `Outlook` between steps), and one
`IdlePolicy` decides. A loop that computed nothing must not spin, which would starve the
transfer and storage worker threads of the interpreter: it sleeps on the engine's `Wake`,
which every ACK's worker rings the moment its work finishes (and the runner rings for every
command it queues), so a sleeping loop wakes at once, not after its longest sleep.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

from gpu_worker.scheduler.request import Req

KEEPALIVE_S = 5.0  # an idle multi-rank engine still steps this often (its ranks wait in it)
ACK_WAIT_S = 0.05  # `Engine.run`: the longest sleep for an ACK before stepping again anyway


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one step on every rank did."""

    finished: list[Req]  # the requests that finished in it
    worked: bool  # it ran a forward


@dataclass(frozen=True, slots=True)
class Outlook:
    """What an engine holds and waits on between steps, as rank 0 sees it."""

    holds_requests: bool  # its scheduler holds requests (waiting, loading, receiving, running)
    commands_pending: bool  # commands not yet handed to the ranks
    acks_queued: bool  # transfers or storage work to consume (backups, writes to start, ...)
    acks_ready: bool  # some of that work finished: the next step consumes it
    keepalive_due: bool  # a multi-rank engine idled `KEEPALIVE_S` (its ranks wait in a step)

    @property
    def idle(self) -> bool:
        """Nothing to compute, to hand out or to consume."""
        return not (self.holds_requests or self.commands_pending or self.acks_queued)


class Wake:
    """The wake-up of an engine's step loop: rung from any thread (an ACK's worker when its
    work finishes, the runner when it queues a command); the loop sleeps on it. A ring is
    kept until `reset`, so one that comes before the loop sleeps is not lost."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def ring(self) -> None:
        self._event.set()

    def sleep(self, timeout_s: float) -> None:
        """Until rung (at once when rung since the last `reset`), at most `timeout_s`."""
        self._event.wait(timeout_s)

    def reset(self) -> None:
        """Forget the rings so far: the caller looks at the state they announced next."""
        self._event.clear()


@dataclass(frozen=True, slots=True)
class IdlePolicy:
    """The one rule for when a step loop sleeps instead of stepping.

    A step that computed something steps again at once while requests remain. Otherwise the
    loop sleeps until a ring, but only where something can ring it: a loop fed by other
    threads' commands (`input_rings`: the runner) always can; a loop on the caller's own
    thread (`Engine.run`) only while an ACK's work is under way and not yet finished, since
    its caller feeds it between calls. A loop fed by commands also skips a step that has
    nothing to compute, hand out or consume (a multi-rank engine still steps every
    `KEEPALIVE_S`: its ranks wait in the step's collective); a loop on the caller's thread
    always steps, as asked."""

    max_sleep_s: float  # the longest sleep before looking again anyway
    input_rings: bool

    def should_sleep(self, worked: bool, outlook: Outlook) -> bool:
        """After a step that ran a forward (`worked`) or not."""
        if worked and (outlook.holds_requests or not self.input_rings):
            return False
        if self.input_rings:
            return True
        return outlook.acks_queued and not outlook.acks_ready

    def should_step(self, outlook: Outlook) -> bool:
        return not self.input_rings or not outlook.idle or outlook.keepalive_due


RUN_POLICY = IdlePolicy(ACK_WAIT_S, input_rings=False)


class Steppable(Protocol):
    """What a step loop drives (the Engine, on rank 0)."""

    wake: Wake

    def step(self) -> StepResult: ...

    def outlook(self) -> Outlook: ...


class StepLoop:
    """Drives one engine on the thread that owns it: steps, and sleeps per its policy."""

    def __init__(self, engine: Steppable, policy: IdlePolicy = RUN_POLICY) -> None:
        self._engine = engine
        self._policy = policy
        self._worked = True  # whether the last step ran a forward

    def step_or_wait(self) -> StepResult:
        """Step, then sleep when the policy says so: for a loop whose caller feeds the
        engine between calls (it should call this, not `Engine.step`)."""
        self._engine.wake.reset()
        result = self.step()
        self.sleep()
        return result

    def sleep(self) -> None:
        """Sleep when the policy says so after the last step, then `reset` the wake-up: what
        rings from here on is still to be looked at."""
        wake = self._engine.wake
        if self._policy.should_sleep(self._worked, self._engine.outlook()):
            wake.sleep(self._policy.max_sleep_s)
        wake.reset()

    def step(self) -> StepResult:
        result = self._engine.step()
        self._worked = result.worked
        return result

    def due(self) -> bool:
        """Whether the policy steps now (a loop fed by commands asks after running them)."""
        return self._policy.should_step(self._engine.outlook())
