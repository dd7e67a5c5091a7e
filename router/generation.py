"""One validated request, served: choose engines, stream from them, retry once, stop strings.

A request takes the P/D path when its bucket has a live prefill and a live decode engine
(`engines.pd_ready`; the steps and retries are in `disagg`), else the colocated path on
"colocated" engines. GenerateRequests never go to prefill or decode engines.

Colocated retry rule: when an engine fails before it delivered any chunk (a timeout, lost
heartbeats, a 503 "unavailable" reply), nothing has reached the client yet, so the request
goes once more to the best other live engine. Once the engine has delivered a chunk the
request has started there; a failure after that is reported (502/504), not replayed. An
engine that timed out, went silent, sent garbage or crashed sits out
(`EngineTable.mark_failed`). A request that was in an engine when its step loop crashed
(kind "engine_crashed") is never retried, on either path: it may be what crashed it, and
a retry would take down the next engine too (DESIGN.md 7a). The client gets a 500.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Collection
from dataclasses import dataclass

from bus_schemas import (
    DecodeAdmit,
    DecodeAdmitReply,
    GenerateRequest,
    PrefillRequest,
    TokenChunk,
    subjects,
)
from router.config import RouterConfig
from router.detokenize import TextAssembler
from router.disagg import PDInfo, admit, retry_kind
from router.engines import COLOCATED, DECODE, PREFILL, EngineTable, EngineView, pd_ready
from router.errors import ApiError
from router.metrics import RouterMetrics
from router.models import ServedModel
from router.outcome import Delta, Outcome, Timings, TokenLogprob
from router.protocol import GenerationSpec
from router.reply_hub import ReplyHub
from router.routing import RouteChoice, Router
from router.stream import DECODE_ERRORS, EngineFailure, EngineStream

RETRY_AFTER_S = 1
MAX_ATTEMPTS = 2


@dataclass(frozen=True, slots=True)
class _PDAttempt:
    """The prefill side of the P/D attempt in progress, for its first chunk."""

    prefill_engine: str
    admitted: DecodeAdmitReply


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
        model: ServedModel,
        spec: GenerationSpec,
        max_new_tokens: int,
        bucket: str,
        timings: Timings,
        choice: int = 0,
        prefer: str | None = None,
        card_digests: frozenset[str] | None = None,
    ) -> None:
        """`choice`: which of the request's `spec.n` choices this is; `prefer`: an engine to
        try first (a later choice goes where choice 0 cached the prompt); `card_digests`:
        the model cards of engines that parse requests as `model` does (default: its own)."""
        self.hub = hub
        self.table = table
        self.router = router
        self.config = config
        self.metrics = metrics
        self.model = model
        self.spec = spec
        self.max_new_tokens = max_new_tokens
        self.bucket = bucket
        self.timings = timings
        self.choice = choice
        self.prefer = prefer
        self.card_digests = card_digests or frozenset({model.digest})
        self.outcome = Outcome(request_id=uuid.uuid4().hex)
        self.assembler = TextAssembler(model.tokenizer, spec.stop)
        self._pd: _PDAttempt | None = None

    def candidates(
        self, role: str | None = None, excluded: Collection[str] = ()
    ) -> list[EngineView]:
        """Live engines of the bucket that speak the request's model card (its tokens)."""
        digests = self.card_digests
        return [
            e
            for e in self.table.live(self.bucket, role)
            if e.engine_id not in excluded and e.card_digest in digests
        ]

    async def run(self) -> AsyncGenerator[Delta, None]:
        """Deltas as they come; raises ApiError when the request cannot be served.

        Close the iterator (`contextlib.aclosing`) to stop early: the engine gets an abort.
        """
        if pd_ready(self.candidates()):
            self.metrics.pd_requests.inc()
            serve = self._run_pd()
        else:
            serve = self._run_colocated()
        async with contextlib.aclosing(serve):
            async for delta in serve:
                yield delta

    # ------------------------------------------------------------ colocated

    async def _run_colocated(self) -> AsyncGenerator[Delta, None]:
        excluded: set[str] = set()
        for attempt in range(MAX_ATTEMPTS):
            candidates = self.candidates(COLOCATED, excluded)
            if not candidates:
                raise no_engine_error(self.bucket)
            preferred = [e for e in candidates if e.engine_id == self.prefer]
            if attempt == 0 and preferred:
                candidates = preferred
            # retries get fresh request ids, as in P/D: one may go to the same engine (a
            # request lost on the bus), which may yet get the first copy late
            rid = uuid.uuid4().hex if attempt else self.outcome.request_id
            try:
                async for delta in self._serve(candidates, rid, retry=attempt > 0):
                    yield delta
                return
            except EngineFailure as f:
                self._count(f)
                if not _retriable(f) or attempt + 1 == MAX_ATTEMPTS:
                    raise _client_error(f) from None
                engine_id = f.engine_id
                if f.kind != "bus" and (not f.epoch or f.epoch == self.table.epoch_of(engine_id)):
                    # (a restarted engine is a new process, and a request lost in a NATS
                    # reconnect says nothing about its engine: both kept)
                    excluded.add(engine_id)
                if not self.candidates(COLOCATED, excluded):
                    raise _client_error(f) from None

    async def _serve(
        self, candidates: list[EngineView], rid: str, retry: bool
    ) -> AsyncIterator[Delta]:
        """Route among `candidates`, then serve on the engine chosen. The request is encoded
        while Redis looks the prompt up: it names the reply subject, not the engine."""
        async with EngineStream(self.hub, self.table, self.config, "", rid) as stream:
            payload = b""

            def encode() -> None:
                nonlocal payload
                payload = GenerateRequest(
                    request_id=rid,
                    input_ids=self.spec.input_ids,
                    sampling=self.spec.sampling(self.max_new_tokens, self.choice),
                    reply_to=stream.reply_to,
                    cache_salt=self.spec.cache_salt,
                ).encode()

            started = time.perf_counter()
            choice = await self.router.choose(
                candidates, self.spec.input_ids, self.spec.cache_salt, retry, meanwhile=encode
            )
            self.timings.route_s += time.perf_counter() - started
            self.timings.lookup_s += choice.lookup_s
            engine_id = choice.engine.engine_id
            self.outcome.engine_id, self.outcome.model = engine_id, choice.engine.model
            self.outcome.route_reason = choice.reason
            self.outcome.predicted_cached_tokens = choice.predicted_tokens(len(self.spec.input_ids))
            stream.bind(engine_id)
            with self.table.lease(engine_id, len(self.spec.input_ids) + self.max_new_tokens):
                self._dispatched()
                await stream.send(subjects.engine_generate(engine_id), payload)
                async for delta in self._consume(stream):
                    yield delta

    # ------------------------------------------------------------ prefill/decode

    async def _run_pd(self) -> AsyncGenerator[Delta, None]:
        """P/D attempts until one serves; each retry kind of `disagg.retry_kind` once."""
        used: set[str] = set()
        no_decode: set[str] = set()
        no_prefill: set[str] = set()
        pinned: tuple[str, str] | None = None  # a restore retry stays on the same engines
        reuse = True
        error: ApiError | None = None  # what the client gets when no retry is left
        while True:
            route = await self._route_pd(no_decode, no_prefill, pinned, retry=bool(used))
            if route is None:
                raise error or no_engine_error(self.bucket)
            decode, prefill = route[0].engine.engine_id, route[1].engine.engine_id
            self.outcome.engine_id, self.outcome.model = decode, route[0].engine.model
            self.outcome.route_reason = route[0].reason
            self.outcome.predicted_cached_tokens = route[0].predicted_tokens(
                len(self.spec.input_ids)
            )
            # the first attempt's request id is the response's; retries get fresh ones, so
            # KV still in flight for a failed attempt cannot land in the next
            rid = uuid.uuid4().hex if used else self.outcome.request_id
            try:
                async for delta in self._serve_pd(decode, prefill, rid, reuse):
                    yield delta
                return
            except EngineFailure as f:
                self._count(f)
                error = _client_error(f, prefill=f.engine_id == prefill)
                kind = retry_kind(f, prefill)
                if kind is None or kind in used:
                    raise error from None
                used.add(kind)
                if kind == "restore":
                    self.metrics.pd_restore_retries.inc()
                    reuse, pinned = False, (decode, prefill)
                elif kind == "prefill":
                    pinned = None
                    if self.candidates(PREFILL, no_prefill | {prefill}):
                        no_prefill.add(prefill)
                elif kind == "bus":  # lost in a NATS reconnect: the engines are fine
                    pinned = None
                else:
                    pinned = None
                    no_decode.add(decode)

    async def _route_pd(
        self,
        no_decode: set[str],
        no_prefill: set[str],
        pinned: tuple[str, str] | None,
        retry: bool,
    ) -> tuple[RouteChoice, RouteChoice] | None:
        decodes = self.candidates(DECODE, no_decode)
        prefills = self.candidates(PREFILL, no_prefill)
        if pinned is not None:
            decodes = [e for e in decodes if e.engine_id == pinned[0]]
            prefills = [e for e in prefills if e.engine_id == pinned[1]]
        if not decodes or not prefills:
            return None
        started = time.perf_counter()
        route = await self.router.choose_pd(
            decodes, prefills, self.spec.input_ids, self.spec.cache_salt, retry=retry
        )
        self.timings.route_s += time.perf_counter() - started
        self.timings.lookup_s += route[0].lookup_s  # one lookup for both choices
        return route

    async def _serve_pd(
        self, decode: str, prefill: str, rid: str, reuse: bool
    ) -> AsyncIterator[Delta]:
        ids = self.spec.input_ids
        sampling = self.spec.sampling(self.max_new_tokens, self.choice)
        self._pd = None
        with (
            self.table.lease(decode, len(ids) + self.max_new_tokens),
            contextlib.ExitStack() as prefill_lease,
        ):
            prefill_lease.enter_context(self.table.lease(prefill, len(ids)))
            async with EngineStream(
                self.hub, self.table, self.config, decode, rid, DECODE_ERRORS
            ) as stream:
                watch = stream.watch(prefill)
                request = DecodeAdmit(
                    request_id=rid,
                    input_ids=ids,
                    sampling=sampling,
                    reply_to=stream.reply_to,
                    cache_salt=self.spec.cache_salt,
                    reuse=reuse,
                    transfer_timeout_s=self.config.transfer_timeout_s,
                )
                self._dispatched()
                admitted = await admit(stream, request, self.config.pd_admit_timeout_s)
                self._pd = _PDAttempt(prefill, admitted)
                prefill_request = PrefillRequest(
                    request_id=rid,
                    input_ids=ids,
                    sampling=sampling,
                    cache_salt=self.spec.cache_salt,
                    decode_prefix_len=admitted.decode_prefix_len,
                    kv_subject=admitted.kv_subject,
                    reply_to=watch.subject,
                )
                await watch.tell(subjects.engine_prefill(prefill), prefill_request)
                async for delta in self._consume(stream):
                    prefill_lease.close()  # prefill's part ended with the first chunk
                    yield delta

    # ------------------------------------------------------------ both paths

    def _dispatched(self) -> None:
        timings = self.timings
        if timings.dispatched is None:
            timings.dispatched = time.perf_counter()
            self.outcome.queue_s = timings.dispatched - timings.arrived

    def _count(self, f: EngineFailure) -> None:
        self.metrics.bus_errors.labels(f.kind).inc()
        if f.engine_broken:
            self.table.mark_failed(f.engine_id, f.message, f.epoch)

    async def _consume(self, stream: EngineStream) -> AsyncIterator[Delta]:
        """The stream's chunks as deltas, until finished or a stop string matched."""
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
            if self.outcome.finish_reason is not None:
                self.timings.finished = time.perf_counter()
            yield Delta(self.assembler.release(), ids)
            if self.outcome.finish_reason is not None:
                return

    def _take(self, chunk: TokenChunk) -> list[int]:
        """Apply one chunk to the outcome; the ids taken (cut after a stop string)."""
        out = self.outcome
        if chunk.seq == 0:
            self._first(chunk)
        if out.ttft_s is None and chunk.token_ids:
            out.ttft_s = time.perf_counter() - self.timings.arrived
        out.spec_verify_ct = chunk.spec_verify_ct  # speculative decoding, so far
        out.spec_draft_tokens = chunk.spec_draft_tokens
        out.spec_accepted_tokens = chunk.spec_accepted_tokens
        taken = []
        for t in chunk.token_ids:
            taken.append(t)
            if self.assembler.push(t):
                break
        if self.spec.logprobs is not None:
            out.logprobs.extend(_logprobs(chunk, len(taken)))
        return taken

    def _first(self, chunk: TokenChunk) -> None:
        out = self.outcome
        out.prompt_tokens = chunk.prompt_tokens or len(self.spec.input_ids)
        out.cached_device = chunk.cached_device
        out.cached_host = chunk.cached_host
        out.cached_storage = chunk.cached_storage
        if self._pd is None:
            return
        info = PDInfo.from_first_chunk(chunk, self._pd.prefill_engine, self._pd.admitted)
        out.disaggregation = info  # the cached tokens above are the decode engine's reuse
        self.metrics.pd_transferred_tokens.inc(max(info.transferred_tokens, 0))
        self.metrics.pd_transferred_bytes.inc(max(info.transferred_bytes, 0))


def _logprobs(chunk: TokenChunk, num_taken: int) -> list[TokenLogprob]:
    """The first `num_taken` tokens' logprobs of `chunk` (None where the engine sent none)."""
    out = []
    for i, t in enumerate(chunk.token_ids[:num_taken]):
        lp = chunk.logprobs[i] if i < len(chunk.logprobs) else None
        ids = chunk.top_logprob_ids[i] if i < len(chunk.top_logprob_ids) else []
        lps = chunk.top_logprobs[i] if i < len(chunk.top_logprobs) else []
        out.append(TokenLogprob(t, lp, tuple(zip(ids, lps, strict=False))))
    return out


def _retriable(f: EngineFailure) -> bool:
    """Whether a failed colocated attempt may go to another engine: the engine failed (5xx)
    before the client saw anything, and the request did not crash it."""
    return f.status >= 500 and f.num_chunks == 0 and f.kind != "engine_crashed"


_CODE_SUFFIX = {  # EngineFailure.kind -> the error code, after "engine_" or "prefill_"
    "timeout": "timeout",
    "lost": "lost",
    "bad_message": "bad_reply",
    "engine_error": "error",
    "unavailable": "unavailable",
    "rejected": "rejected",
}
_CODES = {
    "bus": "bus_unavailable",
    "restore_failed": "restore_failed",
    "transfer_timeout": "kv_transfer_timeout",
    "transfer_failed": "kv_transfer_failed",
    "engine_crashed": "engine_crashed",
}


def _client_error(f: EngineFailure, prefill: bool = False) -> ApiError:
    """The error the client sees; `prefill`: the failure was a P/D prefill engine's."""
    code = _CODES.get(f.kind) or ("prefill_" if prefill else "engine_") + _CODE_SUFFIX[f.kind]
    retry_after = RETRY_AFTER_S if f.status == 503 else None
    return ApiError(f.status, f.message, code=code, retry_after_s=retry_after)
