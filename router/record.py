"""`--record FILE`: one JSON line per generation request, for replay and regression tests.

Each line: `time` (unix seconds at arrival), `endpoint`, `status`, `request` (the JSON body
as received), `input_ids` (the prompt as sent to the engine), `output_ids`, `text`,
`finish_reason`, `prompt_tokens`, `cached_tokens` ({device, host}), `ttft_s`, `engine_id`,
`error` (the error message, or null), and for P/D requests `disaggregation` (as in the
response's usage). Lines are written and flushed as requests finish.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import orjson

from router.generation import Outcome


class Recorder:
    """Appends records to one file; `close()` when done."""

    def __init__(self, path: str | Path) -> None:
        self._file: IO[bytes] = open(path, "ab")  # noqa: SIM115 (closed by close())

    def write(
        self,
        *,
        time_s: float,
        endpoint: str,
        status: int,
        body: Any,
        input_ids: Sequence[int],
        outcome: Outcome | None,
        error: str | None = None,
    ) -> None:
        record: dict[str, Any] = {
            "time": time_s,
            "endpoint": endpoint,
            "status": status,
            "request": body,
            "input_ids": list(input_ids),
            "output_ids": outcome.output_ids if outcome else [],
            "text": outcome.text if outcome else "",
            "finish_reason": outcome.finish_reason if outcome else None,
            "prompt_tokens": outcome.prompt_tokens if outcome else 0,
            "cached_tokens": {
                "device": outcome.cached_device if outcome else 0,
                "host": outcome.cached_host if outcome else 0,
                "storage": outcome.cached_storage if outcome else 0,
            },
            "ttft_s": outcome.ttft_s if outcome else None,
            "engine_id": outcome.engine_id if outcome else None,
            "error": error,
        }
        if outcome is not None and outcome.disaggregation is not None:
            record["disaggregation"] = outcome.disaggregation.as_dict()
        self._file.write(orjson.dumps(record) + b"\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
