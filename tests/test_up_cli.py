"""`hicache-mesh up --model tiny`: a completion with curl, Ctrl-C, nothing left behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

from services.launch.servers import free_port

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
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        pass  # the whole process group is gone: nothing left behind
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("hicache-mesh up left processes behind")
