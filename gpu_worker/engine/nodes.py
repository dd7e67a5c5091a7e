"""An engine's world over several hosts ("nodes"), as SGLang lays it out.

`--dist-init-addr HOST:PORT --nnodes N --node-rank R`: node 0 hosts the world's rendezvous
(a TCPStore) on PORT, and every node runs world/N contiguous ranks (node R: ranks
R*world/N .. (R+1)*world/N - 1). Node 0 is the engine service (rank 0 drives the world);
a node of rank > 0 only joins it (`gpu_worker/engine/rank.py` `run_node`).

What crosses the rendezvous besides torch.distributed's own keys (under `hicache/`):
- each node's engine config, flattened to `field: repr` (`config_fields`): every node
  compares its own with node 0's and a difference fails start-up naming the field;
- each node's beat counter (`NodeBeat`, every `NODE_BEAT_S`): node 0 counts a node that
  has not beaten for `NODE_LOST_S` as lost (a cut link does not reset a TCP connection: a
  collective with it would wait out gloo's whole timeout), and a node that cannot beat for
  that long leaves the world itself;
- the exit status of a rank that failed on a node > 0 (`report_exit`), so node 0 names it
  at once, as it does a local child's.

gloo binds to the interface that routes toward HOST (`use_interface_toward`) unless
`GLOO_SOCKET_IFNAME` is set: its default, the address the host name resolves to, is often
a loopback or another network's address that the other nodes cannot reach.
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)

NODE_BEAT_S = 0.5  # how often a node > 0 beats through the rendezvous
NODE_LOST_S = 4.0  # a node silent this long is lost (both ways: node 0 and the node itself)
CONFIG_KEY = "hicache/config/{}"  # a node's engine config, flattened (JSON)
BEAT_KEY = "hicache/beat/{}"  # a node's beat counter
EXIT_KEY = "hicache/exit/{}"  # a rank's exit status (a rank on a node > 0 that failed)
SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


@dataclass(frozen=True, slots=True)
class NodeLayout:
    """Which hosts an engine's world spans and which one this process is."""

    dist_init_addr: str | None = None  # HOST:PORT of node 0's rendezvous; None: loopback
    nnodes: int = 1
    node_rank: int = 0

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes - 1}], got {self.node_rank}")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("--nnodes above 1 needs --dist-init-addr HOST:PORT (node 0's address)")
        if self.dist_init_addr is not None:
            self.host  # noqa: B018 - validates HOST:PORT
            self.port  # noqa: B018

    @property
    def multi(self) -> bool:
        return self.nnodes > 1

    @property
    def host(self) -> str:
        assert self.dist_init_addr is not None
        host, sep, _ = self.dist_init_addr.rpartition(":")
        if not sep or not host:
            raise ValueError(f"--dist-init-addr wants HOST:PORT, got {self.dist_init_addr!r}")
        return host.strip("[]")

    @property
    def port(self) -> int:
        assert self.dist_init_addr is not None
        _, _, port = self.dist_init_addr.rpartition(":")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--dist-init-addr wants HOST:PORT, got {self.dist_init_addr!r}")
        return int(port)

    def ranks_per_node(self, world_size: int) -> int:
        if world_size % self.nnodes:
            raise ValueError(
                f"the engine's {world_size} ranks do not split evenly over --nnodes {self.nnodes}"
            )
        return world_size // self.nnodes

    def local_ranks(self, world_size: int) -> range:
        """This node's world ranks (contiguous)."""
        per = self.ranks_per_node(world_size)
        return range(self.node_rank * per, (self.node_rank + 1) * per)

    def node_of(self, rank: int, world_size: int) -> int:
        return rank // self.ranks_per_node(world_size)


ONE_NODE = NodeLayout()  # the whole world on this host, its rendezvous on loopback


def interface_toward(host: str) -> str:
    """The local interface whose address the kernel would send from toward `host`."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))  # a UDP connect sends nothing: it only picks the route
        except OSError as e:
            raise ValueError(f"--dist-init-addr: cannot reach {host!r} from this host: {e}") from e
        local = s.getsockname()[0]
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name[:15].encode())
            try:
                answer = fcntl.ioctl(s.fileno(), SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(answer[20:24]) == local:
                return name
    raise ValueError(f"no local interface holds {local}, the address that reaches {host}")


def use_interface_toward(host: str) -> None:
    """Make gloo (in this process and its children) bind to the interface toward `host`,
    unless the operator chose one with GLOO_SOCKET_IFNAME."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    name = interface_toward(host)
    os.environ["GLOO_SOCKET_IFNAME"] = name
    log.info("gloo binds to %s, the interface toward %s", name, host)


def config_fields(config: Any, prefix: str = "") -> dict[str, str]:
    """A frozen config (nested dataclasses) as `dotted.field: repr(value)`."""
    out: dict[str, str] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out |= config_fields(value, f"{prefix}{f.name}.")
        else:
            out[f"{prefix}{f.name}"] = repr(value)
    return out


def check_same_config(store: dist.Store, config: Any, layout: NodeLayout, timeout_s: float) -> None:
    """Publish this node's config and compare it with every other node's (node 0 waits for
    all of them, a node > 0 for node 0's): a ValueError naming the first differing field."""
    mine = config_fields(config)
    store.set(CONFIG_KEY.format(layout.node_rank), json.dumps(mine))
    others = range(1, layout.nnodes) if layout.node_rank == 0 else [0]
    keys = [CONFIG_KEY.format(n) for n in others]
    store.wait(keys, datetime.timedelta(seconds=timeout_s))
    for node, key in zip(others, keys, strict=True):
        theirs: dict[str, str] = json.loads(store.get(key))
        names = [*mine, *(name for name in theirs if name not in mine)]  # declaration order
        differ = [
            f"{name} (node {layout.node_rank}: {mine.get(name)}, node {node}: {theirs.get(name)})"
            for name in names
            if mine.get(name) != theirs.get(name)
        ]
        if differ:
            raise ValueError(
                f"engine nodes disagree on {'; '.join(differ)}: every node must be started "
                "with the same engine flags"
            )


def report_exit(store: dist.Store | None, rank: int, status: int) -> None:
    """Tell node 0 how this rank ended (best effort: the link may be what failed)."""
    if store is None:
        return
    try:
        store.set(EXIT_KEY.format(rank), str(status))
    except Exception as e:  # the rendezvous is gone or cut off: node 0 sees the silence
        log.warning("could not report rank %d's exit to node 0: %s", rank, e)


class NodeBeat:
    """A node > 0's beats to node 0, on a thread of their own over a store client of their
    own; when none has gone through for `NODE_LOST_S` (node 0 or the link is gone, and a
    collective may wait out gloo's timeout), `on_lost` ends the process."""

    def __init__(
        self, layout: NodeLayout, on_lost: Callable[[], None], lost_s: float = NODE_LOST_S
    ) -> None:
        self._layout = layout
        self._on_lost = on_lost
        self._lost_s = lost_s
        self._last_ok = time.monotonic()
        self._beat = threading.Thread(target=self._beats, name="node-beat", daemon=True)
        self._watch = threading.Thread(target=self._watches, name="node-watch", daemon=True)

    def start(self) -> None:
        self._beat.start()
        self._watch.start()

    def _beats(self) -> None:
        key = BEAT_KEY.format(self._layout.node_rank)
        store: dist.TCPStore | None = None
        while True:
            try:
                if store is None:
                    store = dist.TCPStore(
                        self._layout.host,
                        self._layout.port,
                        is_master=False,
                        timeout=datetime.timedelta(seconds=self._lost_s),
                    )
                store.add(key, 1)
                self._last_ok = time.monotonic()
            except Exception as e:  # the watcher decides when silence means lost
                log.debug("a beat to node 0 failed: %s", e)
                store = None
            time.sleep(NODE_BEAT_S)

    def _watches(self) -> None:
        while time.monotonic() - self._last_ok < self._lost_s:
            time.sleep(NODE_BEAT_S / 2)
        log.error(
            "node %d heard nothing from node 0 for %.1fs: its link or host is down; leaving",
            self._layout.node_rank,
            self._lost_s,
        )
        self._on_lost()


class NodeWatch:
    """Node 0's view of the other nodes: their beats and the exits their ranks reported.
    Read from the rank watcher's thread (the store is node 0's own, on this host)."""

    def __init__(
        self, store: dist.Store, layout: NodeLayout, world_size: int, lost_s: float = NODE_LOST_S
    ) -> None:
        self._store = store
        self._layout = layout
        self._world_size = world_size
        self.lost_s = lost_s
        now = time.monotonic()
        self._seen: dict[int, tuple[int, float]] = {n: (0, now) for n in range(1, layout.nnodes)}
        self._remote = [
            r for r in range(world_size) if layout.node_of(r, world_size) != layout.node_rank
        ]

    def exits(self) -> list[tuple[int, int]]:
        """(rank, status) of every remote rank that reported its exit."""
        keys = [EXIT_KEY.format(r) for r in self._remote]
        out = []
        for rank, key in zip(self._remote, keys, strict=True):
            if self._store.check([key]):
                out.append((rank, int(self._store.get(key))))
        return out

    def silent(self) -> list[int]:
        """Every node > 0 that has not beaten for `lost_s`, by its first rank."""
        now = time.monotonic()
        out = []
        for node, (count, since) in self._seen.items():
            beats = self._store.add(BEAT_KEY.format(node), 0)
            if beats != count:
                self._seen[node] = (beats, now)
            elif now - since >= self.lost_s:
                out.append(node * self._layout.ranks_per_node(self._world_size))
        return out
