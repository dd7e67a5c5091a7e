"""What one generation produced (`Outcome`, its `Delta`s and `TokenLogprob`s) and where its
time went in the router (`Timings`, sent as the `Server-Timing` header)."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.disagg import PDInfo


@dataclass(frozen=True, slots=True)
class Delta:
    """New output since the last one: released text, and the ids that arrived."""

    text: str
    token_ids: list[int]


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log-probability, and the top tokens' (as the engine sent them;
    `logprob` None for a P/D request's first token, which prefill sampled)."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass(slots=True)
class Outcome:
    """What the request produced so far; final when `Generation.run` returns."""

    request_id: str
    engine_id: str = ""  # the engine that generated (a P/D request's decode engine)
    model: str = ""  # the model that engine serves
    prompt_tokens: int = 0
    # prompt tokens the engine reused from its cache, by tier (P/D: the decode engine's own
    # reuse, whose KV did not move; what prefill skipped is in `disaggregation`)
    cached_device: int = 0
    cached_host: int = 0
    cached_storage: int = 0  # ... read from external storage for this request
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" once finished
    ttft_s: float | None = None
    queue_s: float | None = None  # arrival until first sent to an engine (routing, lookup)
    route_reason: str = ""
    # the prompt tokens the index said the chosen engine holds (P/D: the decode engine, whose
    # reuse `cached_*` report); None when the router did not ask it (one candidate, Redis down)
    predicted_cached_tokens: int | None = None
    disaggregation: PDInfo | None = None  # set by a P/D request's first chunk
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when asked, one per output id
    # speculative decoding on the engine: verify rounds, draft tokens proposed and accepted
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def cached_tokens(self) -> int:
        return self.cached_device + self.cached_host + self.cached_storage


@dataclass(slots=True)
class Timings:
    """Where one request's time went in the router, in `time.perf_counter()` seconds (uvloop's
    `loop.time()` ticks in whole milliseconds). Sent as the `Server-Timing` header of a
    generation response (`server_timing`), and the source of the queue, TTFT and E2E metrics.
    """

    arrived: float  # the handler started: the body has been read
    parse_s: float = 0.0  # JSON, validation, tokenization, limits
    route_s: float = 0.0  # page hashes, the Redis lookup, the pick (every attempt); the
    # request's encoding too where it overlaps the lookup (colocated)
    lookup_s: float = 0.0  # of `route_s`: from each Redis lookup's send to its answer
    dispatched: float | None = None  # the first request to an engine is about to be sent
    finished: float | None = None  # the last chunk was taken

    @property
    def engine_s(self) -> float | None:
        """First dispatch to the last chunk: the round trip a client that sends the request
        to the engine subject itself waits (publish, the engine, the replies; the encoding of
        a P/D request too, whose first message is a question to the decode engine)."""
        if self.dispatched is None or self.finished is None:
            return None
        return self.finished - self.dispatched

    def server_timing(self, now: float) -> str:
        """The `Server-Timing` header value (milliseconds); `total` is arrival to `now`."""
        parts = [
            f"parse;dur={1e3 * self.parse_s:.3f}",
            f"route;dur={1e3 * self.route_s:.3f}",
            f"lookup;dur={1e3 * self.lookup_s:.3f}",
        ]
        engine_s = self.engine_s
        if engine_s is not None:
            parts.append(f"engine;dur={1e3 * engine_s:.3f}")
        parts.append(f"total;dur={1e3 * (now - self.arrived):.3f}")
        return ", ".join(parts)


def parse_server_timing(header: str) -> dict[str, float]:
    """The stages of a `Server-Timing` value written by `Timings.server_timing`, in order:
    name -> milliseconds (for clients and benchmarks that read the header)."""
    out = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        out[name] = float(dur)
    return out
