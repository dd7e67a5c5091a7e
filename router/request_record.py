"""The record of one request to a generation endpoint, as `--record` writes it (the format is
docs/recording.md's; `router/record.py` owns the file and its writer thread)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from router.choices import Choices
from router.outcome import Timings
from router.protocol import GenerationSpec


@dataclass(frozen=True, slots=True)
class Exchange:
    """One request to a generation endpoint, as far as it got, and its answer."""

    time_s: float  # wall-clock time of its arrival
    timings: Timings  # its perf_counter marks: the record's e2e_s runs from `arrived`
    endpoint: str  # the path it came to
    status: int  # the HTTP status it was answered
    body: Any  # its JSON body as decoded (None when it was not JSON)
    spec: GenerationSpec | None  # the request as parsed, when parsing got that far
    choices: Choices | None  # its generations, when routing got that far
    itl_s: list[float]  # gaps between its output tokens at the router (choice 0's)
    error: str | None  # the error message it was answered, if any


def request_record(x: Exchange) -> dict[str, Any]:
    """The record of `x`: references only, the writer thread serializes them."""
    spec = x.spec
    gens = x.choices.gens if x.choices is not None else []
    out = gens[0].outcome if gens else None
    record: dict[str, Any] = {
        "type": "request",
        "time": x.time_s,
        "endpoint": x.endpoint,
        "status": x.status,
        "request": x.body,
        "input_ids": spec.input_ids if spec is not None else [],
        "seed": spec.seed if spec is not None else None,
        "sampling": [g.spec.sampling(g.max_new_tokens, g.choice) for g in gens],
        "choices": [
            {
                "output_ids": g.outcome.output_ids,
                "text": g.outcome.text,
                "finish_reason": g.outcome.finish_reason,
            }
            for g in gens
        ],
        "usage": {
            "prompt_tokens": out.prompt_tokens if out else 0,
            "completion_tokens": sum(len(g.outcome.output_ids) for g in gens),
            "cached_tokens": {
                "device": out.cached_device if out else 0,
                "host": out.cached_host if out else 0,
                "storage": out.cached_storage if out else 0,
            },
        },
        "ttft_s": out.ttft_s if out else None,
        "itl_s": x.itl_s,
        "e2e_s": time.perf_counter() - x.timings.arrived,
        "engine_id": (out.engine_id or None) if out else None,
        "bucket": gens[0].bucket if gens else None,
        "route_reason": (out.route_reason or None) if out else None,
        "predicted_cached_tokens": out.predicted_cached_tokens if out else None,
        "error": x.error,
    }
    if out is not None and out.disaggregation is not None:
        record["disaggregation"] = out.disaggregation.as_dict()
    return record
