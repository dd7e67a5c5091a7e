"""Supervision and NATS outages (issue 7 defects 2, 3, 8, 14), with real processes.

- `Supervisor` restarts a dead child with backoff and a log line, and `stop()` leaves none.
- The router names NATS in its 503 while NATS is down, and serves again (heartbeats and its
  reply inbox re-subscribed) once a nats-server is back on the same port.
- Router and index start while NATS is unreachable, log one line per attempt, and stop on
  SIGTERM without a traceback.
- `hicache-mesh up` refuses a busy port before starting anything; under load it restarts a
  killed engine, index and nats-server, and Ctrl-C leaves no process behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.server
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fake_engine import FakeEngine, running_mesh
from fault_helpers import kill_session

from services.launch import servers, up
from services.launch.readiness import wait_ready
from services.launch.servers import ServerProcess, free_port, start_nats
from services.launch.supervisor import ChildSpec, RestartPolicy, Supervisor

UP = [sys.executable, "-m", "services.cli", "up", "--model", "tiny"]
NO_REDIS = ["--redis-url", "redis://127.0.0.1:1/0"]  # both services start without Redis
SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


@contextlib.contextmanager
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A live child process that does nothing (a server that never binds its port)."""
    proc = subprocess.Popen(SLEEPER)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def listener() -> Iterator[tuple[socket.socket, int]]:
    """A socket listening on a free loopback port that answers nothing by itself."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock, sock.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait(cond: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


# ---------------------------------------------------------------- the supervisor itself


def test_free_port_skips_the_ports_a_mesh_already_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel may give a just-closed port out again: CI once saw `up` start redis on the
    port it was about to give its router (the replay's mesh). A mesh's servers avoid the
    ports it has chosen."""
    given = iter([7001, 7001, 7002])  # the kernel's answers, a repeat among them

    class Socket(socket.socket):
        def bind(self, address: Any) -> None:
            super().bind(("127.0.0.1", 0))

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", next(given))

    monkeypatch.setattr(servers.socket, "socket", Socket)
    chosen = {7001}  # say, the router's
    assert free_port(avoid=chosen) == 7002


def test_up_gives_nats_redis_and_the_router_distinct_ports() -> None:
    parser = argparse.ArgumentParser()
    up.add_up_args(parser)
    ports = iter([7001, 7001, 7002, 7002, 7001, 7003])  # what the kernel hands out

    def kernel(avoid: Collection[int] = ()) -> int:
        return next(p for p in ports if p not in avoid)

    started: list[ChildSpec] = []
    hooks = up.MeshHooks(free_port=kernel, start_child=started.append)
    plan = up.Mesh(parser.parse_args(["--port", "7001"]), hooks)
    try:
        plan.start_server(servers.NATS)
        plan.start_server(servers.REDIS)
        assert [c.port for c in started] == [7002, 7003]
    finally:
        plan.workdir.cleanup()


@pytest.mark.parametrize("kind", [servers.NATS, servers.REDIS], ids=lambda k: k.name)
def test_a_server_started_on_a_taken_port_is_not_taken_for_ready(
    kind: servers.ServerKind, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two launchers (xdist workers, or `up` beside another mesh) can draw the same free
    port. CI once saw the loser's nats-server fail to bind while the winner's answered its
    readiness probe: the test SIGSTOPped a dead process and its "paused" NATS kept serving.
    The probe now asks who answers; a start on a drawn port that turns out taken draws
    another."""
    holder = servers.start_server(kind)
    try:
        with pytest.raises((servers.PortTakenError, RuntimeError)):
            servers.start_server(kind, holder.port)  # an explicit port: no second draw
        drawn = iter([holder.port])
        real_free_port = servers.free_port
        monkeypatch.setattr(servers, "free_port", lambda: next(drawn, None) or real_free_port())
        second = servers.start_server(kind)
        try:
            assert second.port != holder.port and second.alive
            assert holder.alive
            with socket.create_connection(("127.0.0.1", second.port), timeout=5) as conn:
                assert kind.identify(second.workdir.name, second.proc)(conn)  # type: ignore[union-attr]
        finally:
            second.stop()
    finally:
        holder.stop()


def test_the_readiness_probe_names_a_listener_that_is_not_ours(tmp_path: Path) -> None:
    """A live nats-server child whose port is answered by another NATS-speaking listener:
    PortTakenError, not ready (deterministic: the child never binds)."""
    with listener() as (other, port):

        def greet() -> None:
            conn, _ = other.accept()
            conn.sendall(b'INFO {"server_name":"someone-else"}\r\n')
            conn.close()

        with ThreadPoolExecutor(1) as pool, sleeper() as proc:
            pool.submit(greet)
            with pytest.raises(servers.PortTakenError, match=f"127.0.0.1:{port}"):
                servers.wait_for_port(
                    port, proc, timeout_s=5, identify=servers.identify_nats(str(tmp_path))
                )


def test_up_waits_for_its_own_router_not_one_already_on_the_port() -> None:
    """The router's port can be drawn by another launcher at the same moment: that mesh's
    router answering /ready (same engine names, all ready) is not this mesh's. `up` waits
    for the /ready of the router process it started."""
    parser = argparse.ArgumentParser()
    up.add_up_args(parser)
    plan = up.Mesh(parser.parse_args(["--port", "7001"]))
    engines = {"colocated": [name for name, _ in plan.engines()]}
    answer: dict[str, Any] = {"buckets": {"default": {"engines": engines}}, "missing": []}

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with sleeper() as ours:
            names = set(engines["colocated"])
            answer["pid"] = ours.pid + 1  # another router
            with pytest.raises(TimeoutError, match="not ready"):
                wait_ready(url, names, ours.pid, 1.0, lambda: False)
            answer["pid"] = ours.pid
            wait_ready(url, names, ours.pid, 5.0, lambda: False)
    finally:
        server.shutdown()
        plan.workdir.cleanup()


def test_a_listener_slow_to_greet_is_waited_for_not_taken_for_another(tmp_path: Path) -> None:
    """A server that accepts but does not answer within the probe's 2 s (a loaded machine)
    is asked again until `timeout_s`: not ready, and not "another process" either."""
    with (
        listener() as (_, port),
        sleeper() as proc,
        pytest.raises(TimeoutError, match="nothing listened"),
    ):
        servers.wait_for_port(
            port, proc, timeout_s=3, identify=servers.identify_nats(str(tmp_path))
        )


def test_restart_policy_doubles_to_the_cap() -> None:
    policy = RestartPolicy(initial_s=0.5, max_s=10.0)
    assert [policy.delay(n) for n in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_supervisor_restarts_a_killed_child_and_stop_leaves_none(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    status = tmp_path / "status.json"
    sup = Supervisor(RestartPolicy(initial_s=0.1), status)
    sup.start(ChildSpec("a", SLEEPER, tier=1))
    sup.start(ChildSpec("b", SLEEPER, tier=0))
    first = sup.children["a"].pid
    assert first is not None and json.loads(status.read_text())["children"]["a"]["pid"] == first
    os.kill(first, signal.SIGKILL)
    with caplog.at_level(logging.WARNING, "hicache.supervisor"):

        def restarted() -> bool:
            sup.poll()
            return sup.children["a"].pid != first

        _wait(restarted, 10, "a restart")
    child = sup.children["a"]
    assert child.restarts == 1 and child.last_exit == -signal.SIGKILL
    assert "a exited with code -9; restart 1 in 0.1s" in caplog.text
    recorded = json.loads(status.read_text())["children"]["a"]
    assert recorded["pid"] == child.pid and recorded["restarts"] == 1
    pids = [c.pid for c in sup.children.values()]
    sup.stop(grace_s=5)
    assert not any(_alive(p) for p in pids if p is not None)
    assert not status.exists()


def test_a_restart_that_never_gets_ready_is_killed_and_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    launched: list[subprocess.Popen[bytes]] = []

    def ready(proc: subprocess.Popen[bytes]) -> None:
        launched.append(proc)
        if len(launched) > 1:
            raise TimeoutError("nothing listened")

    sup = Supervisor(RestartPolicy(initial_s=0.1))
    sup.start(ChildSpec("server", SLEEPER, tier=0, ready=ready))
    first = launched[0]
    first.kill()
    with caplog.at_level(logging.WARNING, "hicache.supervisor"):
        _wait(lambda: (sup.poll(), len(launched) >= 2)[1], 10, "a restart attempt")
    try:
        assert "restart of server failed: nothing listened" in caplog.text
        assert launched[1].poll() is not None  # the never-ready process was not left running
        child = sup.children["server"]
        assert child.restarts == 2 and child.restart_at is not None  # tried again later
    finally:
        sup.stop(grace_s=5)


# ---------------------------------------------------------------- the router while NATS is down


@pytest.fixture
def own_nats() -> Iterator[ServerProcess]:
    """A nats-server this test may kill and bring back on the same port."""
    server = start_nats()
    yield server
    server.stop()


async def test_router_names_nats_while_it_is_down_and_serves_after_restart(
    own_nats: ServerProcess, redis_server: ServerProcess
) -> None:
    async with running_mesh(own_nats.url, redis_server.url, num_engines=1) as mesh:
        prompt = [5, 6, 7, 8]
        r = await mesh.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
        assert r.status == 200
        own_nats.kill()
        while mesh.router_nc.is_connected:
            await asyncio.sleep(0.02)
        r = await mesh.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
        body = await r.json()
        assert r.status == 503, body
        assert "NATS" in body["error"]["message"] and body["error"]["code"] == "bus_unavailable"
        assert r.headers["Retry-After"] == "1"
        health = await mesh.client.get("/health")
        assert health.status == 503 and "NATS" in (await health.json())["error"]["message"]

        restarted = start_nats(own_nats.port)  # same port: clients reconnect to the same URL
        try:
            deadline = asyncio.get_running_loop().time() + 30
            engine = mesh.engines[0]
            while True:  # both reconnected, a heartbeat went through the router's subscription
                health = await mesh.client.get("/health")
                if health.status == 200 and engine.nc.is_connected and mesh.router_nc.is_connected:
                    await engine.beat()
                    await mesh.sync()
                    break
                assert asyncio.get_running_loop().time() < deadline, await health.json()
                await asyncio.sleep(0.1)
            late = FakeEngine(f"{engine.engine_id}-late", own_nats.url, namespace=engine.namespace)
            await late.start()  # only the re-subscribed heartbeat subscription can see it
            try:
                await mesh.wait_for_engines(2, timeout_s=10)
                r = await mesh.client.post(
                    "/v1/completions", json={"prompt": prompt, "max_tokens": 3}
                )
                body = await r.json()
                assert r.status == 200, body  # the reply inbox works again
            finally:
                await late.stop()
            assert body["usage"]["completion_tokens"] == 3
        finally:
            restarted.stop()


# ---------------------------------------------------------------- SIGTERM with NATS unreachable


@pytest.mark.parametrize(
    "module",
    [
        ["router", "--port", "{port}", "--shutdown-timeout", "5"],
        ["services.index"],
    ],
    ids=["router", "index"],
)
def test_sigterm_stops_a_service_that_never_reached_nats(module: list[str]) -> None:
    dead = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    argv = [a.format(port=free_port()) for a in module]
    proc = subprocess.Popen(
        [sys.executable, "-m", *argv, "--nats-url", dead, *NO_REDIS],
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(3)  # a few connect attempts
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"{argv[0]} ignored SIGTERM while NATS was unreachable") from None
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err
    attempts = [line for line in err.splitlines() if "unreachable" in line]
    assert attempts and all(dead in line for line in attempts), err
    assert len(attempts) < 10, "attempts back off"


def test_sigterm_stops_a_router_whose_nats_went_away(tmp_path: Path) -> None:
    """A guard (this already held on 90556fa): NATS lost after startup, SIGTERM still works."""
    module = ["router", "--port", "{port}", "--shutdown-timeout", "5"]
    ready = "listening on"
    server = start_nats()
    argv = [a.format(port=free_port()) for a in module]
    err_path = tmp_path / "stderr"
    with err_path.open("w") as err_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", *argv, "--nats-url", server.url, *NO_REDIS],
            stderr=err_file,
        )
    try:
        _wait(lambda: ready in err_path.read_text(), 30, f"{argv[0]} ready")
        server.kill()
        _wait(lambda: "disconnected" in err_path.read_text().lower(), 10, "the disconnect")
        time.sleep(1)  # a few reconnect attempts
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        server.stop()
    err = err_path.read_text()
    assert code == 0, err
    assert "Traceback" not in err, err


# ---------------------------------------------------------------- hicache-mesh up


def _up(port: int, status: Path, log: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*UP, "--port", str(port), "--status-file", str(status), *extra],
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
        start_new_session=True,
    )


def test_up_refuses_a_busy_port_before_starting_anything(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        status, log = tmp_path / "status.json", tmp_path / "up.log"
        proc = _up(port, status, log)
        assert proc.wait(60) == 1
    err = log.read_text()
    assert f"port {port} on 127.0.0.1 is not available" in err and "PORT=" in err, err
    assert "Traceback" not in err and "started" not in err, err
    assert not status.exists()


def _get(url: str, timeout_s: float = 60) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except (urllib.error.URLError, ConnectionError) as e:
        return 0, {"error": repr(e)}  # the router itself is (re)starting


def _complete(base: str, i: int) -> tuple[int, dict[str, Any]]:
    body = json.dumps({"prompt": [5 + i, 6, 7, 8, 9], "max_tokens": 4}).encode()
    req = urllib.request.Request(
        f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except (urllib.error.URLError, ConnectionError) as e:
        return 0, {"error": repr(e)}  # the router itself is (re)starting


def _epoch(base: str, engine_id: str) -> str | None:
    """The engine's epoch as the router's /stats reports it (None: not live)."""
    _, body = _get(f"{base}/stats")
    return body.get("engines", {}).get(engine_id, {}).get("epoch")


def _children(status: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(status.read_text())["children"])
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _restarted(status: Path, name: str, old_pid: int, restarts: int) -> bool:
    child = _children(status).get(name, {})
    return bool(child.get("restarts") == restarts and child.get("pid") != old_pid)


def _burst(pool: ThreadPoolExecutor, base: str, n: int = 4) -> list[tuple[int, dict[str, Any]]]:
    return list(pool.map(lambda i: _complete(base, i), range(n)))


def test_up_restarts_killed_children_and_leaves_nothing_behind(tmp_path: Path) -> None:
    port, status, log = free_port(), tmp_path / "status.json", tmp_path / "up.log"
    proc = _up(
        port, status, log, "--engines", "2", "--page-size", "4", "--heartbeat-interval", "0.2"
    )
    base = f"http://127.0.0.1:{port}"
    pool, load_pool = ThreadPoolExecutor(8), ThreadPoolExecutor(1)
    try:
        assert proc.stdout is not None
        line = ""
        while "is up" not in line:  # engines print their own lines on stdout too
            line = proc.stdout.readline()
            assert line, log.read_text()[-3000:]
        _wait(lambda: _epoch(base, "engine-0") and _epoch(base, "engine-1"), 120, "both engines")
        assert all(s == 200 for s, _ in _burst(pool, base))

        # an engine killed under load: up survives, requests keep being answered
        children = _children(status)
        engine_pid, epoch = children["engine-0"]["pid"], _epoch(base, "engine-0")
        assert epoch is not None
        load = load_pool.submit(_burst, pool, base, 8)
        os.kill(engine_pid, signal.SIGKILL)
        answered = load.result(timeout=120)
        assert all(s == 200 or s >= 500 for s, _ in answered), answered
        survivors_served = [s for s, _ in _burst(pool, base)]
        _wait(lambda: _restarted(status, "engine-0", engine_pid, 1), 60, "engine-0 restart")
        assert proc.poll() is None
        assert 200 in survivors_served  # engine-1 serves while engine-0 comes back
        _wait(lambda: _epoch(base, "engine-0") not in (None, epoch), 90, "engine-0's new epoch")
        assert all(s == 200 for s, _ in _burst(pool, base))
        assert "engine-0 exited with code -9; restart 1" in log.read_text()

        # index, nats-server, redis-server, router killed: all come back (on the same ports)
        both = ("engine-0", "engine-1")
        engines = {e: (_children(status)[e]["pid"], _epoch(base, e)) for e in both}
        for name in ("index", "nats", "redis", "router"):
            pid, port_before = _children(status)[name]["pid"], _children(status)[name]["port"]
            os.kill(pid, signal.SIGKILL)
            _wait(lambda n=name, p=pid: _restarted(status, n, p, 1), 30, f"{name} restart")
            assert _children(status)[name]["port"] == port_before
        _wait(lambda: _get(f"{base}/health")[0] == 200, 60, "healthy after nats restart")
        _wait(lambda: all(_epoch(base, e) for e in both), 60, "both engines after nats")
        # the engines reconnected on their own: same processes, same epochs
        assert {e: (_children(status)[e]["pid"], _epoch(base, e)) for e in both} == engines
        _wait(lambda: all(s == 200 for s, _ in _burst(pool, base)), 60, "serving after nats")
        pids = [c["pid"] for c in _children(status).values()]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        load_pool.shutdown(wait=False, cancel_futures=True)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(90)
    assert code == 0, log.read_text()[-3000:]
    time.sleep(0.5)
    assert not [p for p in pids if _alive(p)], "up left children behind"
    assert not kill_session(proc.pid), "hicache-mesh up left processes behind"
