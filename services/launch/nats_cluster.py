"""A NATS cluster: N `nats-server`s with authenticated routes (`NatsCluster`), for `up
--nats-cluster N`, tests and the multi-host setups (`start_nats_cluster(n, host=...)` binds
every member to one address, e.g. a bridge's).

Every member has the same client config as a single server (`servers.nats_kind`: users and
permissions, max_payload, TLS); the members' routes authenticate as one route identity with
a fresh password (in each member's 0600 config file, never on a command line) and, with
TLS, use it too: mutual TLS, each member verifying the other's certificate (the certificate
`tls.make_tls` makes serves both ends). A member that dies and is restarted on its ports
rejoins on its own (a member retries its routes forever).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import secrets
import sys
import time
import urllib.request
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bus_schemas.connection import Credentials
from services.launch.credentials import write_private
from services.launch.servers import (
    NATS,
    PortTakenError,
    ServerKind,
    ServerProcess,
    free_port,
    start_server,
)
from services.launch.tls import ServerTLS, nats_tls_block

CLUSTER_NAME = "hicache"
ROUTE_USER = "route"


@dataclass(frozen=True, slots=True)
class NatsCluster:
    """An N-server NATS cluster on `host`: each member's client, route and monitoring ports
    (monitoring: /healthz, /routez, /connz on `host`), and the one identity the members'
    routes authenticate with. Every member gets the same client config (`kind`:
    max_payload, users and permissions, TLS); with `tls`, routes use TLS too, mutual (each
    member verifies the other's certificate against the CA).

    Members do not advertise each other to clients (`no_advertise`): a client's servers are
    exactly its `--nats-url` list, in its order, never an address a member saw itself by
    (a 0.0.0.0 listener advertises every interface; a container its internal address; a
    certificate may name neither)."""

    kind: ServerKind = field(repr=False)  # its argv holds the users' passwords
    ports: tuple[int, ...]
    route_ports: tuple[int, ...]
    monitor_ports: tuple[int, ...]
    route: Credentials
    tls: ServerTLS | None = None
    host: str = "127.0.0.1"

    @classmethod
    def plan(
        cls,
        n: int,
        kind: ServerKind = NATS,
        host: str = "127.0.0.1",
        tls: ServerTLS | None = None,
        free_port: Callable[[Collection[int]], int] = free_port,
        avoid: Collection[int] = (),
    ) -> NatsCluster:
        """`n` members (at least 2) on free ports other than `avoid`, a fresh route password."""
        if n < 2:
            raise ValueError(f"a NATS cluster needs at least 2 servers, got {n}")
        taken = set(avoid)
        drawn = []
        for _ in range(3 * n):
            drawn.append(free_port(taken))
            taken.add(drawn[-1])
        route = Credentials(ROUTE_USER, secrets.token_urlsafe(32))
        return cls(
            kind, tuple(drawn[:n]), tuple(drawn[n : 2 * n]), tuple(drawn[2 * n :]), route, tls, host
        )

    def member(self, i: int) -> ServerKind:
        """Member `i` as a ServerKind named `nats-{i}` (its config adds the cluster block)."""
        nats: Callable[..., list[str]] = self.kind.argv  # nats_argv, or a partial of it
        argv = functools.partial(
            nats,
            cluster=self.block(i),
            host=self.host,
            monitor_port=self.monitor_ports[i],
        )
        url = self.kind.url.replace("127.0.0.1", self.host)
        return dataclasses.replace(self.kind, name=f"nats-{i}", argv=argv, url=url, host=self.host)

    def urls(self) -> list[str]:
        return [self.member(i).url.format(p) for i, p in enumerate(self.ports)]

    def url(self) -> str:
        """Every member's client URL, comma-separated (what every service is given)."""
        return ",".join(self.urls())

    def monitor_url(self, i: int) -> str:
        return f"http://{self.host}:{self.monitor_ports[i]}"

    def block(self, i: int) -> str:
        """Member `i`'s `cluster {}` config block: it listens for routes on its route port,
        requires the route identity, and routes to every other member (retried forever, so
        a restarted member rejoins)."""
        others = [f"{self.host}:{p}" for j, p in enumerate(self.route_ports) if j != i]
        return cluster_block(self.route, others, f"{self.host}:{self.route_ports[i]}", self.tls)

    def routes(self, i: int) -> int:
        """How many other members member `i` routes to now (-1: its monitoring did not
        answer)."""
        return route_peers(self.monitor_url(i))


def route_peers(monitor_url: str) -> int:
    """How many other servers the server with monitoring at `monitor_url` routes to (nats
    2.10+ pools several connections per peer: peers, not connections); -1 when it did not
    answer."""
    try:
        with urllib.request.urlopen(f"{monitor_url}/routez", timeout=2.0) as r:
            routez = json.loads(r.read())
        return len({route["remote_id"] for route in routez.get("routes") or []})
    except (OSError, ValueError, KeyError, TypeError):
        return -1


def cluster_block(
    route: Credentials, routes: Sequence[str], listen: str = "", tls: ServerTLS | None = None
) -> str:
    """A nats-server `cluster {}` block: routes authenticated as `route` to the `routes`
    (host:port; a member's own is ignored), listening on `listen` ("": given by the
    command line, `--cluster nats://HOST:PORT`); `tls`: routes over mutual TLS."""
    for text in (route.password, *routes, listen):
        if any(c in text for c in '"\\\n@/ '):
            raise ValueError(
                "a NATS cluster route password or address holds a quote, backslash, @, / or space"
            )
    urls = ", ".join(f'"nats-route://{route.user}:{route.password}@{r}"' for r in routes)
    out = f'cluster {{\n  name: "{CLUSTER_NAME}"\n'
    out += f'  listen: "{listen}"\n' if listen else ""
    out += f'  authorization {{ user: "{route.user}", password: "{route.password}", timeout: 2 }}\n'
    out += f"  routes: [{urls}]\n  no_advertise: true\n"
    if tls is not None:  # mutual: the dialing member shows its certificate too
        client = nats_tls_block(tls).replace("\n", "\n  ").rstrip(" ")
        out += "  " + client.replace("}\n", f'  ca_file: "{tls.ca_file}"\n    verify: true\n  }}\n')
    return out + "}\n"


def start_nats_cluster(
    n: int = 3,
    host: str = "127.0.0.1",
    kind: ServerKind = NATS,
    tls: ServerTLS | None = None,
    attempts: int = 3,
    timeout_s: float = 15.0,
) -> tuple[NatsCluster, list[ServerProcess]]:
    """Start an `n`-server cluster on `host` (every member with `kind`'s config; `tls`: routes
    over TLS too, `kind` should then be `nats_kind(..., tls=tls)`), and return once every
    member routes to every other one: the plan (`.url()`: what to give clients) and the
    members, in order (`stop()` each)."""
    for attempt in range(1, attempts + 1):
        cluster = NatsCluster.plan(n, kind, host, tls)
        servers: list[ServerProcess] = []
        try:
            for i, port in enumerate(cluster.ports):
                servers.append(start_server(cluster.member(i), port))
            wait_for_routes(cluster, timeout_s)
            return cluster, servers
        except PortTakenError:
            for server in servers:
                server.stop()
            if attempt == attempts:
                raise
        except BaseException:
            for server in servers:
                server.stop()
            raise
    raise AssertionError("unreachable")


def wait_for_routes(cluster: NatsCluster, timeout_s: float = 15.0) -> None:
    """Block until every member of `cluster` routes to every other (interest then propagates
    across the whole cluster)."""
    deadline = time.monotonic() + timeout_s
    for i in range(len(cluster.ports)):
        while cluster.routes(i) < len(cluster.ports) - 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the NATS cluster's routes did not form within {timeout_s}s")
            time.sleep(0.05)


ROUTES_FILE = "nats-routes.conf"


def main(argv: list[str] | None = None) -> int:
    """`python -m services.launch.nats_cluster DIR --routes nats:6222,nats-1:6222,...`: write
    DIR/nats-routes.conf (mode 0600), the `cluster {}` block every member of a compose or
    other multi-host cluster includes: a fresh route password and the routes to every
    member (each member's own listen address comes from its `--cluster` flag)."""
    parser = argparse.ArgumentParser(
        prog="python -m services.launch.nats_cluster", description=main.__doc__
    )
    parser.add_argument("dir", type=Path, help="where to write nats-routes.conf")
    parser.add_argument(
        "--routes",
        required=True,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="every member's route listener, comma-separated",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing file")
    args = parser.parse_args(argv)
    path = args.dir / ROUTES_FILE
    if path.exists() and not args.force:
        print(f"error: {path} exists (--force replaces it)", file=sys.stderr)
        return 1
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    if len(routes) < 2:
        print("error: --routes: a cluster has at least 2 members", file=sys.stderr)
        return 2
    try:
        block = cluster_block(Credentials(ROUTE_USER, secrets.token_urlsafe(32)), routes)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_private(path, block)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
