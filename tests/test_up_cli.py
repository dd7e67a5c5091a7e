"""`hicache-mesh up --model tiny`: a completion with curl, Ctrl-C, nothing left behind."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from fault_helpers import kill_session

from services.cli import build_parser, main
from services.engine.__main__ import build_parser as build_engine_parser
from services.launch.servers import free_port
from services.launch.up import Mesh

ALARM = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|Traceback")
UP = [sys.executable, "-m", "services.cli", "up"]


def test_up_serves_a_completion_and_stops_cleanly() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [*UP, "--port", str(port), "--model", "tiny", "--page-size", "4"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline and "is up" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "up exited before printing its URL"
        assert f"http://127.0.0.1:{port}" in line
        body = json.dumps({"prompt": "Hello, mesh", "max_tokens": 4}).encode()
        if shutil.which("curl"):
            out = subprocess.run(
                [
                    "curl",
                    "-sS",
                    f"http://127.0.0.1:{port}/v1/completions",
                    "-H",
                    "Content-Type: application/json",
                    "-d",
                    body.decode(),
                ],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            ).stdout
        else:
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=60) as resp:
                out = resp.read().decode()
        data = json.loads(out)
        assert data["object"] == "text_completion"
        assert data["usage"]["prompt_tokens"] == len(b"Hello, mesh")
        assert data["usage"]["completion_tokens"] <= 4
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
    assert code == 0
    time.sleep(0.5)
    assert not kill_session(proc.pid), "hicache-mesh up left processes behind"


def test_ctrl_c_stops_the_mesh_without_alarm(tmp_path: Path) -> None:
    """Ctrl-C in a terminal is SIGINT to the whole foreground process group. `up` stops its
    children in order (router; engines and index; nats-server and redis-server last), so a
    clean stop logs no warning, error or traceback: no "drain failed", no NATS errors of
    services whose server went first."""
    port, log = free_port(), tmp_path / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--model", "tiny", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own foreground group, as a shell's job
        )
    try:
        deadline = time.monotonic() + 120
        while "is up" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps({"prompt": "Hello", "max_tokens": 4}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        code = proc.wait(90)
    text = log.read_text()
    assert code == 0, text
    alarming = [line for line in text.splitlines() if ALARM.search(line)]
    assert not alarming, "\n".join(alarming)
    assert not kill_session(proc.pid), "hicache-mesh up left processes behind"


def test_up_passes_the_pd_transfer_settings_on(tmp_path: Path) -> None:
    """`up --pd` exposes the transfer settings: the frame cap and windows go to its prefill
    engines (which send), the timeouts to the router (which tells decode engines), the
    payload limit to the nats-server it starts; a limit too small for any frame is refused."""
    flags = [
        "up",
        "--pd",
        "--disaggregation-frame-bytes",
        "65536",
        "--disaggregation-window",
        "4",
        "--disaggregation-window-bytes",
        "1048576",
        "--disaggregation-ack-timeout",
        "3",
        "--disaggregation-transfer-timeout",
        "5",
        "--disaggregation-admit-timeout",
        "7",
        "--nats-max-payload",
        "2097152",
    ]
    mesh = Mesh(build_parser().parse_args(flags))
    try:
        engines = dict(mesh.engines())
        sent = ["--disaggregation-frame-bytes", "65536", "--disaggregation-window", "4"]
        sent += ["--disaggregation-window-bytes", "1048576", "--disaggregation-ack-timeout", "3.0"]
        assert engines["prefill-0"] == ["--disaggregation-mode", "prefill", *sent]
        assert not any(f.startswith("--disaggregation-w") for f in engines["decode-0"])
        router = " ".join(mesh.router_argv("nats://n", "redis://r"))
        assert "--pd-transfer-timeout 5.0" in router and "--pd-admit-timeout 7.0" in router
        mesh.nats.argv(4222, str(tmp_path))
        assert "max_payload: 2097152" in (tmp_path / "nats.conf").read_text()
    finally:
        mesh.workdir.cleanup()
    engine = build_engine_parser().parse_args(["--engine-id", "p", *sent])
    assert engine.disaggregation_window_bytes == 1048576  # the engine takes what up sends
    assert main(["up", "--port", str(free_port()), "--nats-max-payload", "100"]) == 2
