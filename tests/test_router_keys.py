"""API keys (issue 20, finding 7): an admin key of its own for the admin endpoints, probes
optionally behind a key, tenant key files, and loud warnings for a key on a command line
and for a router open beyond loopback. Real NATS and Redis, fake engines, real HTTP; the
warnings from real `python -m router` and `hicache-mesh up` processes."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_engine import running_mesh

from router.__main__ import build_parser, config_from_args
from services.launch.servers import ServerProcess, free_port

API, ADMIN = {"Authorization": "Bearer user-key"}, {"Authorization": "Bearer admin-key"}


async def _codes(mesh: object, headers: dict[str, str]) -> dict[str, int]:
    c = mesh.client  # type: ignore[attr-defined]
    gen = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=headers)
    return {
        "generate": gen.status,
        "models": (await c.get("/v1/models", headers=headers)).status,
        "flush": (await c.post("/flush_cache", headers=headers)).status,
        "stats": (await c.get("/stats", headers=headers)).status,
        "health": (await c.get("/health", headers=headers)).status,
        "ready": (await c.get("/ready", headers=headers)).status,
        "metrics": (await c.get("/metrics", headers=headers)).status,
    }


async def test_admin_endpoints_need_the_admin_key(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    async with running_mesh(
        nats_server.url, redis_server.url, 1, api_key="user-key", admin_api_key="admin-key"
    ) as mesh:
        assert await _codes(mesh, {}) == {
            "generate": 401,
            "models": 401,
            "flush": 401,
            "stats": 401,
            "health": 200,
            "ready": 200,
            "metrics": 200,
        }
        user = await _codes(mesh, API)
        assert (user["generate"], user["models"], user["flush"], user["stats"]) == (
            200,
            200,
            403,
            403,
        )
        r = await mesh.client.post("/flush_cache", headers=API)
        assert (await r.json())["error"]["code"] == "permission_denied"
        admin = await _codes(mesh, ADMIN)  # the admin key opens everything
        assert set(admin.values()) == {200}, admin
        assert mesh.engines[0].flushes == 1  # only the admin's flush reached the engine


async def test_an_admin_key_alone_leaves_the_api_open_and_guards_the_admin_endpoints(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    async with running_mesh(
        nats_server.url, redis_server.url, 1, admin_api_key="admin-key"
    ) as mesh:
        anyone = await _codes(mesh, {})
        assert (anyone["generate"], anyone["flush"], anyone["stats"]) == (200, 401, 401)
        assert (await mesh.client.post("/flush_cache", headers=ADMIN)).status == 200


@pytest.mark.parametrize(
    ("probe_auth", "closed"), [("metrics", {"metrics"}), ("all", {"metrics", "health", "ready"})]
)
async def test_probes_can_be_put_behind_a_key(
    nats_server: ServerProcess, redis_server: ServerProcess, probe_auth: str, closed: set[str]
) -> None:
    async with running_mesh(
        nats_server.url,
        redis_server.url,
        1,
        api_key="user-key",
        admin_api_key="admin-key",
        probe_auth=probe_auth,
    ) as mesh:
        anyone = await _codes(mesh, {})
        for probe in ("metrics", "health", "ready"):
            assert anyone[probe] == (401 if probe in closed else 200), (probe, anyone)
        user = await _codes(mesh, API)
        assert user["metrics"] == 403  # operator data: the admin key's
        assert (user["health"], user["ready"]) == (200, 200)
        admin = await _codes(mesh, ADMIN)
        assert (admin["metrics"], admin["health"], admin["ready"]) == (200, 200, 200)


def test_tenant_key_files_are_checked(tmp_path: Path) -> None:
    from router.auth import load_tenant_keys

    good = tmp_path / "tenants"
    good.write_text("# key tenant [shared=...]\n\nka alice shared=docs,team\nkb bob\n")
    keys = load_tenant_keys(good)
    assert [(k.tenant, k.shared) for k in keys] == [("alice", ("docs", "team")), ("bob", ())]
    assert "ka" not in repr(keys)  # a config that gets logged never shows a key
    for text, why in [
        ("ka alice\nka bob\n", "line 2: this key is already on an earlier line"),
        ("ka\n", "line 1: expected 'KEY TENANT [shared=NS,...]'"),
        ("ka alice docs\n", "line 1: expected"),
        ("ka al/ice\n", "line 1: tenant and namespace names"),
        ("# nothing\n", "no keys"),
    ]:
        bad = tmp_path / "bad"
        bad.write_text(text)
        with pytest.raises(ValueError, match=re.escape(why)):
            load_tenant_keys(bad)
    args = build_parser().parse_args(["--tenant-keys", str(good), "--hide-cache-stats"])
    config = config_from_args(args, [])
    assert [k.tenant for k in config.tenant_keys] == ["alice", "bob"]
    assert config.hide_cache_stats is True


def _router_stderr(argv: list[str], env: dict[str, str] | None = None) -> str:
    """The first seconds of a real router's log: it waits for a NATS that is not there."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "router", "--nats-url", f"nats://127.0.0.1:{free_port()}", *argv],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env=os.environ | (env or {}),
        text=True,
    )
    assert proc.stderr is not None
    lines = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until startup waits for NATS
            line = proc.stderr.readline()
            lines.append(line)
            if not line or "unreachable" in line:
                break
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=30)
    finally:
        proc.kill()
    return "".join(lines) + rest


def test_the_router_warns_of_a_key_on_its_command_line_and_of_an_open_bind(
    tmp_path: Path,
) -> None:
    port = str(free_port())
    err = _router_stderr(["--host", "0.0.0.0", "--port", port])
    assert "the router listens on 0.0.0.0, beyond loopback, and asks for no API key" in err
    assert "--api-key on the command line" not in err
    err = _router_stderr(["--host", "0.0.0.0", "--port", port, "--api-key", "k1"])
    assert "--api-key on the command line shows in `ps`" in err and "deprecated" in err
    assert "beyond loopback" not in err
    key = tmp_path / "key"
    key.write_text("k2\n")
    quiet = _router_stderr(["--host", "0.0.0.0", "--port", port, "--api-key-file", str(key)])
    quiet += _router_stderr(["--port", port], env={"HICACHE_ROUTER_API_KEY": "k3"})
    quiet += _router_stderr(["--host", "127.0.0.1", "--port", port])
    assert "WARNING router:" not in quiet, quiet


def test_up_warns_of_a_key_on_its_command_line() -> None:
    """`up --api-key K` puts K in up's own command line: warned before anything starts (here
    `up` stops at once: its port is taken)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        argv = [sys.executable, "-m", "services.cli", "up", "--port", port, "--model", "tiny"]
        out = subprocess.run([*argv, "--api-key", "k1"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "is not available" in out.stderr
        assert "--api-key on the command line shows in `ps`" in out.stderr
        env = os.environ | {"HICACHE_ROUTER_API_KEY": "k1"}
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 1 and "--api-key on the command line" not in out.stderr


async def test_tenant_keys_derive_the_salt_and_guard_shared_namespaces(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    """Each tenant's requests reach the engine under a salt of its own (whatever salt the
    client sends), a shared namespace only for the tenants allowed it (403 otherwise)."""
    from router.auth import TenantKey, shared_salt, tenant_salt

    tenants = (TenantKey("ka", "alice", ("team",)), TenantKey("kb", "bob"))
    async with running_mesh(
        nats_server.url,
        redis_server.url,
        1,
        api_key="user-key",
        tenant_keys=tenants,
        shared_cache_namespaces=("public",),
    ) as mesh:
        c, engine = mesh.client, mesh.engines[0]

        async def salt(key: str, **extra: object) -> str:
            body = {"prompt": "hi", "max_tokens": 1} | extra
            r = await c.post(
                "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            )
            assert r.status == 200, await r.text()
            return engine.received[-1].cache_salt

        alice, bob, plain = await salt("ka"), await salt("kb"), await salt("user-key")
        assert len({alice, bob, plain}) == 3 and "" not in {alice, bob, plain}
        assert alice == await salt("ka") == tenant_salt("alice", "")
        assert await salt("ka", user="x") == await salt("ka", cache_salt="x") != alice
        # a client salt equal to another tenant's derived salt is salted again
        assert await salt("kb", cache_salt=alice) != alice
        shared = await salt("ka", cache_namespace="team")
        assert shared == shared_salt("team", "") and shared not in (alice, bob)
        assert await salt("kb", cache_namespace="public") == await salt(
            "ka", cache_namespace="public"
        )
        num_sent = len(engine.received)
        for key, ns in (("kb", "team"), ("user-key", "team"), ("ka", "other")):
            r = await c.post(
                "/v1/completions",
                json={"prompt": "hi", "cache_namespace": ns},
                headers={"Authorization": f"Bearer {key}"},
            )
            assert r.status == 403 and (await r.json())["error"]["param"] == "cache_namespace"
        r = await c.post("/generate", json={"text": "hi", "cache_namespace": 5}, headers=API)
        assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_type"
        assert (await c.post("/v1/completions", json={"prompt": "hi"}, headers=ADMIN)).status == 401
        assert len(engine.received) == num_sent  # nothing refused reached the engine


async def test_cache_namespace_without_tenants_is_a_clear_400(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    async with running_mesh(nats_server.url, redis_server.url, 1) as mesh:
        r = await mesh.client.post("/v1/completions", json={"prompt": "hi", "cache_namespace": "x"})
        body = await r.json()
        assert r.status == 400 and body["error"]["code"] == "cache_namespace_unavailable"
        assert mesh.engines[0].received == []


async def test_bench_and_replay_flush_with_the_admin_key_file(
    nats_server: ServerProcess,
    redis_server: ServerProcess,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`bench`/`replay --admin-api-key-file` flush a router that has an admin key; the
    ordinary key alone is refused (403) and said so, and the engine is not flushed."""
    import argparse
    import asyncio

    from services.bench.cli import admin_key, flush_cache

    key_file = tmp_path / "admin"
    key_file.write_text("admin-key\n")
    async with running_mesh(
        nats_server.url, redis_server.url, 1, api_key="user-key", admin_api_key="admin-key"
    ) as mesh:
        url = str(mesh.client.make_url("")).rstrip("/")
        await asyncio.to_thread(flush_cache, url, admin_key(None) or "user-key")
        assert "answered 403" in capsys.readouterr().err
        assert mesh.engines[0].flushes == 0
        await asyncio.to_thread(flush_cache, url, admin_key(str(key_file)) or "user-key")
        assert capsys.readouterr().err == ""
        assert mesh.engines[0].flushes == 1
        started = argparse.Namespace(admin_api_key_file=str(key_file))  # a mesh bench started
        await asyncio.to_thread(flush_cache, url, admin_key(None, started))
        assert mesh.engines[0].flushes == 2
