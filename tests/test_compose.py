"""compose/ cannot drift from the CLI: every service command parses with the module's own
parser, and the compose mesh has the same parts `hicache-mesh up` starts. It would also
survive a real `docker compose up`: healthchecks whose commands exist in their images (the
probe runs here against real servers), start order on health, restart policies, one image
built once, a small build context, the router published on loopback with an API key option.

There is no Docker engine on these machines, so the file is checked, not run.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
import yaml
from fake_engine import FakeEngine

from services.launch.servers import free_port, identify_nats, nats_argv, wait_for_port

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILES = sorted((ROOT / "compose").glob("docker-compose*.yml"))


def services(path: Path) -> dict[str, Any]:
    return dict(yaml.safe_load(path.read_text())["services"])


def _defaults(arg: str) -> str:
    """`${VAR:-default}` as docker compose expands it with VAR unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", arg)


def python_services(path: Path | None = None) -> list[tuple[str, str, list[str]]]:
    out = []
    for file in [path] if path else COMPOSE_FILES:
        for name, svc in services(file).items():
            cmd = svc.get("command", [])
            if cmd[:2] == ["python", "-m"]:
                out.append((f"{file.name}:{name}", cmd[2], [_defaults(a) for a in cmd[3:]]))
    return out


@pytest.mark.parametrize(("name", "module", "argv"), python_services())
def test_service_command_parses_with_the_cli(name: str, module: str, argv: list[str]) -> None:
    parser: argparse.ArgumentParser = importlib.import_module(f"{module}.__main__").build_parser()
    try:
        parser.parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"compose service {name!r}: `{module}` rejects {argv} (exit {e.code})")


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_runs_the_parts_up_starts(path: Path) -> None:
    modules = sorted({module for _, module, _ in python_services(path)})
    assert modules == ["router", "services.engine", "services.index"]
    svc = services(path)
    assert {"nats", "redis"} <= set(svc)
    nats_cmd = svc["nats"]["command"]
    assert "-c" in nats_cmd and (ROOT / "compose" / "nats.conf").read_text().count("max_payload")


def test_pd_compose_has_both_roles() -> None:
    (path,) = [p for p in COMPOSE_FILES if p.name == "docker-compose.pd.yml"]
    modes = [
        argv[argv.index("--disaggregation-mode") + 1]
        for _, module, argv in python_services(path)
        if module == "services.engine"
    ]
    assert sorted(modes) == ["decode", "prefill"]


def test_engine_flags_match_up_passthrough() -> None:
    """Every engine flag compose uses is one `hicache-mesh up` accepts and passes on."""
    from services.cli import build_parser

    up = build_parser()
    for _, module, argv in python_services():
        if module != "services.engine":
            continue
        engine_flags = [a for a in argv if a.startswith("--")]
        engine_only = {"--engine-id", "--bucket", "--nats-url", "--disaggregation-mode"}
        up_argv = ["up"]
        for i, a in enumerate(argv):
            if a.startswith("--") and a not in engine_only:
                nxt = argv[i + 1] if i + 1 < len(argv) else None
                up_argv += [a] if nxt is None or nxt.startswith("--") else [a, nxt]
        up.parse_args(up_argv)
        assert engine_flags


def test_engines_take_the_parallel_layout_from_the_environment() -> None:
    """TP_SIZE / PP_SIZE set every engine's --tp-size / --pp-size (1 when unset): P/D
    engines share one layout, which their KV frames need. The buckets file gives each
    bucket its own (SHORT_TP_SIZE, LONG_TP_SIZE, ...)."""
    for path in COMPOSE_FILES:
        for name, svc in services(path).items():
            cmd = svc.get("command", [])
            if cmd[:3] != ["python", "-m", "services.engine"]:
                continue
            prefix = ""
            if path.name == "docker-compose.buckets.yml":
                prefix = cmd[cmd.index("--bucket") + 1].upper() + "_"
            tp, pp = cmd[cmd.index("--tp-size") + 1], cmd[cmd.index("--pp-size") + 1]
            assert re.fullmatch(rf"\$\{{{prefix}TP_SIZE:-\d+\}}", tp), (name, tp)
            assert pp == f"${{{prefix}PP_SIZE:-1}}", (name, pp)


def test_buckets_compose_matches_up_buckets() -> None:
    """The buckets file: engines of two buckets on one shared store with the unified key
    scheme, and a router that knows both buckets and their lengths."""
    from router.__main__ import build_parser as router_parser
    from router.__main__ import config_from_args
    from router.buckets import Bucket

    (path,) = [p for p in COMPOSE_FILES if p.name == "docker-compose.buckets.yml"]
    engines = {
        argv[argv.index("--bucket") + 1]: argv
        for _, module, argv in python_services(path)
        if module == "services.engine"
    }
    assert sorted(engines) == ["long", "short"]
    for argv in engines.values():
        assert argv[argv.index("--hicache-storage-key-scheme") + 1] == "unified"
        assert argv[argv.index("--hicache-storage-dir") + 1] == "/var/cache/hicache"
    svc = services(path)
    assert all("kv-store:/var/cache/hicache" in svc[n]["volumes"] for n in ("short-0", "long-0"))
    (router_argv,) = [a for _, m, a in python_services(path) if m == "router"]
    config = config_from_args(router_parser().parse_args(router_argv))
    assert config.buckets == (Bucket("short", 4096), Bucket("long"))


def test_dockerfile_copies_every_package() -> None:
    text = (ROOT / "compose" / "Dockerfile").read_text()
    for package in ("bus_schemas", "router", "services", "gpu_worker"):
        assert f"COPY {package} ./{package}" in text


# ---------------------------------------------------------------- would survive `compose up`

IMAGE = "hicache-mesh:latest"


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_every_service_restarts_and_has_a_healthcheck(path: Path) -> None:
    for name, svc in services(path).items():
        assert svc.get("restart") == "unless-stopped", name
        test = svc.get("healthcheck", {}).get("test")
        assert isinstance(test, list) and test[0] == "CMD" and len(test) > 1, name


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_services_start_after_what_they_need_is_healthy(path: Path) -> None:
    svc = services(path)
    for name, spec in svc.items():
        deps = spec.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: depends_on must carry conditions"
        for dep, cond in deps.items():
            assert dep in svc and cond == {"condition": "service_healthy"}, (name, dep)
    needs = set(svc["router"]["depends_on"])
    assert needs == set(svc) - {"router"}, "the router waits for every other part"


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_one_image_built_once(path: Path) -> None:
    ours = {n: s for n, s in services(path).items() if s["command"][:2] == ["python", "-m"]}
    assert all(s.get("image") == IMAGE for s in ours.values())
    built = [n for n, s in ours.items() if "build" in s]
    assert len(built) == 1, built
    assert services(path)[built[0]]["build"]["dockerfile"] == "compose/Dockerfile"


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_router_is_published_on_loopback_with_an_api_key_option(path: Path) -> None:
    router = services(path)["router"]
    assert router["ports"] and all(p.startswith("127.0.0.1:") for p in router["ports"])
    cmd = router["command"]
    assert cmd[cmd.index("--api-key") + 1].startswith("${API_KEY")
    published = [n for n, s in services(path).items() if s.get("ports")]
    assert published == ["router"]
    assert "API_KEY" in path.read_text().split("ports:")[0].rsplit("router:", 1)[1]  # the note


def test_router_treats_an_empty_api_key_as_none() -> None:
    """`${API_KEY:-}` expands to "" when unset: that must mean no key, not an empty key."""
    from router.__main__ import build_parser, config_from_args

    config = config_from_args(build_parser().parse_args(["--api-key", ""]))
    assert config.api_key is None


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_healthcheck_commands_exist_in_their_images(path: Path) -> None:
    from services.healthcheck import build_parser

    svc = services(path)
    for name, spec in svc.items():
        test = spec["healthcheck"]["test"][1:]
        if spec.get("image") == IMAGE:  # python:3.11-slim has no curl/wget: our own probe
            assert test[:3] == ["python", "-m", "services.healthcheck"], name
            build_parser().parse_args(test[3:])
            if test[3] == "engine":
                assert test[-1] == spec["command"][spec["command"].index("--engine-id") + 1]
    assert svc["nats"]["image"].endswith("-alpine")  # busybox wget; the default is scratch
    assert svc["nats"]["healthcheck"]["test"][1] == "wget"
    monitor = svc["nats"]["command"][svc["nats"]["command"].index("-m") + 1]
    assert f":{monitor}/healthz" in svc["nats"]["healthcheck"]["test"][-1]
    assert svc["redis"]["image"].startswith("redis:")  # ships redis-cli
    assert svc["redis"]["healthcheck"]["test"][1:] == ["redis-cli", "ping"]


def test_dockerignore_keeps_the_build_context_small() -> None:
    lines = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*", "exclude everything, then re-include what the image copies"
    copied = re.findall(r"^COPY (\S+)", (ROOT / "compose" / "Dockerfile").read_text(), re.M)
    for src in copied:
        assert f"!{src}" in lines or f"!{src}/" in lines, src
    assert not any(".venv" in line and line.startswith("!") for line in lines)


# ---------------------------------------------------------------- the probe, for real


def _probe(*argv: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "services.healthcheck", "--timeout", "3", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=ROOT)


@pytest.fixture
def monitored_nats(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A nats-server with its monitoring port: (client URL, monitoring URL)."""
    port, monitor = free_port(), free_port()
    proc = subprocess.Popen(
        nats_argv(port, str(tmp_path), monitor),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, proc, identify=identify_nats(str(tmp_path)))
        wait_for_port(monitor, proc)
        yield f"nats://127.0.0.1:{port}", f"http://127.0.0.1:{monitor}"
    finally:
        proc.terminate()
        proc.wait(10)


async def test_healthcheck_probes_against_real_servers(monitored_nats: tuple[str, str]) -> None:
    nats_url, monitor = monitored_nats
    assert _probe("http", f"{monitor}/healthz").returncode == 0
    dead = _probe("http", f"http://127.0.0.1:{free_port()}/health")
    assert dead.returncode == 1 and "unhealthy" in dead.stderr
    assert _probe("nats-client", monitor, "hicache-index").returncode == 1
    assert _probe("engine", nats_url, "probe-engine").returncode == 1
    engine = FakeEngine("probe-engine", nats_url)
    client = await nats.connect(nats_url, name="hicache-index")
    await engine.start()
    try:
        loop = asyncio.get_running_loop()
        named = await loop.run_in_executor(None, _probe, "nats-client", monitor, "hicache-index")
        answered = await loop.run_in_executor(None, _probe, "engine", nats_url, "probe-engine")
    finally:
        await engine.stop()
        await client.close()
    assert named.returncode == 0, named.stderr
    assert answered.returncode == 0, answered.stderr
    assert engine.stats_requests == 1
