"""The one NATS connection helper of the mesh (router and services alike): credentials, a
server list, and one connection policy for a long-running process: wait for a server with
backoff, then connect with reconnects forever, also with backoff.

Why: a supervisor may start processes in any order, so a process must START while NATS is
not up yet, and keep running (answering SIGTERM) while it is gone. nats.py retries a failed
first connect at a fixed pace and cannot be told to stop short of cancelling it; here each
failed attempt logs one line and waits `Backoff.delay(attempt)`. The caller cancels the
coroutine (e.g. on SIGTERM) to give up.

Credentials (DESIGN.md 7b): one identity per role, read from a file of mode 0600 holding
`user:password` on one line (`read_credentials`), never from a command line. An identity's
request inboxes live under `_INBOX.{user}` (`inbox_prefix`), so the server can let each
identity subscribe to its own replies only. Redis users' files have the same format (the
router and the index read theirs with `read_credentials` too). `url` may list several
servers, comma-separated (a NATS cluster).

TLS (deployments across hosts): given a CA file (`tls_ca_file`, PEM), a client connects
over TLS only, verifying the server's certificate and host name against that CA. nats-py
would send its CONNECT (with the password) in clear to a server that does not ask for TLS,
whatever the URL's scheme: `TLSOnlyClient` refuses such a server before that.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import ssl
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.client import Server

DEFAULT_INBOX = "_INBOX"


@dataclass(frozen=True, slots=True)
class Credentials:
    """A user and its password (never printed: `repr` hides it)."""

    user: str
    password: str = field(repr=False)

    def __post_init__(self) -> None:
        if not self.user or ":" in self.user or any(c.isspace() for c in self.user):
            raise ValueError(f"bad credential user name {self.user!r}")
        if not self.password or "\n" in self.password:
            raise ValueError(f"credentials of {self.user!r}: empty or multi-line password")


class CredentialsError(ValueError):
    """A credentials file that cannot be used (missing, readable by others, malformed)."""


def read_credentials(path: str | os.PathLike[str]) -> Credentials:
    """The `user:password` in `path`; the file must be readable by its owner only (mode
    0600 or stricter), as ssh insists for keys."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
        text = p.read_text()
    except OSError as e:
        raise CredentialsError(f"credentials file {p}: {e.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CredentialsError(
            f"credentials file {p} is mode {stat.S_IMODE(mode):04o}: others may read it "
            "(chmod 600 it)"
        )
    user, sep, password = text.strip("\r\n").partition(":")
    if not sep:
        raise CredentialsError(f"credentials file {p}: expected one line `user:password`")
    try:
        return Credentials(user, password)
    except ValueError as e:
        raise CredentialsError(f"credentials file {p}: {e}") from None


def write_credentials(path: str | os.PathLike[str], credentials: Credentials) -> None:
    """Write `credentials` to `path`, created (or truncated) with mode 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode on O_CREAT
    with os.fdopen(fd, "w") as f:
        f.write(f"{credentials.user}:{credentials.password}\n")


class TLSConfigError(ValueError):
    """A CA file that cannot be used (missing, not PEM)."""


def tls_context(ca_file: str | os.PathLike[str] | None) -> ssl.SSLContext:
    """A client context that verifies the server's certificate chain and host name against
    the CAs in `ca_file` (None: the system's), TLS 1.2 or newer."""
    try:
        ctx = ssl.create_default_context(cafile=None if ca_file is None else os.fspath(ca_file))
    except (OSError, ssl.SSLError) as e:
        raise TLSConfigError(f"TLS CA file {ca_file}: {e}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def tls_ca_file(path: str | None) -> str | None:
    """`path` as given by a `--*-tls-ca-file` flag, checked to be a usable CA file (raises
    TLSConfigError, a ValueError, naming it)."""
    if path is not None:
        tls_context(path)
    return path


def add_tls_args(parser: argparse.ArgumentParser, redis: bool = False) -> None:
    """The client TLS flags every process on the bus takes (`redis`: and Redis's)."""
    parser.add_argument(
        "--nats-tls-ca-file",
        default=None,
        metavar="PEM",
        help="the CA that signed the NATS server's certificate: connect over TLS only, "
        "verifying the server's certificate and host name against it (across hosts)",
    )
    if redis:
        parser.add_argument(
            "--redis-tls-ca-file",
            default=None,
            metavar="PEM",
            help="the same for Redis (TLS whatever the URL's scheme; a rediss:// URL alone "
            "verifies against the system's CAs)",
        )


class TLSOnlyClient(NATS):
    """A NATS client that refuses, before sending CONNECT, a server whose INFO does not
    require TLS (a plaintext server, or someone posing as one, would read the password)."""

    async def _process_info(self, info: dict[str, Any], initial_connection: bool = False) -> None:
        if initial_connection and not info.get("tls_required"):
            raise nats.errors.Error(
                "nats: TLS is configured but the server does not require it: "
                "not connecting in clear"
            )
        await super()._process_info(info, initial_connection)


async def open_nats(
    servers: list[str],
    *,
    credentials: Credentials | None = None,
    tls_ca_file: str | os.PathLike[str] | None = None,
    **options: Any,
) -> NATS:
    """`nats.connect` as `credentials`' user (replies under `inbox_prefix`), over TLS
    verified against `tls_ca_file` when given."""
    if credentials is not None:
        options.update(user=credentials.user, password=credentials.password)
    nc = NATS()
    if tls_ca_file is not None:
        options["tls"] = tls_context(tls_ca_file)
        nc = TLSOnlyClient()
    await nc.connect(servers, inbox_prefix=inbox_prefix(credentials), **options)
    return nc


def inbox_prefix(credentials: Credentials | None) -> str:
    """Where an identity's request replies go: `_INBOX.{user}` (plain `_INBOX` without one)."""
    return DEFAULT_INBOX if credentials is None else f"{DEFAULT_INBOX}.{credentials.user}"


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential: `initial_s` doubling up to `max_s`."""

    initial_s: float = 0.1
    max_s: float = 1.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait before attempt `attempt` (0-based) after a failure."""
        return float(min(self.max_s, self.initial_s * 2 ** min(attempt, 30)))


def server_list(url: str) -> list[str]:
    """`nats://a:4222,nats://b:4222` -> its servers (a NATS cluster: any one will do)."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise ValueError(f"no NATS server in {url!r}")
    return servers


class NatsUrls(argparse.Action):
    """`--nats-url`: one server, a comma-separated list, or the flag repeated (a NATS
    cluster); the value is the comma-separated list of every server given, in order (the
    first given replaces the default)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        try:
            given = server_list(str(values))
        except ValueError as e:
            parser.error(f"{option_string}: {e}")
        current = getattr(namespace, self.dest, None)
        earlier = [] if current is None or current is self.default else server_list(current)
        setattr(namespace, self.dest, ",".join(earlier + given))


def add_nats_url_arg(parser: argparse.ArgumentParser, default: str | None, help: str = "") -> None:
    """The `--nats-url` flag every process on the bus takes (`NatsUrls`)."""
    parser.add_argument(
        "--nats-url",
        action=NatsUrls,
        default=default,
        metavar="URL[,URL...]",
        help=help
        or "the NATS server, or the servers of a NATS cluster: comma-separated or the flag "
        "repeated; connects to the first that answers, fails over to the others in order",
    )


async def wait_for_server(url: str, backoff: Backoff, log: logging.Logger) -> None:
    """Return once a TCP connect to one of `url`'s servers succeeds; one log line per failed
    round."""
    attempt = 0
    while True:
        errors = []
        for server in server_list(url):
            parsed = urlparse(server)
            host, port = parsed.hostname or "127.0.0.1", parsed.port or 4222
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 2.0)
            except (OSError, TimeoutError) as e:
                errors.append(type(e).__name__)
                continue
            writer.close()
            return
        delay = backoff.delay(attempt)
        log.warning(
            "NATS at %s unreachable (%s); attempt %d, next attempt in %.1fs",
            url,
            ", ".join(errors),
            attempt + 1,
            delay,
        )
        attempt += 1
        await asyncio.sleep(delay)


async def connect_nats(
    url: str,
    *,
    name: str,
    log: logging.Logger,
    credentials: Credentials | None = None,
    tls_ca_file: str | os.PathLike[str] | None = None,
    backoff: Backoff = Backoff(),
    **options: Any,
) -> NATS:
    """A client that reconnects forever (delay `backoff.delay(n)` before the n-th retry),
    as `credentials`' user when given, with its replies under `inbox_prefix(credentials)`,
    over TLS verified against `tls_ca_file` when given (raises TLSConfigError at once for a
    CA file that cannot be read).

    A cluster (`url` lists several servers): the client connects to the first server that
    answers, in the order given (no shuffle: a mesh whose processes share one server keeps
    its traffic off the routes; an operator spreads load by listing servers in another order
    per process), and on losing it fails over at once to the next one (`next_server`).

    `options` go to `nats.connect` (error_cb, disconnected_cb, reconnected_cb, ...).
    """
    nc: NATS | None = None
    last = ""  # the server connected to last (netloc): during a reconnect, the one lost
    callback = options.pop("reconnected_cb", None)

    def remember() -> None:
        nonlocal last
        if nc is not None and nc.connected_url is not None:
            last = nc.connected_url.netloc

    async def reconnected() -> None:
        remember()
        if callback is not None:
            await callback()

    if tls_ca_file is not None:
        tls_context(tls_ca_file)  # a bad file is an error now, not a retry forever
    await wait_for_server(url, backoff, log)
    options.setdefault("dont_randomize", True)
    nc = await open_nats(
        server_list(url),
        credentials=credentials,
        tls_ca_file=tls_ca_file,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_to_server_handler=lambda pool, _info: next_server(pool, last, backoff),
        reconnected_cb=reconnected,
        **options,
    )
    remember()
    return nc


def next_server(pool: list[Server], lost: str, backoff: Backoff) -> tuple[Server, float]:
    """The server a reconnect tries next, and the wait before: the one with the fewest failed
    attempts, the server just lost (netloc `lost`) last among equals, then in list order.

    nats.py calls this before every attempt and, given no server, retries the pool's FIRST
    server forever: a client listing a dead server first would never fail over. Here a
    failed attempt counts against its server, so the next attempt goes to another one; a
    server never tried since the loss is tried at once, one already tried after
    `backoff.delay(its failures)` (a single server: as before, 0.1 s, then doubling)."""
    best = min(range(len(pool)), key=lambda i: (pool[i].reconnects, pool[i].uri.netloc == lost, i))
    chosen = pool[best]
    fresh = chosen.reconnects == 0 and chosen.uri.netloc != lost
    return chosen, 0.0 if fresh else backoff.delay(chosen.reconnects)
