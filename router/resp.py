"""The router's Redis client: one pipelined connection for PING, SCRIPT LOAD and EVALSHA.

The prefix lookup is one Redis round trip per request, on the router's hot path. redis-py's
asyncio client spends more than the round trip itself on it (a pool checkout, retry and
observability wrappers, a line-by-line RESP3 parser): 290 us per lookup against 95 us for
the same bytes on a bare connection, on the two-core benchmark machine with the router's
1 ms between lookups (see BENCHMARKS.md, "Router added latency"). This client does only what
the index needs:

- one connection, opened on first use; each command is one `write`, and replies are matched
  to commands in order (Redis answers in request order), so concurrent requests pipeline;
- a caller that stops waiting (the lookup budget cancels it) leaves its command in place: its
  reply is dropped when it comes, and the connection stays in step;
- a connection whose oldest reply is `reply_timeout_s` overdue is closed before the next
  command (those replies are not coming); a lost connection fails every command waiting on
  it with `ConnectionError`, and the next command connects again within `connect_timeout_s`.

Errors: `ConnectionError` (an `OSError`) when Redis cannot be reached or the connection is
lost, `RedisError` for an error reply (`NoScriptError` for NOSCRIPT). URLs:
`redis://[[user]:password@]host[:port][/db]`, `rediss://` (TLS), `unix:///path[?db=N]`;
`credentials` (the router's Redis user, from a 0600 file) override the URL's. TLS: a
`rediss://` URL verifies the server against the system's CAs; `tls_ca_file` (PEM) turns TLS
on whatever the scheme and verifies the server's certificate and host name against it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlsplit

from bus_schemas.connection import Credentials, tls_context

DEFAULT_PORT = 6379
CRLF = b"\r\n"


class RedisError(Exception):
    """An error reply from Redis."""


class NoScriptError(RedisError):
    """EVALSHA of a script Redis does not hold (SCRIPT LOAD it, then retry)."""


@dataclass(frozen=True, slots=True)
class RedisAddress:
    """Where and how to connect, parsed from a URL by `parse_url`."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    unix_path: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False


def parse_url(url: str) -> RedisAddress:
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    db = int(query["db"][0]) if "db" in query else 0
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password else None
    if parts.scheme == "unix":
        return RedisAddress(unix_path=parts.path, db=db, username=username, password=password)
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"unsupported Redis URL scheme {parts.scheme!r} in {url!r}")
    path = parts.path.strip("/")
    return RedisAddress(
        host=parts.hostname or "127.0.0.1",
        port=parts.port or DEFAULT_PORT,
        db=int(path) if path else db,
        username=username,
        password=password,
        tls=parts.scheme == "rediss",
    )


def encode_command(args: tuple[str | bytes, ...]) -> bytes:
    """A RESP array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg.encode() if isinstance(arg, str) else arg
        out.append(b"$%d\r\n" % len(data))
        out.append(data)
        out.append(CRLF)
    return b"".join(out)


def parse_reply(buf: bytes | bytearray, pos: int) -> tuple[Any, int] | None:
    """One RESP2 reply starting at `pos`: (value, the position after it), or None while it
    is incomplete. Bulk strings decode as UTF-8 `str`; an error reply is a `RedisError`
    value (raised by the caller, so a bad element does not desynchronise the stream)."""
    end = buf.find(CRLF, pos)
    if end < 0:
        return None
    kind, line = buf[pos : pos + 1], bytes(buf[pos + 1 : end])
    after = end + 2
    if kind == b"$":
        n = int(line)
        if n < 0:
            return None, after
        if len(buf) < after + n + 2:
            return None
        return bytes(buf[after : after + n]).decode(), after + n + 2
    if kind == b":":
        return int(line), after
    if kind == b"*":
        n = int(line)
        if n < 0:
            return None, after
        items = []
        for _ in range(n):
            parsed = parse_reply(buf, after)
            if parsed is None:
                return None
            item, after = parsed
            items.append(item)
        return items, after
    if kind == b"+":
        return line.decode(), after
    if kind == b"-":
        message = line.decode()
        error = NoScriptError if message.startswith("NOSCRIPT") else RedisError
        return error(message), after
    raise ConnectionError(f"unexpected Redis reply type {kind!r}")


class _Connection(asyncio.Protocol):
    """One connection: commands written in order, their futures answered in order."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._buf = bytearray()
        self._waiting: deque[tuple[asyncio.Future[Any], float]] = deque()  # (reply, sent at)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def send(self, data: bytes) -> asyncio.Future[Any]:
        assert self.transport is not None and not self.closed
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append((fut, self.clock()))
        self.transport.write(data)
        return fut

    def usable(self, timeout_s: float) -> bool:
        """Open, and no unanswered command has waited longer than `timeout_s`."""
        if self.closed or self.transport is None or self.transport.is_closing():
            return False
        return not self._waiting or self.clock() - self._waiting[0][1] <= timeout_s

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos = 0
        try:
            while self._waiting and (parsed := parse_reply(buf, pos)) is not None:
                value, pos = parsed
                fut, _ = self._waiting.popleft()
                if fut.done():
                    continue  # its caller gave up
                if isinstance(value, RedisError):
                    fut.set_exception(value)
                else:
                    fut.set_result(value)
        except (ConnectionError, ValueError) as e:
            self.close(ConnectionError(f"bad reply from Redis: {e!r}"))
            return
        del buf[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError(f"connection to Redis lost: {exc!r}"))

    def close(self, reason: Exception) -> None:
        if self.transport is not None:
            self.transport.abort()
        self._fail(reason)

    def _fail(self, reason: Exception) -> None:
        self.closed = True
        while self._waiting:
            fut, _ = self._waiting.popleft()
            if not fut.done():
                fut.set_exception(reason)


def discard(reply: Awaitable[Any]) -> None:
    """Give up a reply from `RespClient.send` that will not be awaited."""
    if isinstance(reply, asyncio.Future):
        reply.cancel()  # its reply is dropped when it comes
    elif isinstance(reply, Coroutine):
        reply.close()  # not sent yet


class RespClient:
    """See the module docstring. `aclose()` when done."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout_s: float = 0.5,
        reply_timeout_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        credentials: Credentials | None = None,
        tls_ca_file: str | None = None,
        resolve: Callable[[], Awaitable[tuple[str, int]]] | None = None,
    ) -> None:
        self.address = parse_url(url)
        # where each new connection goes (Sentinel: the current primary), else the URL's
        self.resolve = resolve
        self.generation = 0  # connections opened so far: a new one may be another server
        self._tls: ssl.SSLContext | None = None
        if tls_ca_file is not None and self.address.unix_path is not None:
            raise ValueError(f"a Redis TLS CA file with a unix socket URL: {url}")
        if tls_ca_file is not None or self.address.tls:  # TLSConfigError for a bad CA file
            self._tls = tls_context(tls_ca_file)
            self.address = dataclasses.replace(self.address, tls=True)
        if credentials is not None:  # AUTH as this user on every (re)connect
            self.address = dataclasses.replace(
                self.address, username=credentials.user, password=credentials.password
            )
        self.connect_timeout_s = connect_timeout_s
        self.reply_timeout_s = reply_timeout_s
        self.clock = clock
        self._conn: _Connection | None = None
        self._connecting = asyncio.Lock()

    async def execute(self, *args: str | bytes) -> Any:
        """Send one command and wait for its reply."""
        conn = self._conn
        if conn is None or not conn.usable(self.reply_timeout_s):
            conn = await self._connected()
        return await conn.send(encode_command(args))

    def send(self, *args: str | bytes) -> Awaitable[Any]:
        """One command's reply, to await later: written now when a usable connection is open
        (the caller works on while Redis answers), else sent once awaited, after connecting.
        Await it, or `discard` it."""
        conn = self._conn
        if conn is not None and conn.usable(self.reply_timeout_s):
            return conn.send(encode_command(args))
        return self.execute(*args)

    async def ping(self) -> None:
        await self.execute("PING")

    async def script_load(self, script: str) -> str:
        sha = await self.execute("SCRIPT", "LOAD", script)
        assert isinstance(sha, str)
        return sha

    async def evalsha(self, sha: str, numkeys: int, *args: str | bytes) -> list[Any]:
        reply = await self.execute("EVALSHA", sha, str(numkeys), *args)
        return reply if isinstance(reply, list) else [reply]

    async def aclose(self) -> None:
        if self._conn is not None:
            self._conn.close(ConnectionError("client closed"))
            self._conn = None

    async def _connected(self) -> _Connection:
        async with self._connecting:
            conn = self._conn
            if conn is not None:
                if conn.usable(self.reply_timeout_s):
                    return conn  # another caller connected meanwhile
                conn.close(ConnectionError("Redis replies overdue: connection closed"))
            self._conn = None
            try:
                async with asyncio.timeout(self.connect_timeout_s):
                    conn = await self._open()
            except TimeoutError:
                raise ConnectionError(
                    f"no connection to Redis within {self.connect_timeout_s:g} s"
                ) from None
            self._conn = conn
            self.generation += 1
            return conn

    async def _open(self) -> _Connection:
        a, loop = self.address, asyncio.get_running_loop()
        conn = _Connection(self.clock)
        if a.unix_path is not None:
            await loop.create_unix_connection(lambda: conn, a.unix_path)
        else:
            host, port = (a.host, a.port) if self.resolve is None else await self.resolve()
            await loop.create_connection(lambda: conn, host, port, ssl=self._tls)
        hello: list[asyncio.Future[Any]] = []
        if a.password is not None:
            auth = (a.username, a.password) if a.username else (a.password,)
            hello.append(conn.send(encode_command(("AUTH", *auth))))
        if a.db:
            hello.append(conn.send(encode_command(("SELECT", str(a.db)))))
        try:
            for reply in hello:
                await reply
        except BaseException:
            with contextlib.suppress(Exception):
                conn.close(ConnectionError("Redis handshake failed"))
            raise
        return conn
