"""What every rank agrees on at the start of a step: rank 0's commands and the ready ACKs.

DESIGN.md 4 and the article's PP x HiCache section. Each step:

- PP0 (the first stage). Every rank counts the consecutive finished ACKs at the front of
  its transfer queue. With TP > 1 one packed int64 all_reduce(MIN) over the stage's TP group
  carries both that count (MIN: the ACKs finished on every TP rank) and the size of rank 0's
  pickled command list (as its negative, so MIN picks it up); a broadcast of the list
  follows only when there is one. So agreement costs no collective of its own: the one that
  distributes work carries it, and every rank joins it every step, even with empty queues.
- `pp_sync`: PP0 sends the agreed count and the command list down the pipeline, point to
  point to the rank with its TP index in the next stage, as a non-blocking send of its own
  copy; handles are reaped on later rounds, with a bound on sends in flight. Later stages
  receive (blocking), forward, and consume exactly that count: `TransferEngine.pop(n)` waits
  for a copy of theirs still running and leaves newer ready ACKs queued. No cross-stage
  barrier: a stage only waits for what it needs from the stage before it.

The test switch `disable` ("pp_sync", "tp_min" or "all") makes ranks consume their own ready
count instead; the rank consensus checker must then report a divergence.
"""

from __future__ import annotations

import pickle
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

    def exchange(self, commands: list[Any] | None, local_ready: int) -> tuple[list[Any], int]:
        """The step's command list (rank 0 passes its own and gets the same objects back) and
        the number of ready ACKs this rank must consume."""
        self.num_steps += 1
        g = self.groups
        if g.world_size == 1:
            return commands or [], local_ready
        if g.first_stage:
            commands, data, agreed = self._first_stage(commands, local_ready)
        else:
            commands, data, agreed = self._later_stage()
        if not g.last_stage:
            self._send_down(agreed, data)
        return commands, self._consumed(agreed, local_ready)

    def _consumed(self, agreed: int, local_ready: int) -> int:
        g, off = self.groups, self.disable
        if off == "all" or (off == "pp_sync" and not g.first_stage):
            return local_ready
        if off == "tp_min" and g.first_stage:
            return local_ready
        return agreed

    def _first_stage(
        self, commands: list[Any] | None, local_ready: int
    ) -> tuple[list[Any], torch.Tensor, int]:
        g = self.groups
        own = g.rank == 0
        data = encode_object(commands or []) if own else torch.empty(0, dtype=torch.uint8)
        if g.tp_cpu is None:  # TP 1: rank 0 alone in its stage
            return commands or [], data, local_ready
        packed = torch.tensor([local_ready, -data.numel() if own else 0], dtype=torch.int64)
        dist.all_reduce(packed, op=dist.ReduceOp.MIN, group=g.tp_cpu)
        agreed, size = int(packed[0]), -int(packed[1])
        if size:
            if not own:
                data = torch.empty(size, dtype=torch.uint8)
            dist.broadcast(data, src=g.tp_src, group=g.tp_cpu)
        return (commands or []) if own else decode_object(data), data, agreed

    def _later_stage(self) -> tuple[list[Any], torch.Tensor, int]:
        g = self.groups
        header = torch.empty(2, dtype=torch.int64)
        src = g.stage_peer(g.pp_rank - 1)
        dist.recv(header, src, group=g.cpu_world, tag=TAG_HEADER)
        agreed, size = int(header[0]), int(header[1])
        data = torch.empty(size, dtype=torch.uint8)
        if size:
            dist.recv(data, src, group=g.cpu_world, tag=TAG_COMMANDS)
        return decode_object(data), data, agreed

    def _send_down(self, agreed: int, data: torch.Tensor) -> None:
        g = self.groups
        dst = g.stage_peer(g.pp_rank + 1)
        header = torch.tensor([agreed, data.numel()], dtype=torch.int64)
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
