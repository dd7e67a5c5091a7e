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
import hashlib
import importlib.metadata
import logging
import os
import queue
import secrets
import subprocess
import threading
import time
from array import array
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import orjson

from router.protocol import SAMPLING_FIELDS

log = logging.getLogger(__name__)

FORMAT = "hicache-mesh-record"
VERSION = 1
TOKEN_IDS = ("keep", "hash", "drop")  # --record-token-ids
# What a redacted record keeps of a request body: the fields that decide the output and
# carry no user text, and only values of the types listed (numbers, booleans, lists of token
# ids, logit_bias's id -> number). Everything else is dropped: prompts, messages, `text`,
# `stop` strings, `user`, `cache_salt`, unknown fields, any string (`model` stays when it
# names a served model, else it reads "(redacted)"). The sampling fields are /generate's
# (`router.protocol`), but `stop`, whose strings are text.
SAFE_FIELDS = (SAMPLING_FIELDS - {"stop"}) | {
    "max_tokens",
    "max_completion_tokens",
    "n",
    "stream",
    "stream_options",
    "include_usage",
    "logprobs",
    "top_logprobs",
    "return_logprob",
    "top_logprobs_num",
    "sampling_params",
}
# dropped fields a redacted record names (`redacted_fields`), so replay knows what is gone;
# other dropped names (unknown fields) are not written: a name can be text too
TEXT_FIELDS = frozenset(
    {"prompt", "messages", "suffix", "text", "input_ids", "stop", "user", "cache_salt"}
)
OUTPUT_FIELDS = frozenset({"stop"})  # dropped fields that change the output
REJECTED_LINE_BYTES = 1 << 20  # a rejected request's line beyond this keeps no body or ids
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


def header(
    meta: Mapping[str, Any],
    router_flags: Sequence[str],
    redacted: bool,
    token_ids: str = "keep",
) -> dict[str, Any]:
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
        "token_ids": token_ids,
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


def redact(body: Any, models: Collection[str] = ()) -> tuple[Any, list[str]]:
    """The body with only `SAFE_FIELDS` of safe types, and the names of the text fields it
    dropped (from `TEXT_FIELDS`; "..." for any other field dropped). `model` stays when it
    is one of `models` (served names), else it becomes "(redacted)" (still not served)."""
    if not isinstance(body, dict):
        return None, []
    out = _safe(body)
    dropped = set(body) & TEXT_FIELDS
    sp = body.get("sampling_params")
    if isinstance(sp, dict):
        dropped |= {f"sampling_params.{k}" for k in set(sp) & TEXT_FIELDS}
        if set(sp) - SAFE_FIELDS - TEXT_FIELDS:
            dropped.add("...")
    if set(body) - SAFE_FIELDS - TEXT_FIELDS - {"model"}:
        dropped.add("...")
    if "model" in body:
        model = body["model"]
        out["model"] = model if isinstance(model, str) and model in models else "(redacted)"
    return out, sorted(dropped)


def _safe(obj: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in obj.items():
        if k not in SAFE_FIELDS:
            continue
        if isinstance(v, dict):
            if k == "logit_bias":
                v = {t: b for t, b in v.items() if t.isdigit() and _scalar(b)}
            else:
                v = _safe(v)
        elif isinstance(v, list):
            v = [x for x in v if isinstance(x, int)]
        elif not _scalar(v):
            continue
        out[k] = v
    return out


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, bool | int | float)


def _rough_size(obj: Any, limit: int) -> int:
    """A lower bound of `obj`'s JSON size, counted until it passes `limit` (then returned at
    once: a 30 MB refused prompt is never serialized to find out)."""
    if isinstance(obj, str):
        return len(obj)
    if isinstance(obj, array | list | tuple):
        if obj and not isinstance(obj[0], dict | list | str):
            return 2 * len(obj)
        total = 0
        for x in obj:
            total += _rough_size(x, limit) + 1
            if total > limit:
                break
        return total
    if isinstance(obj, dict):
        total = 0
        for k, v in obj.items():
            total += len(k) + _rough_size(v, limit) + 4
            if total > limit:
                break
        return total
    return 8


def _default(obj: Any) -> Any:
    if isinstance(obj, array):  # TokenIds
        return obj.tolist()
    raise TypeError(f"cannot record a {type(obj).__name__}")


class Recorder:
    """Appends records to one file from a writer thread; `close()` flushes and stops it.

    The file is created with mode 0600 (an existing one is tightened to it): it holds what
    users sent. Past `max_bytes` it is rotated as `logging`'s RotatingFileHandler does (FILE
    -> FILE.1 -> ... -> FILE.`backups`, the oldest dropped) and the new FILE starts with the
    header again. `redacted` keeps only `SAFE_FIELDS` of each request and no output text;
    `token_ids` "hash" writes keyed blake2b digests of the prompt's pages and of each output
    instead of the ids (the key is drawn per router run: equal prefixes show as equal within
    a run, and nothing can be confirmed by hashing guesses), "drop" writes only their counts.
    """

    def __init__(
        self,
        path: str | Path,
        first_line: Mapping[str, Any],
        *,
        redacted: bool = False,
        token_ids: str = "keep",
        max_bytes: int = 0,
        backups: int = 3,
        page_size: int = 16,
        served_models: Collection[str] = (),
        max_queue: int = 10_000,
        on_drop: Callable[[], None] | None = None,
    ) -> None:
        if token_ids not in TOKEN_IDS:
            raise ValueError(f"token_ids must be one of {TOKEN_IDS}, got {token_ids!r}")
        self.redacted = redacted
        self.token_ids = token_ids
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self.page_size = max(1, page_size)
        self.served_models = frozenset(served_models)
        self._hash_key = secrets.token_bytes(32)
        self.dropped = 0  # records dropped since the start
        self._missed = 0  # dropped since the last `drops` line was queued
        self._on_drop = on_drop
        self._queue: queue.Queue[object] = queue.Queue(max_queue)
        self._header = orjson.dumps(first_line, default=_default) + b"\n"
        self._file, self._size = self._open()
        self._thread = threading.Thread(target=self._write_loop, name="recorder", daemon=True)
        self._thread.start()

    def _open(self) -> tuple[IO[bytes], int]:
        """FILE for appending, mode 0600, with the header written."""
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.fchmod(fd, 0o600)  # an existing file keeps its mode otherwise
            f = os.fdopen(fd, "ab")
        except BaseException:
            os.close(fd)
            raise
        size = os.fstat(f.fileno()).st_size
        f.write(self._header)
        f.flush()
        return f, size + len(self._header)

    def _rotate(self) -> None:
        self._file.close()
        for i in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                older.replace(self.path.with_name(f"{self.path.name}.{i + 1}"))
        self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        self._file, self._size = self._open()

    def write(self, record: dict[str, Any]) -> None:
        """Queue one record (on the event loop; never blocks). The writer thread redacts."""
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

    def line(self, record: dict[str, Any]) -> bytes:
        """The record as it is written: redacted, ids hashed or dropped, bounded if refused."""
        if record.get("type") == "request":
            self._prepare(record)
        return orjson.dumps(record, default=_default) + b"\n"

    def _prepare(self, record: dict[str, Any]) -> None:
        ok = record.get("status") == 200
        if not ok:
            size = _rough_size(record.get("request"), REJECTED_LINE_BYTES)
            size += _rough_size(record.get("input_ids"), REJECTED_LINE_BYTES)
            if size > REJECTED_LINE_BYTES:
                record["request"], record["input_ids"] = None, []
                record["omitted_bytes"] = size  # at least this much was left out
        if self.redacted:
            request = record.get("request")
            models = self.served_models
            if ok and isinstance(request, dict) and isinstance(request.get("model"), str):
                models = models | {request["model"]}  # served: a served model's name
            record["request"], dropped = redact(request, models)
            if dropped:
                record["redacted_fields"] = dropped
            if record.get("error") is not None:
                record["error"] = "(redacted)"  # a message may quote the request
            for choice in record.get("choices", ()):
                choice["text"] = None
        if self.token_ids == "keep":
            return
        ids = record.get("input_ids") or ()
        record["input_ids"] = None
        record["input_len"] = len(ids)
        if self.token_ids == "hash":
            record["input_page_hashes"] = self._page_hashes(ids)
        for choice in record.get("choices", ()):
            out = choice.get("output_ids") or ()
            choice["output_ids"] = None
            choice["output_len"] = len(out)
            if self.token_ids == "hash":
                choice["output_hash"] = self._digest(b"", out)
        request = record.get("request")
        if isinstance(request, dict) and "input_ids" in request:
            record["request"] = {k: v for k, v in request.items() if k != "input_ids"}

    def _digest(self, prev: bytes, ids: Sequence[int]) -> str:
        data = array("I", [i & 0xFFFFFFFF for i in ids if isinstance(i, int)]).tobytes()
        return hashlib.blake2b(prev + data, digest_size=16, key=self._hash_key).hexdigest()

    def _page_hashes(self, ids: Sequence[int]) -> list[str]:
        """Chained digests of the prompt's pages (equal prefixes: equal leading hashes)."""
        out, prev = [], b""
        for start in range(0, len(ids), self.page_size):
            digest = self._digest(prev, ids[start : start + self.page_size])
            out.append(digest)
            prev = bytes.fromhex(digest)
        return out

    def _write_loop(self) -> None:
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
                        data = self.line(record)  # type: ignore[arg-type]
                    except (TypeError, orjson.JSONEncodeError) as e:
                        log.warning("record not written: %s", e)
                        continue
                    full = self.max_bytes and self._size + len(data) > self.max_bytes
                    if full and self._size > len(self._header):
                        self._file.flush()
                        self._rotate()
                    self._file.write(data)
                    self._size += len(data)
                    # hand the interpreter back to the event loop between records: a
                    # backlog written in one go would hold it for the switch interval (5 ms)
                    time.sleep(0)
                self._file.flush()
                if stop:
                    return
        except OSError as e:
            log.error("recording stopped: %s", e)
        finally:
            self._file.close()
