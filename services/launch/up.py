"""`hicache-mesh up`: the whole mesh on loopback, as processes.

Starts nats-server and redis-server on free ports (or uses `--nats-url` / `--redis-url`),
then the index service, `--engines N` engine services and the router; prints the URL; on
Ctrl-C or SIGTERM stops them all in reverse order and leaves no process behind.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from types import FrameType

from gpu_worker.engine.args import add_engine_args, engine_argv
from services.launch.servers import ServerProcess, start_nats, start_redis


def add_up_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--nats-url", default=None, help="use this NATS instead of starting one")
    parser.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    parser.add_argument("--engines", type=int, default=1, help="colocated engines to start")
    pd = parser.add_argument_group("prefill/decode disaggregation")
    pd.add_argument(
        "--pd",
        action="store_true",
        help="start prefill and decode engines instead of colocated ones",
    )
    pd.add_argument("--num-prefill", type=int, default=1)
    pd.add_argument("--num-decode", type=int, default=1)
    pd.add_argument(
        "--decode-max-total-tokens",
        type=int,
        default=None,
        help="device KV pool of decode engines (default: --max-total-tokens)",
    )
    parser.add_argument("--bucket", default="default")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--record", default=None, help="record traffic as JSON lines")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0)
    parser.add_argument("--startup-timeout", type=float, default=120.0)
    add_engine_args(parser)


class Mesh:
    """The processes of one mesh, started in order and stopped in reverse."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.servers: list[ServerProcess] = []
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self) -> str:
        a = self.args
        nats_url, redis_url = a.nats_url, a.redis_url
        if nats_url is None:
            self.servers.append(start_nats())
            nats_url = self.servers[-1].url
        if redis_url is None:
            self.servers.append(start_redis())
            redis_url = self.servers[-1].url
        py = sys.executable
        self._spawn(
            "index", [py, "-m", "services.index", "--nats-url", nats_url, "--redis-url", redis_url]
        )
        for name, extra in self._engines():
            self._spawn(
                name,
                [
                    py,
                    "-m",
                    "services.engine",
                    "--engine-id",
                    name,
                    "--bucket",
                    a.bucket,
                    "--nats-url",
                    nats_url,
                    "--heartbeat-interval",
                    str(a.heartbeat_interval),
                    *engine_argv(a),
                    *extra,
                ],
            )
        router = [
            py,
            "-m",
            "router",
            "--host",
            a.host,
            "--port",
            str(a.port),
            "--nats-url",
            nats_url,
            "--redis-url",
            redis_url,
            "--bucket",
            a.bucket,
        ]
        if a.api_key:
            router += ["--api-key", a.api_key]
        if a.record:
            router += ["--record", a.record]
        self._spawn("router", router)
        url = f"http://{a.host}:{a.port}"
        self._wait_healthy(url, a.startup_timeout)
        return url

    def _engines(self) -> list[tuple[str, list[str]]]:
        """(engine id, flags beyond the shared engine flags) of every engine to start."""
        a = self.args
        if not a.pd:
            return [(f"engine-{i}", []) for i in range(a.engines)]
        decode = ["--disaggregation-mode", "decode"]
        if a.decode_max_total_tokens:
            decode += ["--max-total-tokens", str(a.decode_max_total_tokens)]
        prefill = ["--disaggregation-mode", "prefill"]
        return [(f"prefill-{i}", prefill) for i in range(a.num_prefill)] + [
            (f"decode-{i}", decode) for i in range(a.num_decode)
        ]

    def _spawn(self, name: str, argv: list[str]) -> None:
        self.procs.append((name, subprocess.Popen(argv)))

    def _wait_healthy(self, url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_children()
            with (
                contextlib.suppress(urllib.error.URLError, ConnectionError, OSError),
                urllib.request.urlopen(f"{url}/health", timeout=1) as resp,
            ):
                if resp.status == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"the mesh was not healthy at {url} within {timeout_s}s")

    def check_children(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode}")

    def stop(self, grace_s: float = 15.0) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for server in reversed(self.servers):
            server.stop()


def run_up(args: argparse.Namespace) -> int:
    mesh = Mesh(args)
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        url = mesh.start()
        print(f"hicache-mesh is up: {url}  (OpenAI API at {url}/v1; Ctrl-C stops it)", flush=True)
        while not stopping:
            mesh.check_children()
            time.sleep(0.2)
    except (RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        code = 1
    finally:
        mesh.stop()
    return code
