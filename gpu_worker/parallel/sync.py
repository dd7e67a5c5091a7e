"""What every rank agrees on at the start of a step: rank 0's commands and the ready ACKs.

DESIGN.md 4 and the article's PP x HiCache section. Each step:

- PP0 (the first stage). Rank 0 sends its pickled command list to its stage peers (TP x
  CP ranks) point to point, non-blocking (a size header, then the bytes when there are any): distributing work
  never makes rank 0 wait. Every PP0 rank counts the consecutive finished ACKs at the front
  of each of its ACK queues (transfers; external storage's hit queries, read progress and
  writes), and the stage agrees on their all_reduce(MIN) over its TP x CP ranks
  (`ParallelGroups.stage_cpu`: CP ranks agree as TP ranks do), one packed int tensor: the
  ACKs finished on every rank of the stage. The number of queued ACKs is the same on every
  rank (they submit and consume at the same logical points), so when no queue holds any the
  counts are 0 on every rank and no rank joins the reduction; when one does, every rank
  joins it, whatever its own counts. In a steady decode with nothing in flight agreement
  costs no collective.
- `pp_sync`: PP0 sends the agreed counts and the command list down the pipeline, point to
  point to the rank with its TP index in the next stage, as a non-blocking send of its own
  copy; handles are reaped on later rounds, with a bound on sends in flight. Later stages
  receive (blocking), forward, and consume exactly that count: `TransferEngine.pop(n)` waits
  for a copy of theirs still running and leaves newer ready ACKs queued. No cross-stage
  barrier: a stage only waits for what it needs from the stage before it.

The test switch `disable` makes ranks consume their own ready count instead: "pp_sync" on
later stages, "tp_min" on PP0 (its reduction then runs every step, result unused, so the
collectives stay aligned while the queues drift apart), "all" everywhere with no reduction
at all (the baseline of the agreement-cost benchmark). The rank consensus checker must then
report a divergence.
"""

from __future__ import annotations

import pickle
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from gpu_worker.parallel.groups import ParallelGroups

MAX_SENDS_IN_FLIGHT = 8  # non-blocking sends kept before waiting for the oldest
DISABLE_CHOICES = ("none", "pp_sync", "tp_min", "all")

# message tags between two ranks (gloo matches by tag: kinds never take each other's place)
TAG_HEADER, TAG_COMMANDS, TAG_HIDDEN, TAG_HIDDEN_SHAPE, TAG_OUTCOMES, TAG_EXPORT = 1, 2, 3, 4, 5, 6


class Sends:
    """Non-blocking sends in flight; each keeps its tensor alive until it completed."""

    def __init__(self, limit: int = MAX_SENDS_IN_FLIGHT) -> None:
        self.limit = limit
        self._inflight: deque[tuple[Any, torch.Tensor]] = deque()

    def send(self, tensor: torch.Tensor, dst: int, group: Any, tag: int) -> None:
        self.reap()
        while len(self._inflight) >= self.limit:
            work, _ = self._inflight.popleft()
            work.wait()
        work = dist.isend(tensor, dst, group=group, tag=tag)
        self._inflight.append((work, tensor))

    def reap(self) -> None:
        while self._inflight and self._inflight[0][0].is_completed():
            self._inflight.popleft()

    def flush(self) -> None:
        while self._inflight:
            work, _ = self._inflight.popleft()
            work.wait()

    def __len__(self) -> int:
        return len(self._inflight)


def encode_object(obj: object) -> torch.Tensor:
    """`obj` pickled into a uint8 tensor (empty for an empty list)."""
    if obj == []:
        return torch.empty(0, dtype=torch.uint8)
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode_object(tensor: torch.Tensor) -> Any:
    return [] if tensor.numel() == 0 else pickle.loads(tensor.numpy().tobytes())


class StepSync:
    """This rank's side of the per-step agreement (see the module docstring)."""

    def __init__(self, groups: ParallelGroups, disable: str = "none") -> None:
        if disable not in DISABLE_CHOICES:
            raise ValueError(
                f"unknown agreement switch {disable!r}; choose one of {DISABLE_CHOICES}"
            )
        self.groups = groups
        self.disable = disable
        self.sends = Sends()
        self.num_steps = 0
        # measured for the benchmarks (they decide nothing): time in exchange, and in the
        # agreement's own reductions (the ready-ACK MIN), and how many of those ran
        self.seconds = 0.0
        self.reduce_seconds = 0.0
        self.num_reductions = 0
        # first stage: steps whose agreed count of some queue was below this rank's own (a TP
        # peer was behind; the agreement held this rank back instead of making the peer wait)
        self.num_held_back = 0

    def exchange(
        self,
        commands: list[Any] | None,
        local_ready: tuple[int, ...],
        queued: tuple[int, ...],
    ) -> tuple[list[Any], tuple[int, ...]]:
        """The step's command list (rank 0 passes its own and gets the same objects back) and
        the number of ready ACKs this rank must consume from each queue. `local_ready`: this
        rank's finished ACKs at the front of each queue; `queued`: ACKs in each queue (the
        same on every rank)."""
        self.num_steps += 1
        g = self.groups
        if g.world_size == 1:
            return commands or [], local_ready
        start = time.perf_counter()
        if g.first_stage:
            commands, data, agreed = self._first_stage(commands, local_ready, queued)
            self.num_held_back += any(a < n for a, n in zip(agreed, local_ready, strict=True))
        else:
            commands, data, agreed = self._later_stage(len(local_ready))
        if not g.last_stage:
            self._send_down(agreed, data)
        self.seconds += time.perf_counter() - start
        return commands, self._consumed(agreed, local_ready)

    def _consumed(self, agreed: tuple[int, ...], local_ready: tuple[int, ...]) -> tuple[int, ...]:
        g, off = self.groups, self.disable
        if off == "all" or (off == "pp_sync" and not g.first_stage):
            return local_ready
        if off == "tp_min" and g.first_stage:
            return local_ready
        return agreed

    def _first_stage(
        self, commands: list[Any] | None, local_ready: tuple[int, ...], queued: tuple[int, ...]
    ) -> tuple[list[Any], torch.Tensor, tuple[int, ...]]:
        g = self.groups
        if g.stage_cpu is None:  # TP 1, CP 1: rank 0 is the whole first stage
            return commands or [], encode_object(commands or []), local_ready
        if g.rank == 0:
            data = encode_object(commands or [])
            size = torch.tensor([data.numel()], dtype=torch.int64)
            for peer in g.config.stage_world(0)[1:]:
                self.sends.send(size, peer, g.cpu_world, TAG_HEADER)
                if data.numel():
                    self.sends.send(data, peer, g.cpu_world, TAG_COMMANDS)
        else:
            size = torch.empty(1, dtype=torch.int64)
            dist.recv(size, 0, group=g.cpu_world, tag=TAG_HEADER)
            data = torch.empty(int(size[0]), dtype=torch.uint8)
            if data.numel():
                dist.recv(data, 0, group=g.cpu_world, tag=TAG_COMMANDS)
            commands = decode_object(data)
        agreed = (0,) * len(local_ready)  # nothing queued on any rank: nothing to agree on
        # "tp_min" off: queues differ between ranks, so all reduce every step and ignore the
        # result; "all" off (the agreement-cost benchmark's baseline): no reduction at all
        if self.disable != "all" and (any(queued) or self.disable == "tp_min"):
            counts = torch.tensor(local_ready, dtype=torch.int64)
            start = time.perf_counter()
            dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=g.stage_cpu)
            self.reduce_seconds += time.perf_counter() - start
            self.num_reductions += 1
            agreed = tuple(int(c) for c in counts.tolist())
        return commands or [], data, agreed

    def _later_stage(self, num_queues: int) -> tuple[list[Any], torch.Tensor, tuple[int, ...]]:
        g = self.groups
        header = torch.empty(num_queues + 1, dtype=torch.int64)
        src = g.stage_peer(g.pp_rank - 1)
        dist.recv(header, src, group=g.cpu_world, tag=TAG_HEADER)
        *counts, size = (int(v) for v in header.tolist())
        agreed = tuple(counts)
        data = torch.empty(size, dtype=torch.uint8)
        if size:
            dist.recv(data, src, group=g.cpu_world, tag=TAG_COMMANDS)
        return decode_object(data), data, agreed

    def _send_down(self, agreed: tuple[int, ...], data: torch.Tensor) -> None:
        g = self.groups
        dst = g.stage_peer(g.pp_rank + 1)
        header = torch.tensor([*agreed, data.numel()], dtype=torch.int64)
        self.sends.send(header, dst, g.cpu_world, TAG_HEADER)
        if data.numel():
            self.sends.send(data, dst, g.cpu_world, TAG_COMMANDS)

    def close(self) -> None:
        self.sends.flush()


def agree_min(groups: ParallelGroups, value: int) -> int:
    """The minimum of `value` over every rank of the world (start-up agreement)."""
    if groups.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=groups.cpu_world)
    return int(t[0])


def decider_rank(groups: ParallelGroups) -> int:
    """The world rank that makes a decision every rank must apply alike (speculative
    decoding's proposals and verify): TP rank 0 (CP rank 0) of the last stage, the first
    rank that holds the logits it is made from."""
    return groups.config.rank_of(groups.config.pp_size - 1, 0, 0)


def broadcast_decision(groups: ParallelGroups, decision: Any) -> Any:
    """`decision` as the decider (`decider_rank`) made it, on every rank of the world: the
    decider passes its own and gets it back, the others pass None. One pickled object over
    the CPU world group: every rank calls it at the same logical point."""
    if groups.world_size == 1:
        return decision
    box = [decision]
    dist.broadcast_object_list(box, src=decider_rank(groups), group=groups.cpu_world)
    return box[0]
