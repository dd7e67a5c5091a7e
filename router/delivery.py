"""A generation's answer on its way out: one JSON body (`respond_whole`) or server-sent events
(`respond_stream`), with the headers that name the engines and the router's time."""

from __future__ import annotations

import time
from contextlib import aclosing

from aiohttp import web

from router.accounting import TokenTimes, model_name
from router.choices import Choices
from router.errors import ApiError, json_response
from router.generation import Generation
from router.responses import DONE, SSE_HEADERS, OpenAIShape, generate_body, sse

ENGINE_HEADER = "X-Hicache-Engine"  # the engine that generated (P/D: the decode engine)
TIMING_HEADER = "Server-Timing"  # the router's own time per stage (`Timings.server_timing`)
PREFILL_HEADER = "X-Hicache-Prefill-Engine"  # P/D only: the engine that computed the prompt


def _shape(choices: Choices) -> OpenAIShape:
    gen = choices.first
    return OpenAIShape(
        gen.spec.endpoint == "chat",
        gen.outcome.request_id,
        model_name(gen),
        int(time.time()),
        gen.model.tokenizer,
        gen.spec.include_usage,
        _hide_cache(choices.first),
    )


async def respond_whole(request: web.Request, choices: Choices, times: TokenTimes) -> web.Response:
    async with aclosing(choices.run()) as deltas:
        async for index, delta in deltas:
            if index == 0:
                times.tick(len(delta.token_ids))
            if request.transport is None or request.transport.is_closing():
                break  # the client left: closing the iterator aborts the engines
    spec = choices.first.spec
    if spec.endpoint == "generate":
        body = generate_body(
            choices.first.outcome,
            logprobs=spec.logprobs is not None,
            hide_cache=_hide_cache(choices.first),
        )
    else:
        outs = [gen.outcome for gen in choices.gens]
        body = _shape(choices).whole(outs, spec.logprobs is not None)
    return json_response(body, headers=_engine_headers(choices.first))


async def respond_stream(
    request: web.Request, choices: Choices, times: TokenTimes
) -> web.StreamResponse:
    """SSE. Headers go out with the first engine chunk, so an engine that fails before it
    can still be retried or answered with a plain error status."""
    resp = web.StreamResponse(headers=SSE_HEADERS)
    spec = choices.first.spec
    shape: OpenAIShape | None = None
    released = ""  # /generate: the text so far (one choice)
    opened: set[int] = set()  # chat choices whose role chunk went out
    sent_logprobs: dict[int, int] = {}  # per choice: logprobs already sent
    async with aclosing(choices.run()) as deltas:
        try:
            async for index, delta in deltas:
                if index == 0:
                    times.tick(len(delta.token_ids))
                out = choices.gens[index].outcome
                if not resp.prepared:
                    resp.headers.update(_engine_headers(choices.first))
                    await resp.prepare(request)
                    if spec.endpoint != "generate":
                        shape = _shape(choices)
                if shape is not None and shape.chat and index not in opened:
                    opened.add(index)
                    await resp.write(sse(shape.chunk(index, "", [], first=True)))
                released += delta.text
                final = out.finish_reason is not None
                if not (delta.text or delta.token_ids or final):
                    continue
                if shape is None:
                    event = generate_body(
                        out, released, spec.logprobs is not None, _hide_cache(choices.first)
                    )
                else:
                    lps = None
                    if spec.logprobs is not None:
                        lps = out.logprobs[sent_logprobs.get(index, 0) :]
                        sent_logprobs[index] = len(out.logprobs)
                    reason = out.finish_reason
                    event = shape.chunk(index, delta.text, delta.token_ids, reason, lps)
                await resp.write(sse(event))
            if shape is not None and shape.include_usage:
                await resp.write(sse(shape.usage_chunk([g.outcome for g in choices.gens])))
        except ApiError as e:
            if not resp.prepared:
                raise
            await resp.write(sse(e.body()))
        except ConnectionResetError:
            return resp  # the client left; closing the iterator aborts the engines
    await resp.write(DONE)
    await resp.write_eof()
    return resp


def _hide_cache(gen: Generation) -> bool:
    return gen.config.hide_cache_stats


def _engine_headers(gen: Generation) -> dict[str, str]:
    """The engine(s) that served, and the router's time so far (a stream's headers leave
    with its first chunk: its `engine` stage is not over yet). None with --hide-cache-stats:
    the engine a cache-aware router chose, and the time it took, tell of a prefix hit."""
    if _hide_cache(gen):
        return {}
    out = gen.outcome
    headers = {ENGINE_HEADER: out.engine_id}
    if out.disaggregation is not None:
        headers[PREFILL_HEADER] = out.disaggregation.prefill_engine
    headers[TIMING_HEADER] = gen.timings.server_timing(time.perf_counter())
    return headers
