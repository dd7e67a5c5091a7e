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

    `options` go to `nats.connect` (error_cb, disconnected_cb, reconnected_cb, ...).
    """

    def next_server(servers: list[Server], _info: dict[str, Any]) -> tuple[None, float]:
        tries = max((s.reconnects for s in servers), default=0)
        return None, backoff.delay(tries)

    if tls_ca_file is not None:
        tls_context(tls_ca_file)  # a bad file is an error now, not a retry forever
    await wait_for_server(url, backoff, log)
    return await open_nats(
        server_list(url),
        credentials=credentials,
        tls_ca_file=tls_ca_file,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_to_server_handler=next_server,
        **options,
    )
