"""Run a workload on rank 0 of a real multi-rank engine world, from a test.

`run_world(config, workload, *args)` spawns a fresh process that launches the engine's
world exactly as the engine service does (`launch_engine`: rank 0 in that process, ranks
1..N-1 as child processes over gloo), calls `workload(engine, *args)` on rank 0 and sends its
result back; the engine is closed and every rank process reaped before it returns. The
workload must be a module-level function (it is pickled by name). A workload that raises,
or an engine that dies, raises `WorldFailed` here with the rank-0 traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

    from gpu_worker.engine.engine import Engine
    from gpu_worker.model.sampling import SamplingParams

T = TypeVar("T")

WORLD_TIMEOUT_S = 240.0


class WorldFailed(AssertionError):
    pass


def _rank0(conn: Connection, job: bytes, env: dict[str, str]) -> None:
    # The environment first: the checker's decorators read it when gpu_worker is imported,
    # which unpickling the config and the workload does.
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    from gpu_worker.engine.rank import launch_engine

    engine = ranks = None
    try:
        config, workload, args = pickle.loads(job)
        engine, ranks = launch_engine(config)
        # plain pickle: Connection.send would share tensor storage by file descriptor, which
        # this process stops serving when it exits, maybe before the parent has read it
        conn.send_bytes(pickle.dumps(("ok", workload(engine, *args))))
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        if ranks is not None:
            ranks.kill()
        return
    engine.close()
    if ranks is not None:
        ranks.wait()


def run_world(
    config: Any,
    workload: Callable[..., T],
    *args: Any,
    env: dict[str, str] | None = None,
    timeout_s: float = WORLD_TIMEOUT_S,
) -> T:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    job = pickle.dumps((config, workload, args))
    proc = ctx.Process(target=_rank0, args=(child, job, env or {}))
    saved = dict(os.environ)
    os.environ.update(env or {})  # the child inherits it from its very first import on
    try:
        proc.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    child.close()
    try:
        if not parent.poll(timeout_s):
            raise WorldFailed(f"the world gave no result within {timeout_s} s")
        status, value = pickle.loads(parent.recv_bytes())
    except EOFError:
        raise WorldFailed(f"rank 0 died (exit status {proc.exitcode})") from None
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if status != "ok":
        raise WorldFailed(f"the workload failed on rank 0:\n{value}")
    return value  # type: ignore[no-any-return]


# ------------------------------------------------------------------ the oracle's workload

# (phase, output ids, cached device, cached host, logits (steps, vocab)) per request
Run = list[tuple[str, list[int], int, int, "torch.Tensor"]]


def shared_prefix_prompts(
    seed: int, shared: tuple[int, int], tail: tuple[int, int]
) -> list[list[int]]:
    """Three groups of three prompts: a random shared prefix of `shared` (min, max) tokens,
    then a tail of `tail` tokens each, ids below 256 (every test preset's vocabulary)."""
    import random

    rng = random.Random(seed)
    prompts = []
    for _ in range(3):
        prefix = [rng.randrange(256) for _ in range(rng.randint(*shared))]
        for _ in range(3):
            prompts.append(prefix + [rng.randrange(256) for _ in range(rng.randint(*tail))])
    return prompts


def traced_batch(
    engine: Engine, phase: str, prompts: list[list[int]], sampling: SamplingParams
) -> Run:
    """Run `prompts` as one batch with every step's logits traced."""
    import torch

    reqs = [engine.submit(p, sampling) for p in prompts]
    for r in reqs:
        r.logits_trace = []
    outs = engine.run(reqs)
    return [
        (phase, o.output_ids, o.cached.device, o.cached.host, torch.stack(r.logits_trace or []))
        for o, r in zip(outs, reqs, strict=True)
    ]


# ------------------------------------------------------------------ bare gloo worlds


def _gloo_rank(
    target: Callable[..., None], rank: int, world: int, port: int, out: Any, args: tuple
) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        timeout = datetime.timedelta(seconds=60)
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        target(rank, world, dist.new_group(list(range(world)), timeout=timeout), *args)
        dist.destroy_process_group()
        out.put((rank, "ok"))
    except BaseException:
        out.put((rank, traceback.format_exc()))


def run_gloo_ranks(
    target: Callable[..., None], world: int, *args: Any, timeout_s: float = 180.0
) -> None:
    """Run `target(rank, world, group, *args)` on `world` gloo rank processes (no engine: a
    pool or kernel test's own world); raise with every failing rank's traceback. `target`
    must be a module-level function (it is pickled by name)."""
    import queue
    import socket

    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_gloo_rank, args=(target, r, world, port, out, args))
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    try:
        reports = dict(out.get(timeout=timeout_s) for _ in range(world))
    except queue.Empty:
        reports = {}
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    assert sorted(reports) == list(range(world)), f"ranks reported {sorted(reports)}"
    failed = {r: msg for r, msg in reports.items() if msg != "ok"}
    assert not failed, "\n".join(f"rank {r}:\n{msg}" for r, msg in failed.items())
