"""`--record FILE`: the traffic the router served, as JSON lines that `hicache-mesh replay`
reads back (the format, version 1, is documented in docs/recording.md).

One header line when the file is opened (what produced the records: versions, model, the
mesh's, engines' and router's flags), then one line per request to a generation endpoint,
rejected ones included. Recording stays off the request path: the handler builds a dict of
references and puts it on a bounded queue; a writer thread serializes and appends. When
the queue is full the record is dropped and counted (`on_drop`), and a `drops` line marks
the gap once the queue has room again. A request is never slowed or failed by recording.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import queue
import subprocess
import threading
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import orjson

log = logging.getLogger(__name__)

FORMAT = "hicache-mesh-record"
VERSION = 1
REDACTED_FIELDS = ("prompt", "messages", "suffix")  # text a redacted record drops
_STOP = object()


def project_version() -> str | None:
    try:
        return importlib.metadata.version("hicache-mesh")
    except importlib.metadata.PackageNotFoundError:
        return None


def git_revision() -> str | None:
    """The commit of the checkout this code runs from; None outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def header(meta: Mapping[str, Any], router_flags: Sequence[str], redacted: bool) -> dict[str, Any]:
    """The header line: `meta` is what `up` knows (model, dtype, page size, the mesh's and
    each bucket's engine flags); a router started on its own has none of it (nulls)."""
    return {
        "type": "header",
        "format": FORMAT,
        "version": VERSION,
        "project_version": project_version(),
        "git_revision": git_revision(),
        "created": time.time(),
        "model": meta.get("model"),
        "served_model_name": meta.get("served_model_name"),
        "dtype": meta.get("dtype"),
        "page_size": meta.get("page_size"),
        "redacted": redacted,
        "mesh_flags": _flags(meta.get("mesh_flags")),
        "engine_flags": {b: _flags(f) for b, f in (meta.get("engine_flags") or {}).items()}
        if meta.get("engine_flags") is not None
        else None,
        "router_flags": _without_secrets(router_flags),
    }


SECRET_FLAGS = ("--api-key",)


def _flags(flags: Any) -> list[str] | None:
    return None if flags is None else _without_secrets([str(f) for f in flags])


def _without_secrets(flags: Sequence[str]) -> list[str]:
    """`flags` with the values of secret flags masked, and without the meta (it is the
    header itself)."""
    out: list[str] = []
    skip_next = False
    for i, flag in enumerate(flags):
        if skip_next:
            skip_next = False
            continue
        name = flag.split("=", 1)[0]
        if name == "--record-meta":
            skip_next = "=" not in flag
            continue
        if name in SECRET_FLAGS:
            out.append(f"{name}=***")
            skip_next = "=" not in flag and i + 1 < len(flags)
            continue
        out.append(flag)
    return out


def redact(body: Any) -> Any:
    """The body without its text (token ids and every other field stay)."""
    if not isinstance(body, dict):
        return None
    return {k: v for k, v in body.items() if k not in REDACTED_FIELDS}


def _default(obj: Any) -> Any:
    if isinstance(obj, array):  # TokenIds
        return obj.tolist()
    raise TypeError(f"cannot record a {type(obj).__name__}")


class Recorder:
    """Appends records to one file from a writer thread; `close()` flushes and stops it."""

    def __init__(
        self,
        path: str | Path,
        first_line: Mapping[str, Any],
        *,
        redacted: bool = False,
        max_queue: int = 10_000,
        on_drop: Callable[[], None] | None = None,
    ) -> None:
        self.redacted = redacted
        self.dropped = 0  # records dropped since the start
        self._missed = 0  # dropped since the last `drops` line was queued
        self._on_drop = on_drop
        self._queue: queue.Queue[object] = queue.Queue(max_queue)
        self._file: IO[bytes] = open(path, "ab")  # noqa: SIM115 (closed by the writer thread)
        self._file.write(orjson.dumps(first_line, default=_default) + b"\n")
        self._file.flush()
        self._thread = threading.Thread(target=self._write_loop, name="recorder", daemon=True)
        self._thread.start()

    def write(self, record: dict[str, Any]) -> None:
        """Queue one record (on the event loop; never blocks). Text goes here if redacted."""
        if self.redacted:
            record["request"] = redact(record.get("request"))
            for choice in record.get("choices", ()):
                choice["text"] = None
        try:
            if self._missed:
                marker = {"type": "drops", "time": time.time(), "count": self._missed}
                self._queue.put_nowait(marker)
                self._missed = 0
            self._queue.put_nowait(record)
        except queue.Full:
            self._missed += 1
            self.dropped += 1
            if self._on_drop is not None:
                self._on_drop()

    def close(self) -> None:
        """Write what is queued, then stop the thread and close the file."""
        with contextlib.suppress(queue.Full):
            self._queue.put(_STOP, timeout=10)
        self._thread.join(timeout=30)

    def _write_loop(self) -> None:
        f = self._file
        try:
            while True:
                item = self._queue.get()
                batch = [item]
                with contextlib.suppress(queue.Empty):
                    while len(batch) < 256:
                        batch.append(self._queue.get_nowait())
                stop = False
                for record in batch:
                    if record is _STOP:
                        stop = True
                        continue
                    try:
                        f.write(orjson.dumps(record, default=_default) + b"\n")
                    except (TypeError, orjson.JSONEncodeError) as e:
                        log.warning("record not written: %s", e)
                    # hand the interpreter back to the event loop between records: a
                    # backlog written in one go would hold it for the switch interval (5 ms)
                    time.sleep(0)
                f.flush()
                if stop:
                    return
        except OSError as e:
            log.error("recording stopped: %s", e)
        finally:
            f.close()
