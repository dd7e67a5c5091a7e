"""One validated request, served: choose an engine, stream from it, retry once, stop strings.

Retry rule: when an engine fails before it delivered any chunk (a timeout, lost heartbeats, a
503 "unavailable" reply), nothing has reached the client yet, so the request goes once more
to the best other live engine. Once the engine has delivered a chunk the request has started
there; a failure after that is reported (502/504), not replayed. An engine that timed out,
went silent or sent garbage sits out (`EngineTable.mark_failed`).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from bus_schemas import GenerateRequest, TokenChunk
from router.config import RouterConfig
from router.detokenize import TextAssembler
from router.engines import EngineTable, EngineView
from router.errors import ApiError
from router.metrics import RouterMetrics
from router.protocol import GenerationSpec
from router.routing import Router
from router.stream import EngineFailure, EngineStream, ReplyHub
from router.tokenizer import Tokenizer

RETRY_AFTER_S = 1
MAX_ATTEMPTS = 2


@dataclass(frozen=True, slots=True)
class Delta:
    """New output since the last one: released text, and the ids that arrived."""

    text: str
    token_ids: list[int]


@dataclass(slots=True)
class Outcome:
    """What the request produced so far; final when `Generation.run` returns."""

    request_id: str
    engine_id: str = ""
    prompt_tokens: int = 0
    cached_device: int = 0
    cached_host: int = 0
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" once finished
    ttft_s: float | None = None
    route_reason: str = ""

    @property
    def cached_tokens(self) -> int:
        return self.cached_device + self.cached_host


def no_engine_error(bucket: str) -> ApiError:
    return ApiError(
        503,
        f"no live engine in bucket {bucket!r}; try again shortly",
        code="no_live_engine",
        retry_after_s=RETRY_AFTER_S,
    )


class Generation:
    """Serves `spec` with `max_new_tokens`; iterate `run()` for deltas, then read `outcome`."""

    def __init__(
        self,
        *,
        hub: ReplyHub,
        table: EngineTable,
        router: Router,
        config: RouterConfig,
        metrics: RouterMetrics,
        tokenizer: Tokenizer,
        spec: GenerationSpec,
        max_new_tokens: int,
        bucket: str,
        started_at: float,
    ) -> None:
        self.hub = hub
        self.table = table
        self.router = router
        self.config = config
        self.metrics = metrics
        self.spec = spec
        self.max_new_tokens = max_new_tokens
        self.bucket = bucket
        self.started_at = started_at
        self.outcome = Outcome(request_id=uuid.uuid4().hex)
        self.assembler = TextAssembler(tokenizer, spec.stop)

    def candidates(self, excluded: set[str]) -> list[EngineView]:
        return [
            e
            for e in self.table.live(self.bucket)
            if e.engine_id not in excluded and (self.spec.model in (None, e.model))
        ]

    async def run(self) -> AsyncGenerator[Delta, None]:
        """Deltas as they come; raises ApiError when the request cannot be served.

        Close the iterator (`contextlib.aclosing`) to stop early: the engine gets an abort.
        """
        excluded: set[str] = set()
        for attempt in range(MAX_ATTEMPTS):
            candidates = self.candidates(excluded)
            if not candidates:
                raise no_engine_error(self.bucket)
            choice = await self.router.choose(
                candidates, self.spec.input_ids, self.spec.cache_salt, retry=attempt > 0
            )
            engine_id = choice.engine.engine_id
            self.outcome.engine_id = engine_id
            self.outcome.route_reason = choice.reason
            try:
                async for delta in self._serve(engine_id):
                    yield delta
                return
            except EngineFailure as f:
                self.metrics.bus_errors.labels(f.kind).inc()
                if f.engine_broken:
                    self.table.mark_failed(engine_id, f.message)
                retriable = f.status >= 500 and f.num_chunks == 0
                if not retriable or attempt + 1 == MAX_ATTEMPTS:
                    raise _client_error(f) from None
                excluded.add(engine_id)
                if not self.candidates(excluded):
                    raise _client_error(f) from None

    async def _serve(self, engine_id: str) -> AsyncIterator[Delta]:
        request = GenerateRequest(
            request_id=self.outcome.request_id,
            input_ids=self.spec.input_ids,
            sampling=self.spec.sampling(self.max_new_tokens),
            reply_to="",  # the stream sets its inbox
            cache_salt=self.spec.cache_salt,
        )
        tokens = len(self.spec.input_ids) + self.max_new_tokens
        with self.table.lease(engine_id, tokens):
            async with EngineStream(
                self.hub, self.table, self.config, engine_id, request
            ) as stream:
                async for chunk in stream:
                    ids = self._take(chunk)
                    if self.assembler.matched:
                        if not chunk.finished:
                            await stream.abort()
                        self.outcome.finish_reason = "stop"
                    elif chunk.finished:
                        self.assembler.finish()
                        self.outcome.finish_reason = chunk.finish_reason or "stop"
                    self.outcome.text = self.assembler.text
                    self.outcome.output_ids = self.assembler.ids
                    yield Delta(self.assembler.release(), ids)
                    if self.outcome.finish_reason is not None:
                        return

    def _take(self, chunk: TokenChunk) -> list[int]:
        """Apply one chunk to the outcome; the ids taken (cut after a stop string)."""
        out = self.outcome
        if chunk.seq == 0:
            out.prompt_tokens = chunk.prompt_tokens or len(self.spec.input_ids)
            out.cached_device = chunk.cached_device
            out.cached_host = chunk.cached_host
        if out.ttft_s is None and chunk.token_ids:
            out.ttft_s = asyncio.get_running_loop().time() - self.started_at
        taken = []
        for t in chunk.token_ids:
            taken.append(t)
            if self.assembler.push(t):
                break
        return taken


def _client_error(f: EngineFailure) -> ApiError:
    codes = {
        "timeout": "engine_timeout",
        "lost": "engine_lost",
        "bad_message": "engine_bad_reply",
        "engine_error": "engine_error",
        "unavailable": "engine_unavailable",
        "rejected": "engine_rejected",
        "bus": "bus_unavailable",
    }
    retry_after = RETRY_AFTER_S if f.status == 503 else None
    return ApiError(f.status, f.message, code=codes[f.kind], retry_after_s=retry_after)
