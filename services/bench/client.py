"""The load generator: conversations against `/v1/completions`, streamed, over HTTP only.

Conversations start at Poisson arrivals (`request_rate` per second; `inf` starts them all
at once) or at given times (a trace's timestamps), and at most `max_concurrency` run at a
time; the turns of one conversation are sequential, each prompt built from the answers the
server gave before. A request that
fails ends its conversation (its later turns cannot be built).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from tqdm import tqdm

from services.bench.dataset import Conversation
from services.bench.records import CacheUsage, RequestResult

ENGINE_HEADER = "X-Hicache-Engine"


@dataclass(frozen=True, slots=True)
class ClientConfig:
    base_url: str
    max_concurrency: int | None = None  # conversations at once; None = no limit
    request_rate: float = math.inf  # conversation starts per second
    seed: int = 1  # of the arrival times
    request_timeout_s: float = 600.0
    api_key: str | None = None
    show_progress: bool = True
    cache_salt: str | None = None  # sent with every request (a round's own cache)

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be positive")
        if not self.request_rate > 0:
            raise ValueError("--request-rate must be positive (inf: all at once)")


@dataclass(slots=True)
class StreamState:
    """What one streamed response has delivered so far; times from `time.perf_counter`."""

    sent_at: float
    token_ids: list[int] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)  # one gap per token after the first
    ttft: float | None = None
    last_token_at: float = 0.0
    usage: dict[str, Any] | None = None
    error: str | None = None
    error_code: str | None = None  # the error's kind: "HTTP 503 no_live_engine", ...
    done: bool = False

    def consume(self, payload: bytes, now: float) -> None:
        """One `data:` payload that arrived at `now`. An event with n tokens after the first
        token event adds n gaps of (time since the previous token event) / n."""
        if payload == b"[DONE]":
            self.done = True
            return
        event = json.loads(payload)
        if "error" in event:
            err = event["error"]
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)
            code = err.get("code") or err.get("type") if isinstance(err, dict) else None
            self.error_code = "stream error" + (f" {code}" if code else "")
            return
        choices = event.get("choices") or [{}]
        ids = [int(t) for t in choices[0].get("token_ids") or []]
        if ids:
            if self.ttft is None:
                self.ttft = now - self.sent_at
            else:
                gap = (now - self.last_token_at) / len(ids)
                self.itl.extend([gap] * len(ids))
            self.last_token_at = now
            self.token_ids += ids
        if event.get("usage"):
            self.usage = event["usage"]


def http_error(status: int, text: str) -> tuple[str, str]:
    """(kind, message) of a non-200 answer: the status and the OpenAI-style error's code, and
    its message (else the start of the body)."""
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return f"HTTP {status}", text[:200]
    code = err.get("code") or err.get("type")
    return f"HTTP {status}" + (f" {code}" if code else ""), str(err.get("message", ""))[:300]


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[float, bytes]]:
    """The `data:` payloads of an SSE response, each with the time it arrived."""
    buf = b""
    async for chunk in resp.content.iter_any():
        now = time.perf_counter()
        buf += chunk
        while b"\n\n" in buf:
            block, buf = buf.split(b"\n\n", 1)
            for line in block.splitlines():
                if line.startswith(b"data:"):
                    yield now, line[len(b"data:") :].strip()


class BenchClient:
    """Runs one arm: every conversation once, reporting each request as it finishes."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self._headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}

    async def run(
        self,
        arm: str,
        conversations: Sequence[Conversation],
        on_result: Callable[[RequestResult], None],
        start_times: Sequence[float] | None = None,
        round: int = 0,
    ) -> None:
        """Every conversation once, as round `round` of `arm`. `start_times`: seconds after the
        arm's start at which each conversation starts (a trace's timestamps, in order); None:
        `request_rate` arrivals."""
        cfg = self.config
        if start_times is not None and len(start_times) != len(conversations):
            raise ValueError(
                f"{len(start_times)} start times for {len(conversations)} conversations"
            )
        limit = asyncio.Semaphore(cfg.max_concurrency or max(1, len(conversations)))
        arrivals = random.Random(cfg.seed)
        timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
        total = sum(c.num_turns for c in conversations)
        t0 = time.perf_counter()
        desc = f"{arm} #{round + 1}"
        with tqdm(total=total, desc=desc, unit="req", disable=not cfg.show_progress) as bar:

            def report(result: RequestResult) -> None:
                bar.update(1)
                on_result(dataclasses.replace(result, round=round))

            async with aiohttp.ClientSession(timeout=timeout) as session, asyncio.TaskGroup() as tg:
                for i, conv in enumerate(conversations):
                    if start_times is not None:
                        await asyncio.sleep(max(0.0, start_times[i] - (time.perf_counter() - t0)))
                    elif i and math.isfinite(cfg.request_rate):
                        await asyncio.sleep(arrivals.expovariate(cfg.request_rate))
                    tg.create_task(
                        self._conversation(session, arm, conv, limit, t0, report, bar.update)
                    )

    async def warmup(self, conversations: Sequence[Conversation], num_requests: int) -> int:
        """Send the first turns of the first `num_requests` conversations (cycled) at once,
        unmeasured; returns how many failed."""
        if num_requests <= 0 or not conversations:
            return 0
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s)
        convs = [conversations[i % len(conversations)] for i in range(num_requests)]
        t0 = time.perf_counter()
        async with aiohttp.ClientSession(timeout=timeout) as session:
            results = await asyncio.gather(
                *(self._request(session, "warmup", c, 0, c.prompt(0, []), t0) for c in convs)
            )
        return sum(not r.ok for r, _ in results)

    async def _conversation(
        self,
        session: aiohttp.ClientSession,
        arm: str,
        conv: Conversation,
        limit: asyncio.Semaphore,
        t0: float,
        report: Callable[[RequestResult], None],
        skip: Callable[[int], object],
    ) -> None:
        async with limit:
            answers: list[list[int]] = []
            for turn in range(conv.num_turns):
                prompt = conv.prompt(turn, answers)
                result, answer = await self._request(session, arm, conv, turn, prompt, t0)
                report(result)
                if not result.ok:
                    skip(conv.num_turns - turn - 1)  # the turns that cannot be built
                    return
                answers.append(answer)

    async def _request(
        self,
        session: aiohttp.ClientSession,
        arm: str,
        conv: Conversation,
        turn: int,
        prompt: list[int],
        t0: float,
    ) -> tuple[RequestResult, list[int]]:
        body = {
            "prompt": prompt,
            "max_tokens": conv.output_lens[turn],
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},  # the cached tokens per turn
        }
        if self.config.cache_salt is not None:
            body["cache_salt"] = self.config.cache_salt
        engine: str | None = None
        stream = StreamState(sent_at=time.perf_counter())
        try:
            async with session.post(
                f"{self.config.base_url}/v1/completions", json=body, headers=self._headers
            ) as resp:
                engine = resp.headers.get(ENGINE_HEADER)
                if resp.status != 200:
                    stream.error_code, stream.error = http_error(resp.status, await resp.text())
                else:
                    async for now, payload in sse_events(resp):
                        stream.consume(payload, now)
                    if stream.error is None and not stream.done:
                        stream.error_code = "truncated stream"
                        stream.error = "the stream ended without [DONE]"
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            stream.error_code, stream.error = type(e).__name__, str(e) or repr(e)
        ended_at = time.perf_counter()
        result = RequestResult(
            arm=arm,
            conversation=conv.conversation_id,
            group=conv.group_id,
            turn=turn + 1,
            prompt_len=len(prompt),
            output_len=len(stream.token_ids),
            start=stream.sent_at - t0,
            ttft=stream.ttft,
            latency=ended_at - stream.sent_at,
            itl=tuple(stream.itl),
            cache=CacheUsage.from_usage(stream.usage),
            engine=engine,
            error=stream.error,
            error_code=stream.error_code,
        )
        return result, stream.token_ids
