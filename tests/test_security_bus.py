"""Issue 20, finding 1: nobody who merely reaches the bus or the index controls the mesh.

A real mesh (`hicache-mesh up --model tiny`, two colocated engines) and a rogue client: no
credential, a wrong password, one engine's valid credential used to speak for the other
engine or for the router, and the router's Redis credential used to write. Each is refused by
the servers themselves (NATS permissions, Redis ACLs) or, for a forged heartbeat on the
rogue's own subject, by the router and the index; requests still succeed.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
from bus_helpers import barrier, connect_as, credentials_of, redis_url_as
from fault_helpers import MeshSpec, UpMesh, running_mesh
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bus_schemas import Heartbeat, redis_keys, subjects
from bus_schemas.connection import Credentials
from services.launch.credentials import (
    NATS_AUTH_FILE,
    REDIS_ACL_FILE,
    EngineGrant,
    nats_permissions,
)
from services.launch.servers import (
    find_nats_server,
    free_port,
    nats_kind,
    start_server,
    wait_for_port,
)

SPEC = MeshSpec(engines=2, heartbeat_s=0.5)
ROGUE, VICTIM = "engine-1", "engine-0"  # the rogue holds engine-1's valid credential


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpMesh]:
    with running_mesh(SPEC, tmp_path_factory, "security-bus") as m:
        yield m


def nats_creds(mesh: UpMesh, user: str) -> Credentials:
    return credentials_of(mesh.credentials_dir(), "nats", user)


class Rogue:
    """A NATS client that records the server's permission violations."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: NATS | None = None

    async def connect(self, url: str, creds: Credentials) -> Rogue:
        async def on_error(e: Exception) -> None:
            self.errors.append(str(e))

        self.nc = await connect_as(url, creds, error_cb=on_error, allow_reconnect=False)
        return self

    def refused(self, verb: str, subject: str) -> bool:
        want = f'violation for {verb} to "{subject}"'.lower()  # nats.py lowercases them
        return any(want in e.lower() for e in self.errors)


async def _completion(url: str) -> dict[str, object]:
    body = {"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 3, "temperature": 0}
    async with aiohttp.ClientSession() as http, http.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return dict(await r.json())


async def _get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http, http.get(url) as r:
        return r.status, await r.text()


# ------------------------------------------------------------------ files


def test_credentials_are_private_files_and_off_every_command_line(mesh: UpMesh) -> None:
    root = mesh.credentials_dir()
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    files = [p for p in root.rglob("*") if p.is_file()]
    assert {p.relative_to(root).as_posix() for p in files} >= {
        "nats/router",
        "nats/index",
        f"nats/engine.{VICTIM}",
        f"nats/engine.{ROGUE}",
        "redis/router",
        "redis/index",
        NATS_AUTH_FILE,
        REDIS_ACL_FILE,
    }
    for p in files:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    identities = [p for p in files if p.parent.name in ("nats", "redis")]
    passwords = [p.read_text().strip().partition(":")[2] for p in identities]
    assert passwords and all(len(pw) >= 32 for pw in passwords)
    for child in mesh.children():  # `ps` shows paths, never a password
        line = " ".join(child.argv)
        assert not any(pw in line for pw in passwords), child.role
    # each child holds its own files only
    by_role = {c.role: " ".join(c.argv) for c in mesh.children()}
    assert f"engine.{VICTIM}" not in by_role[ROGUE] and "/router" not in by_role[ROGUE]
    assert "redis/index" not in by_role["router"]


# ------------------------------------------------------------------ NATS


async def test_nats_refuses_no_credential_and_a_wrong_password(mesh: UpMesh) -> None:
    url = mesh.nats_url()
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(url, allow_reconnect=False, connect_timeout=5)
    wrong = Credentials(f"engine.{ROGUE}", "not-the-password")
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await connect_as(url, wrong, allow_reconnect=False, connect_timeout=5)


async def test_an_engine_credential_cannot_speak_for_others_or_read_their_work(
    mesh: UpMesh,
) -> None:
    rogue = await Rogue().connect(mesh.nats_url(), nats_creds(mesh, f"engine.{ROGUE}"))
    assert rogue.nc is not None
    forbidden_publish = [
        subjects.heartbeat(VICTIM),  # another engine's
        subjects.kv_events(VICTIM),
        subjects.engine_generate(VICTIM),  # the router's work
        subjects.bucket_generate("default"),
        subjects.engine_prefill(VICTIM),
        subjects.engine_decode_admit(VICTIM),
        subjects.engine_abort(VICTIM),
        subjects.engine_model_card(VICTIM),
        subjects.engine_flush(VICTIM),
        subjects.FLUSH_ALL,
        subjects.engine_snapshot(VICTIM),  # the index's
        subjects.engine_kv(VICTIM),  # P/D frames: only prefill engines send them
        subjects.engine_kv_ack(VICTIM),
        "_INBOX.index.x",
    ]
    forbidden_subscribe = [
        ">",
        subjects.engine_generate(VICTIM),
        subjects.engine_model_card(VICTIM),  # only the victim may answer for its card
        subjects.HEARTBEAT_ALL,
        subjects.KV_EVENTS_ALL,
        "_INBOX.router.>",  # the router's token streams
    ]
    try:
        for subject in forbidden_publish:
            await rogue.nc.publish(subject, b"{}")
        for subject in forbidden_subscribe:
            await rogue.nc.subscribe(subject)
        await rogue.nc.publish(subjects.heartbeat(ROGUE), b"{}")  # its own: allowed (dropped
        await barrier(rogue.nc)  # as malformed by router and index)
        await asyncio.sleep(0.5)  # the server's -ERR lines come back after the PONGs
    finally:
        await rogue.nc.close()
    missing = [s for s in forbidden_publish if not rogue.refused("publish", s)]
    missing += [f"sub {s}" for s in forbidden_subscribe if not rogue.refused("subscription", s)]
    assert not missing, f"not refused: {missing}; errors: {rogue.errors}"
    assert not rogue.refused("publish", subjects.heartbeat(ROGUE)), rogue.errors


async def test_a_forged_heartbeat_from_a_valid_engine_credential_is_refused(mesh: UpMesh) -> None:
    _, models_before = await _get(f"{mesh.url}/v1/models")
    index = await connect_as(mesh.nats_url(), nats_creds(mesh, "index"))
    got: asyncio.Future[Heartbeat] = asyncio.get_running_loop().create_future()

    async def on(msg: Msg) -> None:
        if not got.done():
            got.set_result(Heartbeat.decode(msg.data))

    await index.subscribe(subjects.heartbeat(ROGUE), cb=on)
    real = await asyncio.wait_for(got, 30)
    await index.close()
    rogue = await Rogue().connect(mesh.nats_url(), nats_creds(mesh, f"engine.{ROGUE}"))
    assert rogue.nc is not None
    try:
        for epoch in range(8):  # a new engine "evil-1", and the victim with another card
            evil = dataclasses.replace(real, engine_id="evil-1", epoch=str(epoch))
            victim = dataclasses.replace(real, engine_id=VICTIM, card_digest="f" * 24)
            for hb in (evil, victim):
                await rogue.nc.publish(subjects.heartbeat(ROGUE), hb.encode())
            await rogue.nc.publish(subjects.heartbeat("evil-1"), evil.encode())  # refused
            await asyncio.sleep(SPEC.heartbeat_s / 2)
        await barrier(rogue.nc)
    finally:
        await rogue.nc.close()
    assert rogue.refused("publish", subjects.heartbeat("evil-1")), rogue.errors
    status, health = await _get(f"{mesh.url}/health")
    assert status == 200 and "evil-1" not in health, health
    _, metrics = await _get(f"{mesh.url}/metrics")
    forged = [
        line
        for line in metrics.splitlines()
        if line.startswith("hicache_router_bus_errors_total") and "forged_heartbeat" in line
    ]
    assert forged and float(forged[0].split()[-1]) >= 16, forged
    assert "f" * 24 not in metrics  # the victim's card digest was not replaced
    _, models_after = await _get(f"{mesh.url}/v1/models")
    assert models_after == models_before
    r = aioredis.Redis.from_url(mesh.redis_url(), decode_responses=True)
    try:
        assert "evil-1" not in await r.smembers(redis_keys.ENGINES)
        assert await r.get(redis_keys.engine_alive("evil-1")) is None
    finally:
        await r.aclose()
    answer = await _completion(mesh.url)  # still served, by a real engine
    assert answer["choices"]


# ------------------------------------------------------------------ Redis


async def test_redis_refuses_no_credential_and_a_wrong_password(mesh: UpMesh) -> None:
    url = mesh.plain_redis_url()
    for plain in (url, redis_url_as(url, Credentials("index", "x"))):
        r = aioredis.Redis.from_url(plain)
        try:
            with pytest.raises(redis.exceptions.RedisError, match=r"(?i)auth|password"):
                await r.get(redis_keys.ENGINES)
        finally:
            await r.aclose()


async def test_the_router_credential_reads_the_index_but_cannot_write_it(mesh: UpMesh) -> None:
    index = aioredis.Redis.from_url(mesh.redis_url(), decode_responses=True)
    router_creds = credentials_of(mesh.credentials_dir(), "redis", "router")
    url = redis_url_as(mesh.plain_redis_url(), router_creds)
    router = aioredis.Redis.from_url(url, decode_responses=True)
    try:
        engines = await index.smembers(redis_keys.ENGINES)
        assert engines >= {VICTIM, ROGUE}
        writes = [
            ("SET", "hc:engines", "x"),
            ("DEL", redis_keys.ENGINES),
            ("SREM", redis_keys.ENGINES, VICTIM),
            ("SET", "elsewhere", "x"),
            ("EVAL", f"return redis.call('DEL', '{redis_keys.ENGINES}')", "0"),
            ("FLUSHALL",),
            ("CONFIG", "SET", "appendonly", "yes"),
        ]
        for cmd in writes:
            with pytest.raises(redis.exceptions.ResponseError, match=r"(?i)permission"):
                await router.execute_command(*cmd)
        # a script it may load runs with its rights: reads, never writes
        sha = await router.script_load(f"return redis.call('DEL', '{redis_keys.ENGINES}')")
        with pytest.raises(redis.exceptions.ResponseError, match=r"(?i)can't run|permission"):
            await router.evalsha(sha, 0)
        lookup = await router.script_load(redis_keys.PREFIX_LOOKUP_LUA)
        assert await router.evalsha(lookup, 0, *redis_keys.lookup_argv(["0" * 32])) == []
        assert await index.smembers(redis_keys.ENGINES) == engines
    finally:
        await router.aclose()
        await index.aclose()


# ------------------------------------------------------------------ roles and the generator


def test_p_d_permissions_are_exactly_what_the_transfer_needs() -> None:
    pre = nats_permissions("engine.p", EngineGrant("p", "b", "prefill"))
    dec = nats_permissions("engine.d", EngineGrant("d", "b", "decode"))
    col = nats_permissions("engine.c", EngineGrant("c", "b"))
    assert subjects.engine_kv("*") in pre.publish and subjects.engine_kv_ack("*") not in pre.publish
    assert subjects.engine_kv_ack("*") in dec.publish and subjects.engine_kv("*") not in dec.publish
    assert not {subjects.engine_kv("*"), subjects.engine_kv_ack("*")} & set(col.publish)
    assert subjects.bucket_generate("b") in col.subscribe  # queue group of its bucket
    assert subjects.bucket_generate("b") not in pre.subscribe + dec.subscribe


async def test_the_generator_writes_private_files_a_nats_server_enforces(tmp_path: Path) -> None:
    out = tmp_path / "creds"
    argv = [sys.executable, "-m", "services.cli", "credentials", str(out)]
    run = subprocess.run([*argv, "--engines", "a,b:big:decode"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    again = subprocess.run([*argv, "--engines", "a"], capture_output=True, text=True)
    assert again.returncode == 2 and "--force" in again.stderr  # no silent overwrite
    for p in out.rglob("*"):
        assert stat.S_IMODE(p.stat().st_mode) == (0o700 if p.is_dir() else 0o600), p
    server = start_server(nats_kind(authorization=(out / NATS_AUTH_FILE).read_text()))
    try:
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(server.url, allow_reconnect=False, connect_timeout=5)
        rogue = await Rogue().connect(server.url, credentials_of(out, "nats", "engine.b"))
        assert rogue.nc is not None
        await rogue.nc.publish(subjects.engine_generate("a"), b"{}")
        await rogue.nc.publish(subjects.engine_kv_ack("a"), b"{}")  # a decode engine's
        await barrier(rogue.nc)
        await asyncio.sleep(0.3)
        await rogue.nc.close()
        assert rogue.refused("publish", subjects.engine_generate("a"))
        assert not rogue.refused("publish", subjects.engine_kv_ack("a"))
    finally:
        server.stop()


COMPOSE = Path(__file__).resolve().parents[1] / "compose"


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.pd.yml",
                                  "docker-compose.buckets.yml"])  # fmt: skip
def test_compose_hands_each_service_its_own_generated_secrets(name: str, tmp_path: Path) -> None:
    """The generator command a compose file names makes every secret file it mounts, and
    each service reads only the secrets it is given (its credential flags point there)."""
    import re

    import yaml

    text = (COMPOSE / name).read_text()
    engines = re.search(r"hicache-mesh credentials compose/credentials --engines (\S+)`", text)
    assert engines, "the file names the command that makes its credentials"
    argv = [sys.executable, "-m", "services.cli", "credentials", str(tmp_path / "c")]
    subprocess.run([*argv, "--engines", engines.group(1)], check=True, capture_output=True)
    doc = yaml.safe_load(text)
    for secret, spec in doc["secrets"].items():
        path = spec["file"].replace("${HICACHE_CREDENTIALS:-./credentials}", str(tmp_path / "c"))
        assert Path(path).is_file(), (secret, path)
    for svc, spec in doc["services"].items():
        given = {s if isinstance(s, str) else s["source"] for s in spec.get("secrets", [])}
        command = " ".join(spec.get("command", []) + spec["healthcheck"]["test"])
        used = set(re.findall(r"/run/secrets/([\w.-]+)", command))
        assert used <= given, (svc, used - given)
        if svc not in ("nats", "redis"):
            assert any(u.startswith("nats-") for u in used), f"{svc} connects without a user"
    nats_svc = doc["services"]["nats"]
    assert {"source": "nats-auth", "target": "/etc/nats/auth.conf"} in nats_svc["secrets"]


async def test_compose_nats_conf_includes_the_generated_users(tmp_path: Path) -> None:
    out = tmp_path / "c"
    argv = [sys.executable, "-m", "services.cli", "credentials", str(out), "--engines", "e"]
    subprocess.run(argv, check=True, capture_output=True)
    conf = tmp_path / "etc"
    conf.mkdir()
    (conf / "nats.conf").write_text((COMPOSE / "nats.conf").read_text())
    (conf / "auth.conf").write_text((out / NATS_AUTH_FILE).read_text())
    port = free_port()
    proc = subprocess.Popen(
        [find_nats_server(), "-c", str(conf / "nats.conf"), "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, proc)
        url = f"nats://127.0.0.1:{port}"
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(url, allow_reconnect=False, connect_timeout=5)
        nc = await connect_as(url, credentials_of(out, "nats", "router"), allow_reconnect=False)
        assert nc.max_payload == 8 * 1024 * 1024  # nats.conf's own settings still apply
        await nc.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_engine_health_probe_answers_with_the_engines_own_credential(mesh: UpMesh) -> None:
    creds = mesh.credentials_dir() / "nats" / f"engine.{VICTIM}"
    probe = [sys.executable, "-m", "services.healthcheck", "--timeout", "5", "engine"]
    ok = subprocess.run(
        [*probe, "--nats-credentials", str(creds), mesh.nats_url(), VICTIM],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    anonymous = subprocess.run(
        [*probe, mesh.nats_url(), VICTIM], capture_output=True, text=True, timeout=60
    )
    assert anonymous.returncode == 1 and "Authorization" in anonymous.stderr


def test_reply_subjects_cannot_be_guessed_from_another() -> None:
    """Engines may publish into the router's inbox: a request's reply subject must not tell
    them the subjects of other requests (a counter alone would)."""
    from nats.aio.client import Client

    from router.reply_hub import ReplyHub

    hub = ReplyHub(Client())
    (a, _), (b, _) = hub.open(), hub.open()
    prefix = a.rsplit(".", 1)[0]
    assert b.startswith(prefix + ".") and b != f"{prefix}.2"
    assert len(b.rsplit(".", 1)[1]) >= 16  # 64 random bits beside the counter


def test_up_hands_children_the_files_of_a_given_credentials_dir(tmp_path: Path) -> None:
    from services.cli import build_parser
    from services.launch.up import Mesh

    out = tmp_path / "c"
    argv = [sys.executable, "-m", "services.cli", "credentials", str(out), "--engines"]
    subprocess.run([*argv, "prefill-0:default:prefill"], check=True, capture_output=True)
    up = ["up", "--model", "tiny", "--pd", "--credentials-dir", str(out)]
    with pytest.raises(ValueError, match=r"engine\.decode-0"):  # decode-0 was not admitted
        Mesh(build_parser().parse_args(up))
    grants = "prefill-0:default:prefill,decode-0:default:decode"
    subprocess.run([*argv, grants, "--force"], check=True, capture_output=True)
    mesh = Mesh(build_parser().parse_args(up))
    try:
        router = mesh.router_argv("nats://x:4222", "redis://x:6379/0")
        assert router[router.index("--nats-credentials") + 1] == str(out.resolve() / "nats/router")
        assert router[router.index("--redis-credentials") + 1] == str(
            out.resolve() / "redis/router"
        )
        assert mesh.creds.nats["router"] == credentials_of(out, "nats", "router")
    finally:
        mesh.workdir.cleanup()
