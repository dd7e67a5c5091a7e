"""Slow-client defences of the HTTP front: a connection cap, and read timeouts.

A client that opens connections and trickles bytes costs a file descriptor and buffers per
connection and nothing else; without limits 20,000 of them exhaust the process. Three
limits, one per phase of a request:

- headers: aiohttp's keep-alive timer runs from the moment a connection opens (and again
  after each response) and closes a connection still waiting for a complete request
  header when it fires; `serve_kwargs` sets it to `read_timeout_s`;
- body: `read_body` (called by the handlers' middleware) reads a POST body within
  `read_timeout_s` or answers 408 and closes the connection;
- connections: `GuardedSite` counts open connections; at `max_connections` a new one
  first evicts the oldest connection that is not serving a request (idle, or still reading
  its headers or body: what a slow client holds), and is refused only when every
  connection is serving. So a flood of slow clients never keeps `/health` out.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from router.config import RouterConfig
from router.metrics import RouterMetrics

log = logging.getLogger(__name__)


FD_RESERVE = 256  # descriptors kept for NATS, Redis, logs and the listening socket


def fit_to_fd_limit(max_connections: int) -> int:
    """The connection cap the process can hold: raise the soft descriptor limit toward the
    hard one if needed, and cap below what remains, so the cap, not EMFILE, is what
    refuses the excess (EMFILE would fail /health and Redis too)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError) as e:
            log.warning("could not raise the descriptor limit to %d: %s", new, e)
    if soft == resource.RLIM_INFINITY:
        return max_connections
    fitted = max(2, min(max_connections, soft - FD_RESERVE))
    if fitted < max_connections:
        log.warning(
            "--max-connections %d lowered to %d (descriptor limit)", max_connections, fitted
        )
    return fitted


class ConnectionGuard:
    """Which connections serve a request, and the cap on open connections."""

    def __init__(self, max_connections: int, metrics: RouterMetrics) -> None:
        self.max_connections = max_connections
        self.metrics = metrics
        self._serving: set[Any] = set()  # request handlers; `done` always follows `serving`

    def serving(self, protocol: Any) -> None:
        """`protocol`'s request has its body and is being served: never evicted."""
        if protocol is not None:
            self._serving.add(protocol)

    def done(self, protocol: Any) -> None:
        if protocol is not None:
            self._serving.discard(protocol)

    def protocol(self, server: web.Server) -> asyncio.BaseProtocol:
        """The protocol for a new connection: a request handler, after evicting the oldest
        evictable connection when at the cap; a refusal when none can go."""
        open_ = [h for h in server.connections if _is_open(h)]
        if len(open_) >= self.max_connections:
            victim = next((h for h in open_ if h not in self._serving), None)
            if victim is None:
                self.metrics.connections_closed.labels("refused").inc()
                return _Refused()
            self.metrics.connections_closed.labels("evicted").inc()
            victim.force_close()
        return server()


def _is_open(handler: RequestHandler) -> bool:
    transport = handler.transport
    return transport is not None and not transport.is_closing()


class _Refused(asyncio.Protocol):
    """Closes its connection at once (every open connection is serving a request)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class GuardedSite(web.BaseSite):
    """A TCP site whose connections go through a `ConnectionGuard`."""

    __slots__ = ("_guard", "_host", "_port")

    def __init__(
        self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard
    ) -> None:
        super().__init__(runner, backlog=1024)
        self._host, self._port, self._guard = host, port, guard

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        guard = self._guard
        guard.max_connections = fit_to_fd_limit(guard.max_connections)
        self._server = await asyncio.get_running_loop().create_server(
            lambda: guard.protocol(server),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=True,
        )


GUARD = web.AppKey("connection_guard", ConnectionGuard)


def serve_kwargs(config: RouterConfig) -> dict[str, Any]:
    """AppRunner keyword arguments: the header timeout (aiohttp's keep-alive timer)."""
    return {"keepalive_timeout": config.read_timeout_s}


async def read_body(request: web.Request, timeout_s: float) -> None:
    """Read the whole body (cached by aiohttp for `request.read()`) within `timeout_s`.

    Raises TimeoutError (the connection is closed), or what `request.read()` raises: the
    size limit's HTTPRequestEntityTooLarge, or ConnectionResetError / RequestPayloadError
    when the client left or broke off its upload, or the connection was evicted (aiohttp's
    RuntimeError for a read on a closed connection becomes ConnectionResetError).
    """
    try:
        async with asyncio.timeout(timeout_s):
            await request.read()
    except TimeoutError:
        if request.protocol is not None:
            request.protocol.force_close()
        raise
    except RuntimeError as e:  # aiohttp: "Connection closed." when it closed before the read
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError(str(e)) from None
        raise
