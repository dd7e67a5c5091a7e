"""What replay can read: a registry of input formats, each a reader `path -> Recording`.

`record` is the router's `--record` file (docs/recording.md). Another trace format plugs in
by registering a reader that builds a `Recording`: its `RecordedRequest`s carry the body to
send, the arrival time and, when the trace has no answers to compare with (a Mooncake trace
has lengths and block hashes, no outputs), `reference=None`; replay then sends and measures
them and compares nothing. `mooncake` reads a public Mooncake trace
(`services/bench/mooncake.py`): each request becomes a greedy `/v1/completions` of its
blocks' tokens with `max_tokens` its output length (`ignore_eos`), sent at its timestamp.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from services.bench.mooncake import TRACE_BLOCK_SIZE, read_mooncake
from services.replay.recording import RecordedRequest, RecordHeader, Recording, read_recording

Reader = Callable[[Path], Recording]


def read_mooncake_trace(path: Path, block_size: int = TRACE_BLOCK_SIZE, seed: int = 1) -> Recording:
    """A Mooncake trace as requests to send, with nothing to compare them with."""
    header = RecordHeader(0, 1, False, None, None, None, None, None)
    requests = tuple(
        RecordedRequest(
            line=r.line,
            segment=0,
            time_s=r.arrival_s,
            endpoint="/v1/completions",
            body={
                "prompt": r.input_ids.tolist(),
                "max_tokens": r.output_len,
                "temperature": 0,
                "ignore_eos": True,
            },
            input_ids=tuple(r.input_ids),
            seed=None,
            sampling=(),
            redacted=False,
            reference=None,
            predicted_cached_tokens=None,
            engine_id=None,
            route_reason=None,
        )
        for r in read_mooncake(path, block_size, seed=seed)
    )
    return Recording(str(path), (header,), requests)


SOURCES: dict[str, Reader] = {"record": read_recording, "mooncake": read_mooncake_trace}
DEFAULT_SOURCE = "record"


def read_source(path: Path, fmt: str = DEFAULT_SOURCE) -> Recording:
    """The file read with the reader registered as `fmt`; ValueError for an unknown one."""
    reader = SOURCES.get(fmt)
    if reader is None:
        raise ValueError(f"unknown input format {fmt!r}; formats: {', '.join(sorted(SOURCES))}")
    return reader(path)
