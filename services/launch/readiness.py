"""`hicache-mesh up` waits for its mesh: until its own router's /ready says every bucket can
serve and lists every engine `up` started (`wait_ready`)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any

from services.launch.supervisor import Child


class StartupStopped(Exception):
    """Ctrl-C or SIGTERM arrived before the mesh was healthy."""


def wait_ready(
    url: str,
    engines: set[str],
    router_pid: int | None,
    timeout_s: float,
    stopping: Callable[[], bool],
    exited: Callable[[], Iterable[Child]] = tuple,
) -> None:
    """Return once the router at `url` with pid `router_pid` answers /ready with 200
    (every bucket has a ready engine of each role it needs) and lists all of `engines` as
    ready. A child dying during startup (`exited`) is a configuration error, not a fault to
    heal: raise with its name and exit code. On timeout the error says what /ready still
    missed; StartupStopped when `stopping()` turned true first."""
    deadline = time.monotonic() + timeout_s
    missing = "the router did not answer"
    while time.monotonic() < deadline and not stopping():
        for child in exited():
            raise RuntimeError(
                f"{child.spec.name} exited with code {child.proc.returncode if child.proc else None} during startup"
            )
        answer = _get_ready(url)
        # another mesh's router on a port drawn at the same moment is not ours (ours
        # then fails to bind, and exits: raised above)
        if answer is not None and answer[1].get("pid") == router_pid:
            status, body = answer
            ready = {
                engine_id
                for bucket in body.get("buckets", {}).values()
                for ids in bucket.get("engines", {}).values()
                for engine_id in ids
            }
            if status == 200 and engines <= ready:
                return
            missing = "; ".join(body.get("missing") or []) or (
                f"engines not ready yet: {', '.join(sorted(engines - ready))}"
            )
        time.sleep(0.2)
    if stopping():
        raise StartupStopped("stopped during startup")
    raise TimeoutError(f"the mesh at {url} was not ready within {timeout_s}s: {missing}")


def _get_ready(url: str) -> tuple[int, dict[str, Any]] | None:
    """(status, body) of the router's /ready, or None when it does not answer in JSON."""
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=1) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:  # 503: not ready, the body says why
        with e:
            try:
                return e.code, json.loads(e.read())
            except ValueError:
                return None
    except (urllib.error.URLError, ConnectionError, OSError, ValueError):
        return None
