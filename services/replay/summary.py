"""The figures of a replay: per arm against the recording, arm against arm, and the audit of
the recording's index predictions.

Latency percentiles (p50, p90, p99; numpy's linear interpolation) compare like with like:
a metric counts the requests for which both sides measured it, both answered 200. The
recording measured in the router from reading the request; the replay measures in the
client (so it adds the HTTP round trip). TTFT and ITL come from streamed requests only (a
whole response has none in the client). A regression is the replayed p50 above the
recorded p50 by more than the metric's threshold, in percent.

Hit rates per tier are cached tokens over prompt tokens, over the requests both sides
answered 200 with usage (a stream that did not ask for usage reports none).

A mesh the replay started and measured with no warmup is cold: its first requests pay for
what a serving mesh paid long ago (lazy initialisation, allocator growth, first kernels),
while a recording is usually made on a mesh that had been serving. A regression gate on
such an arm says so, in its failure and in the report's notes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from services.bench.report import percent_change
from services.replay.client import Replayed
from services.replay.compare import Mismatch, Verdict, check
from services.replay.observation import CachedTokens, Observation
from services.replay.plan import Pace, ReplayRequest
from services.replay.recording import RecordedRequest, Recording

METRICS = ("TTFT", "ITL", "E2E")


def parse_percent(text: str) -> float:
    """`10%` or `10` -> 10.0 (percent); the type of the `--max-*-regression` flags."""
    value = text.strip().removesuffix("%")
    try:
        pct = float(value)
    except ValueError:
        raise ValueError(f"expected a percentage such as 10%, got {text!r}") from None
    if not pct >= 0:
        raise ValueError(f"a regression threshold must be >= 0%, got {text!r}")
    return pct


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Allowed rise of the replayed p50 over the recorded one, in percent (None: unchecked)."""

    ttft_pct: float | None = None
    itl_pct: float | None = None
    e2e_pct: float | None = None

    def of(self, metric: str) -> float | None:
        return {"TTFT": self.ttft_pct, "ITL": self.itl_pct, "E2E": self.e2e_pct}[metric]

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.ttft_pct, self.itl_pct, self.e2e_pct))


@dataclass(frozen=True, slots=True)
class Percentiles:
    count: int
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles | None:
        if not values:
            return None
        p50, p90, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 90, 99])
        return cls(len(values), float(p50), float(p90), float(p99))


@dataclass(frozen=True, slots=True)
class LatencyRow:
    """One metric, in seconds, over the same requests on both sides."""

    metric: str
    recorded: tuple[float, ...]
    replayed: tuple[float, ...]

    @property
    def recorded_pct(self) -> Percentiles | None:
        return Percentiles.of(self.recorded)

    @property
    def replayed_pct(self) -> Percentiles | None:
        return Percentiles.of(self.replayed)

    @property
    def p50_change(self) -> float | None:
        """Replayed p50 against recorded p50, in percent (positive: slower)."""
        a, b = self.recorded_pct, self.replayed_pct
        return None if a is None or b is None else percent_change(a.p50, b.p50)


def latency_rows(pairs: Iterable[tuple[Observation, Observation]]) -> tuple[LatencyRow, ...]:
    """TTFT, ITL and E2E over (recorded, replayed) answers."""
    values: dict[str, tuple[list[float], list[float]]] = {m: ([], []) for m in METRICS}
    for rec, got in pairs:
        if not (rec.ok and got.ok):
            continue
        if rec.ttft_s is not None and got.ttft_s is not None:
            values["TTFT"][0].append(rec.ttft_s)
            values["TTFT"][1].append(got.ttft_s)
        if rec.itl_s and got.itl_s:
            values["ITL"][0].extend(rec.itl_s)
            values["ITL"][1].extend(got.itl_s)
        if rec.e2e_s is not None and got.e2e_s is not None:
            values["E2E"][0].append(rec.e2e_s)
            values["E2E"][1].append(got.e2e_s)
    return tuple(LatencyRow(m, tuple(a), tuple(b)) for m, (a, b) in values.items())


def regressions(rows: Sequence[LatencyRow], thresholds: Thresholds) -> tuple[str, ...]:
    """One line per metric whose p50 rose beyond its threshold."""
    out = []
    for row in rows:
        limit, change = thresholds.of(row.metric), row.p50_change
        if limit is not None and change is not None and change > limit:
            a, b = row.recorded_pct, row.replayed_pct
            assert a is not None and b is not None
            out.append(
                f"{row.metric} p50 {b.p50 * 1e3:.2f} ms replayed vs {a.p50 * 1e3:.2f} ms "
                f"recorded: {change:+.1f}% (limit +{limit:g}%)"
            )
    return tuple(out)


@dataclass(frozen=True, slots=True)
class CacheTotals:
    """Cached tokens per tier and the prompt tokens they are part of."""

    prompt_tokens: int = 0
    cached: CachedTokens = field(default_factory=CachedTokens)

    def rate(self, tier: str) -> float:
        return self.cached.tier(tier) / self.prompt_tokens if self.prompt_tokens else 0.0

    def add(self, obs: Observation) -> CacheTotals:
        assert obs.cached is not None and obs.prompt_tokens is not None
        return CacheTotals(self.prompt_tokens + obs.prompt_tokens, self.cached.plus(obs.cached))


def _has_usage(obs: Observation) -> bool:
    return obs.ok and obs.cached is not None and obs.prompt_tokens is not None


@dataclass(frozen=True, slots=True)
class ArmTarget:
    """Where an arm was replayed."""

    description: str  # the URL, or the `hicache-mesh up` command of the mesh it started
    fresh: bool  # a mesh started for this replay (it served nothing before)
    num_warmup: int = 0  # requests sent unmeasured before the measured run

    @property
    def cold(self) -> bool:
        """Measured from its very first request: a fresh mesh without a warmup."""
        return self.fresh and self.num_warmup == 0

    def describe(self) -> str:
        warm = f", {self.num_warmup} warmup requests" if self.num_warmup else ""
        kind = "started for the replay" if self.fresh else "running"
        return f"`{self.description}` ({kind}{warm})"


COLD_GATE = (
    "a freshly started mesh measured without a warmup, against a recording of a mesh that "
    "had been serving: its first requests pay start-up costs (--warmup N sends N unmeasured)"
)


@dataclass(frozen=True, slots=True)
class ArmReport:
    """One arm's replay against the recording."""

    arm: str
    target: ArmTarget
    replayed: tuple[Replayed, ...]  # in plan order
    verdicts: tuple[Verdict, ...]  # against the recording, in plan order
    latency: tuple[LatencyRow, ...]
    recorded_cache: CacheTotals  # over the requests both sides answered with usage
    replayed_cache: CacheTotals
    missing_vs_recording: CachedTokens  # cached in the recording, not in this replay
    regressions: tuple[str, ...]

    @property
    def num_compared(self) -> int:
        return sum(v.outputs_compared for v in self.verdicts)

    def mismatches(self, strict_cache: bool) -> list[Mismatch]:
        return [m for v in self.verdicts if (m := v.failed(strict_cache)) is not None]

    @property
    def cache_differences(self) -> list[Mismatch]:
        return [v.cache for v in self.verdicts if v.cache is not None]

    @property
    def duration_s(self) -> float:
        return max((r.sent_s + (r.observation.e2e_s or 0.0) for r in self.replayed), default=0.0)


def arm_report(
    arm: str,
    target: ArmTarget,
    requests: Sequence[ReplayRequest],
    replayed: Sequence[Replayed],
    by_line: dict[int, RecordedRequest],
    thresholds: Thresholds,
) -> ArmReport:
    verdicts, pairs = [], []
    recorded_cache, replayed_cache, missing = CacheTotals(), CacheTotals(), CachedTokens()
    for req, got in zip(requests, replayed, strict=True):
        rec = by_line[req.line]
        verdicts.append(check(rec, req.arrival_s, got.observation))
        if rec.reference is None:
            continue
        pairs.append((rec.reference, got.observation))
        if _has_usage(rec.reference) and _has_usage(got.observation):
            recorded_cache = recorded_cache.add(rec.reference)
            replayed_cache = replayed_cache.add(got.observation)
            assert rec.reference.cached is not None and got.observation.cached is not None
            missing = missing.plus(rec.reference.cached.minus(got.observation.cached))
    rows = latency_rows(pairs)
    return ArmReport(
        arm=arm,
        target=target,
        replayed=tuple(replayed),
        verdicts=tuple(verdicts),
        latency=rows,
        recorded_cache=recorded_cache,
        replayed_cache=replayed_cache,
        missing_vs_recording=missing,
        regressions=tuple(
            f"{r} ({COLD_GATE})" if target.cold else r for r in regressions(rows, thresholds)
        ),
    )


@dataclass(frozen=True, slots=True)
class ArmDiff:
    """`arm`'s answers against `base`'s, request by request."""

    base: str
    arm: str
    verdicts: tuple[Verdict, ...]
    missing: CachedTokens  # cached in `base`, not in `arm` (summed per request and tier)
    extra: CachedTokens  # cached in `arm`, not in `base`

    @property
    def num_compared(self) -> int:
        return sum(v.outputs_compared for v in self.verdicts)

    def mismatches(self, strict_cache: bool) -> list[Mismatch]:
        return [m for v in self.verdicts if (m := v.failed(strict_cache)) is not None]


def arm_diff(
    base: ArmReport,
    other: ArmReport,
    requests: Sequence[ReplayRequest],
    by_line: dict[int, RecordedRequest],
) -> ArmDiff:
    verdicts = []
    missing, extra = CachedTokens(), CachedTokens()
    for req, a, b in zip(requests, base.replayed, other.replayed, strict=True):
        verdicts.append(check(by_line[req.line], req.arrival_s, b.observation, a.observation))
        if a.observation.cached is not None and b.observation.cached is not None:
            missing = missing.plus(a.observation.cached.minus(b.observation.cached))
            extra = extra.plus(b.observation.cached.minus(a.observation.cached))
    return ArmDiff(base.arm, other.arm, tuple(verdicts), missing, extra)


@dataclass(frozen=True, slots=True)
class Staleness:
    """The router's predicted prefix against the cached tokens delivered, per request
    (`delivered - predicted`: negative when the index promised more than the engine had)."""

    errors: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.errors)

    @property
    def num_mispredicted(self) -> int:
        return sum(e != 0 for e in self.errors)

    @property
    def num_over(self) -> int:
        """Predicted more than delivered: the index held pages the engine no longer had."""
        return sum(e < 0 for e in self.errors)

    @property
    def num_under(self) -> int:
        return sum(e > 0 for e in self.errors)

    @property
    def mean_error(self) -> float:
        return float(np.mean(self.errors)) if self.errors else 0.0

    @property
    def mean_abs_error(self) -> float:
        return float(np.mean(np.abs(self.errors))) if self.errors else 0.0


def staleness(recording: Recording) -> Staleness:
    errors = []
    for rec in recording.requests:
        ref = rec.reference
        if rec.predicted_cached_tokens is None or ref is None or not _has_usage(ref):
            continue
        assert ref.cached is not None
        errors.append(ref.cached.total - rec.predicted_cached_tokens)
    return Staleness(tuple(errors))


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """Everything a replay found: what the report and the exit status are made of."""

    recording: Recording
    num_requests: int  # replayed (`--num-requests` may cut the recording)
    pace: Pace
    strict_cache: bool
    thresholds: Thresholds
    arms: tuple[ArmReport, ...]
    diffs: tuple[ArmDiff, ...]  # every arm after the first against the first
    staleness: Staleness

    def failures(self) -> list[str]:
        """Why the replay fails (empty: it passes): per arm its first mismatch against the
        recording, per pair of arms the first difference, each regression."""
        out = []
        for a in self.arms:
            found = a.mismatches(self.strict_cache)
            if found:
                out.append(
                    f"arm {a.arm}: {len(found)} of {len(a.verdicts)} requests differ from the "
                    f"recording; first: {found[0].describe()}"
                )
            out += [f"arm {a.arm}: regression: {r}" for r in a.regressions]
        for d in self.diffs:
            found = d.mismatches(self.strict_cache)
            if found:
                out.append(
                    f"arm {d.arm} vs arm {d.base}: {len(found)} of {len(d.verdicts)} requests "
                    f"differ; first: {found[0].describe(d.base, d.arm)}"
                )
        return out

    def notes(self) -> list[str]:
        """What the reader must know to weigh the verdict: a latency gate on a cold arm."""
        if not self.thresholds.any:
            return []
        return [
            f"arm {a.arm}: the p50 regression limits compare {COLD_GATE}"
            for a in self.arms
            if a.target.cold
        ]


def summarize(
    recording: Recording,
    records: Sequence[RecordedRequest],
    requests: Sequence[ReplayRequest],
    by_arm: Mapping[str, tuple[ArmTarget, Sequence[Replayed]]],
    pace: Pace,
    strict_cache: bool,
    thresholds: Thresholds,
) -> ReplayResult:
    """Every arm (name -> (target, results in plan order)) against the recording's
    `records`, and every later arm against the first."""
    by_line = {r.line: r for r in records}
    reports = [
        arm_report(name, target, requests, replayed, by_line, thresholds)
        for name, (target, replayed) in by_arm.items()
    ]
    diffs = [arm_diff(reports[0], other, requests, by_line) for other in reports[1:]]
    return ReplayResult(
        recording=recording,
        num_requests=len(records),
        pace=pace,
        strict_cache=strict_cache,
        thresholds=thresholds,
        arms=tuple(reports),
        diffs=tuple(diffs),
        staleness=staleness(recording),
    )
