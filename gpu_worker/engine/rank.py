"""The launcher of an engine's world: rank 0 here, ranks 1..N-1 as child processes.

`launch_engine(config)` checks that the model splits over the layout, opens the world's
rendezvous (a TCPStore on a free loopback port), starts one process per other rank
(`python -m gpu_worker.engine.rank --rank R --world-size N`, which `ps` shows; its spec is
pickled on stdin), joins the world as rank 0
and returns rank 0's `Engine` with a `RankProcesses` handle. The caller drives the engine
(the engine service's runner thread, `hicache-mesh generate`, a test); the other ranks run
`Engine.follow()` and exit 0 when rank 0 sends Stop.

Failure: a rank that raises logs why and exits 1 (`EXIT_FAILED`), so its peers' next
collective with it fails and the error reaches rank 0; a rank whose collective failed
because a peer went away exits 3 (`EXIT_PEER_LOST`: a symptom, not a cause).
`RankProcesses.dead()` lets the caller see a dead rank at once, and `exit_cause()` names the
rank whose exit ended the world and whether a request can have caused it (`RankExit`). Every child asks the kernel to kill it when the thread that started it ends
(PR_SET_PDEATHSIG), so no rank outlives its engine.

Across hosts (`NodeLayout`, `gpu_worker/engine/nodes.py`): node 0 hosts the rendezvous on
`--dist-init-addr` and runs its own ranks as above; `run_node` is a node of rank > 0 (the
engine service started with `--node-rank R`): it checks its config against node 0's, runs
its first rank itself and its other ranks as children, beats to node 0, and exits with its
rank's status when the world ends (0 when rank 0 stopped it). Node 0 sees a remote rank's
exit through the rendezvous and a silent node as `EXIT_NODE_LOST`.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from gpu_worker.consensus.checker import consensus_enabled
from gpu_worker.engine.draft import check_draft_layout
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.engine.nodes import (
    NODE_BEAT_S,
    ONE_NODE,
    NodeBeat,
    NodeLayout,
    NodeWatch,
    check_same_config,
    report_exit,
    use_interface_toward,
)
from gpu_worker.model.shard import ModelShard
from gpu_worker.model.weights import model_config_of
from gpu_worker.parallel.groups import (
    DEFAULT_TIMEOUT_S,
    destroy_parallel_groups,
    init_parallel_groups,
)

log = logging.getLogger(__name__)

RENDEZVOUS_HOST = "127.0.0.1"
PR_SET_PDEATHSIG = 1
EXIT_FAILED = 1  # the rank raised: its own work failed (a request may be the cause)
EXIT_PEER_LOST = 3  # a collective failed because a peer rank went away first
EXIT_NODE_LOST = 4  # node 0's view of a node > 0 that stopped beating (host or link down)
# Killed from outside: an operator, a supervisor, the kernel's OOM killer. A crash signal
# (SIGSEGV, SIGABRT, SIGBUS, SIGFPE) is the rank's own fault and may be a request's doing.
EXTERNAL_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
EXIT_SETTLE_S = 0.05  # after the first cause shows: time for a killed sibling's status to show


@dataclass(frozen=True, slots=True)
class RankExit:
    """How a child rank ended: its exit status, or minus the signal that killed it."""

    rank: int
    status: int

    @property
    def external(self) -> bool:
        """Nothing the rank computed can have caused it: it was killed from outside or lost
        a peer. The requests its engine held may be served elsewhere."""
        if self.status in (EXIT_PEER_LOST, EXIT_NODE_LOST):
            return True
        return self.status < 0 and -self.status in EXTERNAL_SIGNALS

    def describe(self) -> str:
        if self.status < 0:
            try:
                name = signal.Signals(-self.status).name
            except ValueError:
                name = f"signal {-self.status}"
            return f"engine rank {self.rank} was killed by {name}"
        if self.status == EXIT_PEER_LOST:
            return f"engine rank {self.rank} lost its connection to a peer rank"
        if self.status == EXIT_NODE_LOST:
            return f"engine rank {self.rank}'s node stopped answering (its host or link is down)"
        return f"engine rank {self.rank} exited with status {self.status}"


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What a child rank needs to join (pickled on its stdin)."""

    config: EngineConfig
    rank: int
    host: str  # the rendezvous
    port: int
    parent_pid: int
    timeout_s: float
    report: bool = False  # on a node > 0: tell node 0 how it ended (`report_exit`)
    device_index: int | None = None  # its index among its host's ranks (its GPU)


class RankProcesses:
    """The other ranks of one engine (world ranks 1..N-1): node 0's as child processes,
    the other nodes' through the rendezvous (`nodes`)."""

    def __init__(
        self,
        procs: dict[int, subprocess.Popen[bytes]],
        store: dist.TCPStore,
        nodes: NodeWatch | None = None,
    ) -> None:
        self.procs = procs
        self._store = store  # rank 0 hosts the rendezvous: kept alive with the world
        self._nodes = nodes

    def dead(self) -> list[tuple[int, int]]:
        """(rank, exit status) of every child that has exited, every remote rank that
        reported its exit, and the first rank of every silent node (`EXIT_NODE_LOST`)."""
        out = [(r, p.returncode) for r, p in self.procs.items() if p.poll() is not None]
        if self._nodes is not None:
            out += self._nodes.exits()
            out += [(r, EXIT_NODE_LOST) for r in self._nodes.silent()]
        return out

    def exit_cause(self, wait_s: float) -> RankExit | None:
        """The child exit that ended the world, or None when no child has exited within
        `wait_s`. Ranks that only lost a peer are symptoms: their peer's own exit is
        waited for (up to `wait_s`) and named instead; of several causes, a rank killed by a
        signal comes first (its siblings' collectives broke because of it). Over several
        nodes it waits at least as long as a silent node takes to count as lost: a node whose
        process died cannot report it, and rank 0's failed collective shows first."""
        if self._nodes is not None:
            wait_s = max(wait_s, self._nodes.lost_s + NODE_BEAT_S)
        deadline = time.monotonic() + wait_s
        settle: float | None = None
        while True:
            dead = [RankExit(r, s) for r, s in self.dead()]
            causes = [d for d in dead if d.status != EXIT_PEER_LOST]
            now = time.monotonic()
            if causes and settle is None:
                settle = now + EXIT_SETTLE_S
            if (settle is not None and now >= settle) or now >= deadline:
                break
            time.sleep(0.01)
        if causes:
            return min(causes, key=lambda d: (d.status >= 0, d.rank))
        return dead[0] if dead else None

    @property
    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def wait(self, timeout_s: float = 10.0) -> None:
        """Wait for every child to exit; kill what is left after `timeout_s`."""
        for p in self.procs.values():
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def kill(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            p.wait()


def check_layout(config: EngineConfig) -> None:
    """A clear error, before any process starts, when the model does not split."""
    model = model_config_of(config.model, config.context_len)
    for rank in range(config.parallel.world_size):
        ModelShard.of(model, config.parallel, rank)
    if config.spec.enabled:  # the draft is sharded like the target
        check_draft_layout(config.spec, config.model, config.parallel, config.context_len)


def _spawn(
    config: EngineConfig, ranks: range, host: str, port: int, timeout_s: float, report: bool
) -> dict[int, subprocess.Popen[bytes]]:
    """One child process per rank of `ranks`, each told where the rendezvous is."""
    world = config.parallel.world_size
    procs: dict[int, subprocess.Popen[bytes]] = {}
    try:
        for rank in ranks:
            spec = RankSpec(
                config, rank, host, port, os.getpid(), timeout_s, report, rank - ranks.start + 1
            )
            argv = [sys.executable, "-m", "gpu_worker.engine.rank", "--rank", str(rank)]
            proc = subprocess.Popen([*argv, "--world-size", str(world)], stdin=subprocess.PIPE)
            procs[rank] = proc
            assert proc.stdin is not None
            proc.stdin.write(pickle.dumps(spec))
            proc.stdin.close()
    except BaseException:
        _kill(procs)
        raise
    return procs


def _kill(procs: dict[int, subprocess.Popen[bytes]]) -> None:
    for p in procs.values():
        p.kill()
        p.wait()


def launch_engine(
    config: EngineConfig,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    layout: NodeLayout = ONE_NODE,
) -> tuple[Engine, RankProcesses | None]:
    """Rank 0's Engine of a new world of `config.parallel` ranks (see the module doc); with
    `layout` over several nodes, this is node 0 and only its own ranks start here."""
    world = config.parallel.world_size
    if world == 1 and not layout.multi:
        return Engine(config), None
    local = layout.local_ranks(world)
    check_layout(config)
    host, port = RENDEZVOUS_HOST, 0
    if layout.multi:
        host, port = layout.host, layout.port
        use_interface_toward(host)
    store = dist.TCPStore(
        host,
        port,
        world,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    procs: dict[int, subprocess.Popen[bytes]] = {}
    try:
        procs = _spawn(config, local[1:], host, store.port, timeout_s, report=False)
        if layout.multi:
            check_same_config(store, config, layout, timeout_s)
        device = torch.device(config.device)
        groups = init_parallel_groups(
            config.parallel,
            0,
            store,
            device,
            timeout_s,
            consensus=consensus_enabled(),
            storage=config.cache.hicache_storage_backend is not None,
        )
        engine = Engine(config, groups)
    except BaseException:
        _kill(procs)
        raise
    log.info(
        "engine world %s up on %d node(s): local ranks %s are pids %s",
        config.parallel.describe(),
        layout.nnodes,
        list(local[1:]),
        [p.pid for p in procs.values()],
    )
    nodes = NodeWatch(store, layout, world) if layout.multi else None
    return engine, RankProcesses(procs, store, nodes)


def run_node(
    config: EngineConfig, layout: NodeLayout, timeout_s: float = DEFAULT_TIMEOUT_S
) -> NoReturn:
    """A node of rank > 0: join node 0's world with this node's ranks and exit with the
    first of them's status when the world ends (see the module doc). Bad flags or a config
    that differs from node 0's raise ValueError before any rank joins."""
    world = config.parallel.world_size
    local = layout.local_ranks(world)
    if layout.node_rank == 0:
        raise ValueError("node 0 is the engine service itself: start it without --node-rank")
    check_layout(config)
    use_interface_toward(layout.host)
    store = dist.TCPStore(
        layout.host,
        layout.port,
        world,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    check_same_config(store, config, layout, timeout_s)
    _spawn(config, local[1:], layout.host, layout.port, timeout_s, report=True)  # they report
    spec = RankSpec(config, local.start, layout.host, layout.port, os.getpid(), timeout_s, True, 0)
    NodeBeat(layout, lambda: _leave(None, local.start, EXIT_PEER_LOST)).start()  # unreachable
    log.info("node %d joins with ranks %s", layout.node_rank, list(local))
    _run_rank(spec, store)  # the children die with this process (PR_SET_PDEATHSIG)


def _die_with_parent(parent_pid: int) -> None:
    """Be killed when the thread that started this process ends (Linux), and leave at
    once if it already has."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)


def _peer_lost(error: Exception) -> bool:
    """A collective failed because a peer's connection broke or timed out (gloo's transport
    raises these as plain RuntimeErrors naming its source file), not by this rank's work."""
    if isinstance(error, dist.DistNetworkError):
        return True
    return isinstance(error, RuntimeError) and "gloo/transport/" in str(error)


def _leave(store: dist.Store | None, rank: int, status: int) -> NoReturn:
    """End this rank's process now (no teardown of gloo: a broken world's would hang),
    telling node 0 first when this is a node > 0."""
    report_exit(store, rank, status)
    logging.shutdown()
    os._exit(status)


def main() -> None:
    spec: RankSpec = pickle.loads(sys.stdin.buffer.read())
    _die_with_parent(spec.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops us
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s rank{spec.rank} %(name)s %(levelname)s %(message)s",
    )
    store = dist.TCPStore(
        spec.host,
        spec.port,
        spec.config.parallel.world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=spec.timeout_s),
    )
    _run_rank(spec, store)


def _run_rank(spec: RankSpec, store: dist.TCPStore) -> NoReturn:
    """Join the world as `spec.rank`, follow rank 0 until it stops the world, exit."""
    torch.set_num_threads(1)
    config = spec.config
    device = torch.device(config.device)
    try:
        groups = init_parallel_groups(
            config.parallel,
            spec.rank,
            store,
            device,
            spec.timeout_s,
            consensus=consensus_enabled(),
            storage=config.cache.hicache_storage_backend is not None,
            device_index=spec.device_index,
        )
        engine = Engine(config, groups)
        engine.follow()
        engine.close()
        destroy_parallel_groups(groups)
    except Exception as e:
        lost = _peer_lost(e)
        if lost:
            log.error("rank %d of the engine lost a peer: %s", spec.rank, e)
        else:
            log.exception("rank %d of the engine failed", spec.rank)
        # At once, without a teardown of gloo: rank 0 names the cause to every request.
        _leave(store if spec.report else None, spec.rank, EXIT_PEER_LOST if lost else EXIT_FAILED)
    _leave(None, spec.rank, 0)  # done: the interpreter's teardown of torch takes seconds


if __name__ == "__main__":
    main()
