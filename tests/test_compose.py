"""compose/ cannot drift from the CLI: every service command parses with the module's own
parser, and the compose mesh has the same parts `hicache-mesh up` starts.

There is no Docker engine on these machines, so the file is checked, not run.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILES = sorted((ROOT / "compose").glob("docker-compose*.yml"))


def services(path: Path) -> dict[str, Any]:
    return dict(yaml.safe_load(path.read_text())["services"])


def python_services(path: Path | None = None) -> list[tuple[str, str, list[str]]]:
    out = []
    for file in [path] if path else COMPOSE_FILES:
        for name, svc in services(file).items():
            cmd = svc.get("command", [])
            if cmd[:2] == ["python", "-m"]:
                out.append((f"{file.name}:{name}", cmd[2], cmd[3:]))
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


def test_dockerfile_copies_every_package() -> None:
    text = (ROOT / "compose" / "Dockerfile").read_text()
    for package in ("bus_schemas", "router", "services", "gpu_worker"):
        assert f"COPY {package} ./{package}" in text
