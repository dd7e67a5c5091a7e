"""Sends a replay plan over HTTP at its times and keeps what every request got.

Requests leave in plan order, each at its `send_at_s` after the start and once fewer than
`max_concurrency` are in flight (so a capped replay runs late rather than out of order).
Streams are read event by event: TTFT is the time to the first event carrying tokens of
choice 0, each later such event adds one gap per token (the gap divided by its tokens, as
the router and `hicache-mesh bench` count; events read in one socket read share a time, so
their gaps are 0), E2E runs to the end of the body. A whole response has no TTFT or ITL in
the client, only E2E.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from tqdm import tqdm

from services.bench.client import sse_events
from services.replay.observation import CachedTokens, ChoiceOutput, Observation
from services.replay.plan import CHAT, GENERATE, Pace, ReplayRequest


@dataclass(frozen=True, slots=True)
class ClientConfig:
    base_url: str
    pace: Pace = field(default_factory=Pace)
    request_timeout_s: float = 600.0
    api_key: str | None = None
    show_progress: bool = True


@dataclass(frozen=True, slots=True)
class Replayed:
    """One request as the replay sent it and what came back."""

    line: int
    sent_s: float  # after the replay's start (its plan time, or later when capped)
    observation: Observation


class ReplayClient:
    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self._headers = {"Content-Type": "application/json"}
        if config.api_key:
            self._headers["Authorization"] = f"Bearer {config.api_key}"

    async def run(self, arm: str, requests: Sequence[ReplayRequest]) -> list[Replayed]:
        """Every request once; the results in plan order."""
        cfg = self.config
        limit = asyncio.Semaphore(cfg.pace.max_concurrency or max(1, len(requests)))
        results: list[Replayed | None] = [None] * len(requests)
        timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
        connector = aiohttp.TCPConnector(limit=cfg.pace.max_concurrency or 0)
        with tqdm(total=len(requests), desc=arm, unit="req", disable=not cfg.show_progress) as bar:
            async with (
                aiohttp.ClientSession(timeout=timeout, connector=connector) as session,
                asyncio.TaskGroup() as tg,
            ):
                t0 = time.perf_counter()
                for i, req in enumerate(requests):
                    delay = t0 + req.send_at_s - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    await limit.acquire()
                    tg.create_task(self._one(session, req, i, t0, results, limit, bar))
        done = [r for r in results if r is not None]
        assert len(done) == len(requests), "a request task ended without a result"
        return done

    async def _one(
        self,
        session: aiohttp.ClientSession,
        req: ReplayRequest,
        index: int,
        t0: float,
        results: list[Replayed | None],
        limit: asyncio.Semaphore,
        bar: tqdm[Any],
    ) -> None:
        try:
            sent = time.perf_counter()
            observation = await self.send(session, req)
            results[index] = Replayed(req.line, sent - t0, observation)
            bar.update(1)
        finally:
            limit.release()

    async def send(self, session: aiohttp.ClientSession, req: ReplayRequest) -> Observation:
        """One request; never raises for what the server does (status 0: no answer)."""
        sent = time.perf_counter()
        try:
            async with session.post(
                f"{self.config.base_url}{req.endpoint}",
                data=orjson.dumps(req.body),
                headers=self._headers,
            ) as resp:
                if req.stream and resp.status == 200:
                    reader = StreamReader(req.endpoint, sent)
                    async for now, payload in sse_events(resp):
                        reader.consume(payload, now)
                    return reader.observation(time.perf_counter() - sent)
                raw = await resp.read()
                return whole_observation(req.endpoint, resp.status, raw, time.perf_counter() - sent)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            return Observation(status=0, error=f"{type(e).__name__}: {e}")


def _error_message(data: Any) -> str:
    err = data.get("error") if isinstance(data, Mapping) else None
    if isinstance(err, Mapping):
        return str(err.get("message", err))
    return str(err if err is not None else data)[:300]


def _ids(value: Any) -> tuple[int, ...]:
    return tuple(int(t) for t in value) if isinstance(value, list) else ()


def whole_observation(endpoint: str, status: int, raw: bytes, e2e_s: float) -> Observation:
    """A non-streamed answer (or a stream refused before it started)."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return Observation(status, e2e_s=e2e_s, error=f"body is not JSON: {raw[:120]!r}")
    if status != 200:
        return Observation(status, e2e_s=e2e_s, error=_error_message(data))
    if not isinstance(data, Mapping):
        return Observation(status, e2e_s=e2e_s, error=f"body is not an object: {raw[:120]!r}")
    if endpoint == GENERATE:
        meta = data.get("meta_info") or {}
        choice = ChoiceOutput(
            _ids(data.get("output_ids")), data.get("text"), meta.get("finish_reason")
        )
        return Observation(
            status,
            (choice,),
            meta.get("prompt_tokens"),
            CachedTokens.from_meta_info(meta),
            e2e_s=e2e_s,
        )
    choices = []
    for c in sorted(data.get("choices") or [], key=lambda c: c.get("index", 0)):
        text = (c.get("message") or {}).get("content") if endpoint == CHAT else c.get("text")
        choices.append(ChoiceOutput(_ids(c.get("token_ids")), text, c.get("finish_reason")))
    usage = data.get("usage")
    return Observation(
        status,
        tuple(choices),
        usage.get("prompt_tokens") if isinstance(usage, Mapping) else None,
        CachedTokens.from_usage(usage) if isinstance(usage, Mapping) else None,
        e2e_s=e2e_s,
    )


@dataclass(slots=True)
class _Choice:
    ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None


class StreamReader:
    """What one SSE answer delivered so far; times from `time.perf_counter`."""

    def __init__(self, endpoint: str, sent_at: float) -> None:
        self.endpoint = endpoint
        self.sent_at = sent_at
        self.choices: dict[int, _Choice] = {}
        self.ttft_s: float | None = None
        self.itl_s: list[float] = []
        self.last_token_at = 0.0
        self.prompt_tokens: int | None = None
        self.cached: CachedTokens | None = None
        self.error: str | None = None
        self.done = False

    def consume(self, payload: bytes, now: float) -> None:
        """One `data:` payload that arrived at `now`."""
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self.error = f"event is not JSON: {payload[:120]!r}"
            return
        if not isinstance(event, Mapping):
            self.error = f"event is not an object: {payload[:120]!r}"
        elif "error" in event:
            self.error = _error_message(event)
        elif self.endpoint == GENERATE:
            self._generate_event(event, now)
        else:
            self._openai_event(event, now)

    def _openai_event(self, event: Mapping[str, Any], now: float) -> None:
        for c in event.get("choices") or []:
            index = int(c.get("index", 0))
            choice = self.choices.setdefault(index, _Choice())
            ids = _ids(c.get("token_ids"))
            text = (c.get("delta") or {}).get("content") if self.endpoint == CHAT else c.get("text")
            choice.ids += ids
            choice.text.append(text or "")
            if c.get("finish_reason") is not None:
                choice.finish_reason = c["finish_reason"]
            if index == 0:
                self._tick(len(ids), now)
        usage = event.get("usage")
        if isinstance(usage, Mapping):
            self.prompt_tokens = usage.get("prompt_tokens")
            self.cached = CachedTokens.from_usage(usage)

    def _generate_event(self, event: Mapping[str, Any], now: float) -> None:
        """`/generate` streams cumulative `text` and `output_ids`."""
        choice = self.choices.setdefault(0, _Choice())
        ids = _ids(event.get("output_ids"))
        self._tick(len(ids) - len(choice.ids), now)
        choice.ids, choice.text = list(ids), [str(event.get("text") or "")]
        meta = event.get("meta_info") or {}
        choice.finish_reason = meta.get("finish_reason")
        self.prompt_tokens = meta.get("prompt_tokens")
        self.cached = CachedTokens.from_meta_info(meta)

    def _tick(self, num_tokens: int, now: float) -> None:
        if num_tokens <= 0:
            return
        if self.ttft_s is None:
            self.ttft_s = now - self.sent_at
        else:
            self.itl_s += [(now - self.last_token_at) / num_tokens] * num_tokens
        self.last_token_at = now

    def observation(self, e2e_s: float) -> Observation:
        error = self.error
        if error is None and not self.done:
            error = "the stream ended without [DONE]"
        choices = tuple(
            ChoiceOutput(tuple(c.ids), "".join(c.text), c.finish_reason)
            for _, c in sorted(self.choices.items())
        )
        return Observation(
            200,
            choices,
            self.prompt_tokens,
            self.cached,
            self.ttft_s,
            tuple(self.itl_s),
            e2e_s,
            error,
        )
