"""After a generation's answer left: its metrics, the engine table's hit counts, the prefix
prediction audit, and its record (`--record`)."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from router import keys
from router.choices import Choices
from router.generation import Generation
from router.request_record import Exchange, request_record


class TokenTimes:
    """When output tokens reached the router: the inter-token gaps, per token (a delta of
    n tokens after a gap g counts n gaps of g / n, as SGLang counts a batch)."""

    __slots__ = ("gaps", "last")

    def __init__(self) -> None:
        self.last: float | None = None
        self.gaps: list[float] = []

    def tick(self, num_tokens: int) -> None:
        if not num_tokens:
            return
        now = time.perf_counter()
        if self.last is not None:
            self.gaps.extend([(now - self.last) / num_tokens] * num_tokens)
        self.last = now


def after_response(
    app: web.Application,
    choices: Choices,
    times: TokenTimes,
    endpoint: str,
    status: int,
    time_s: float,
    body: dict[str, Any],
) -> None:
    """Metrics and the record of a served request, once its response is on its way."""
    _account(app, choices, times)
    gen = choices.first
    exchange = Exchange(
        time_s=time_s,
        timings=gen.timings,
        endpoint=endpoint,
        status=status,
        body=body,
        spec=gen.spec,
        choices=choices,
        itl_s=times.gaps,
        error=None,
    )
    record_exchange(app, exchange)


def record_exchange(app: web.Application, exchange: Exchange) -> None:
    """Queue the request's record (docs/recording.md) when recording."""
    recorder = app.get(keys.RECORDER)
    if recorder is not None:
        recorder.write(request_record(exchange))


def _account(app: web.Application, choices: Choices, times: TokenTimes) -> None:
    """Counts the prompt once and every choice's output; times are choice 0's."""
    gen = choices.first
    metrics, spec, out = app[keys.METRICS], gen.spec, gen.outcome
    child = metrics.child
    num_output = sum(len(g.outcome.output_ids) for g in choices.gens)
    metrics.prompt_tokens.inc(out.prompt_tokens)
    metrics.completion_tokens.inc(num_output)
    child(metrics.cached_tokens, "device").inc(out.cached_device)
    child(metrics.cached_tokens, "host").inc(out.cached_host)
    child(metrics.cached_tokens, "storage").inc(out.cached_storage)
    app[keys.TABLE].account(out.engine_id, out.prompt_tokens, out.cached_tokens)
    if out.disaggregation is not None:  # the prefill engine's own hit rate
        pd = out.disaggregation
        app[keys.TABLE].account(pd.prefill_engine, out.prompt_tokens, pd.prefill_cached_tokens)
    if out.predicted_cached_tokens is not None and out.finish_reason is not None:
        result = app[keys.AUDIT].observe(
            out.engine_id, out.predicted_cached_tokens, out.cached_tokens
        )
        child(metrics.prefix_predictions, result).inc()
        metrics.prefix_prediction_error.observe(
            abs(out.predicted_cached_tokens - out.cached_tokens)
        )
    model = model_name(gen)
    child(metrics.sg_prompt_tokens, model).inc(out.prompt_tokens)
    child(metrics.sg_generation_tokens, model).inc(num_output)
    child(metrics.sg_cached_tokens, model).inc(out.cached_tokens)
    e2e_s = time.perf_counter() - gen.timings.arrived
    child(metrics.sg_e2e, model).observe(e2e_s)
    if out.queue_s is not None:
        child(metrics.sg_queue, model).observe(out.queue_s)
    if out.ttft_s is not None:
        child(metrics.ttft, spec.endpoint).observe(out.ttft_s)
        child(metrics.sg_ttft, model).observe(out.ttft_s)
        if len(out.output_ids) > 1:
            tpot = (e2e_s - out.ttft_s) / (len(out.output_ids) - 1)
            child(metrics.sg_tpot, model).observe(tpot)
    itl = child(metrics.sg_itl, model)
    for gap in times.gaps:
        itl.observe(gap)


def model_name(gen: Generation) -> str:
    """The served model of the request: as asked, else the generating engine's."""
    return gen.spec.model if gen.spec.model is not None else gen.outcome.model
