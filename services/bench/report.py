"""Summaries of an arm's requests, the comparison of two arms, and the plot.

An arm runs in interleaved rounds (`services.bench.cli`). Each figure is computed over every
round's requests together (percentiles over all of them, throughput as all output tokens over
the rounds' summed durations, token counts summed), and, with more than one round, followed by
its spread: `[min..max]` of the figure computed on each round alone. A comparison of two arms
pairs their rounds: the spread of a change is over the per-round changes, so load that drifts
between rounds moves both arms of a round alike and shows as spread, not as a difference.
An arm with failed requests says why: each distinct failure ("HTTP 504 kv_transfer_timeout:
message", an exception) with its count.

Percentiles interpolate linearly between ranks (numpy's default). Times print in ms.
Cached tokens "on prefill" are the P/D block's prefill counts when the server sends one,
else the response's own `cached_tokens_by_tier` (a colocated engine does the prefill);
"on decode" and the prefill -> decode transfer exist only with the P/D block. A trace's arm
also shows the offline upper bound of cached tokens (`services.bench.mooncake`) and the
share of it cached on prefill.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from services.bench.records import RequestResult


@dataclass(frozen=True, slots=True)
class Stats:
    mean: float
    median: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats | None:
        if not values:
            return None
        a = np.asarray(values, dtype=np.float64)
        return cls(float(a.mean()), float(np.median(a)), float(np.percentile(a, 99)))


@dataclass(frozen=True, slots=True)
class TierSums:
    device: int
    host: int
    storage: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.storage


@dataclass(frozen=True, slots=True)
class ArmSummary:
    arm: str
    num_requests: int  # completed
    num_failed: int
    duration_s: float  # arm start to the last response
    ttft_ms: Stats | None
    itl_ms: Stats | None
    output_tokens: int
    cached_prefill: TierSums
    cached_decode: TierSums | None  # None without the P/D block
    transferred_tokens: int | None  # prefill -> decode; None without the P/D block
    transferred_bytes: int | None
    upper_bound: int | None = None  # offline bound of cached prompt tokens (a trace's)
    failures: tuple[tuple[str, int], ...] = ()  # (why, how many), most frequent first

    @property
    def bound_ratio(self) -> float | None:
        """Cached on prefill over the upper bound; None without a bound or when it is 0."""
        if not self.upper_bound:
            return None
        return self.cached_prefill.total / self.upper_bound

    @property
    def output_throughput(self) -> float:
        """Output tokens per second."""
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0


def summarize(
    arm: str, results: Sequence[RequestResult], upper_bound: int | None = None
) -> ArmSummary:
    ok = [r for r in results if r.ok]
    disagg = [r.cache.disaggregation for r in ok if r.cache.disaggregation is not None]
    if disagg:
        prefill = TierSums(
            sum(d.prefill_cached_device for d in disagg),
            sum(d.prefill_cached_host for d in disagg),
            sum(d.prefill_cached_storage for d in disagg),
        )
        decode: TierSums | None = TierSums(
            sum(d.decode_cached_device for d in disagg), sum(d.decode_cached_host for d in disagg)
        )
    else:
        prefill = TierSums(
            sum(r.cache.cached_device for r in ok),
            sum(r.cache.cached_host for r in ok),
            sum(r.cache.cached_storage for r in ok),
        )
        decode = None
    return ArmSummary(
        arm=arm,
        num_requests=len(ok),
        num_failed=len(results) - len(ok),
        duration_s=_duration(results),
        ttft_ms=Stats.of([r.ttft * 1e3 for r in ok if r.ttft is not None]),
        itl_ms=Stats.of([gap * 1e3 for r in ok for gap in r.itl]),
        output_tokens=sum(r.output_len for r in ok),
        cached_prefill=prefill,
        cached_decode=decode,
        transferred_tokens=sum(d.transferred_tokens for d in disagg) if disagg else None,
        transferred_bytes=sum(d.transferred_bytes for d in disagg) if disagg else None,
        upper_bound=upper_bound,
        failures=tuple(Counter(f for r in results if (f := r.failure) is not None).most_common()),
    )


def _duration(results: Sequence[RequestResult]) -> float:
    """Summed over rounds: each round's start to its last response."""
    ends: dict[int, float] = {}
    for r in results:
        ends[r.round] = max(ends.get(r.round, 0.0), r.start + r.latency)
    return sum(ends.values())


@dataclass(frozen=True, slots=True)
class Spread:
    """The least and the greatest of one figure's per-round values."""

    low: float
    high: float
    num_rounds: int  # rounds that had the figure

    @classmethod
    def of(cls, values: Sequence[float | None]) -> Spread | None:
        """None with fewer than two rounds that have the figure (no spread to show)."""
        got = [v for v in values if v is not None]
        return cls(min(got), max(got), len(got)) if len(got) > 1 else None


@dataclass(frozen=True, slots=True)
class ArmRounds:
    """An arm over its interleaved rounds: the figures over all of them, and each round's."""

    pooled: ArmSummary
    rounds: tuple[ArmSummary, ...]  # in round order

    @property
    def arm(self) -> str:
        return self.pooled.arm

    def spread(self, figure: Callable[[ArmSummary], float | None]) -> Spread | None:
        return Spread.of([figure(r) for r in self.rounds])


def summarize_rounds(
    arm: str, results: Sequence[RequestResult], upper_bound: int | None = None
) -> ArmRounds:
    """`results` of every round of `arm`; `upper_bound`: a trace's bound for one round."""
    by_round: dict[int, list[RequestResult]] = defaultdict(list)
    for r in results:
        by_round[r.round].append(r)
    rounds = tuple(summarize(arm, by_round[k], upper_bound) for k in sorted(by_round))
    total_bound = None if upper_bound is None else upper_bound * max(1, len(rounds))
    return ArmRounds(summarize(arm, results, total_bound), rounds)


def percent_change(before: float | None, after: float | None) -> float | None:
    """`after` relative to `before`, in percent; None when either is missing or before is 0."""
    if before is None or after is None or before == 0:
        return None
    return (after - before) / before * 100.0


@dataclass(frozen=True, slots=True)
class Comparison:
    """`arm` against `base`, in percent (negative = lower)."""

    base: str
    arm: str
    median_ttft_change: float | None
    mean_ttft_change: float | None
    transfer_reduction: float | None  # of the tokens moved prefill -> decode
    throughput_change: float | None


def compare(base: ArmSummary, other: ArmSummary) -> Comparison:
    reduction = percent_change(base.transferred_tokens, other.transferred_tokens)
    return Comparison(
        base=base.arm,
        arm=other.arm,
        median_ttft_change=percent_change(
            None if base.ttft_ms is None else base.ttft_ms.median,
            None if other.ttft_ms is None else other.ttft_ms.median,
        ),
        mean_ttft_change=percent_change(
            None if base.ttft_ms is None else base.ttft_ms.mean,
            None if other.ttft_ms is None else other.ttft_ms.mean,
        ),
        transfer_reduction=None if reduction is None else -reduction,
        throughput_change=percent_change(base.output_throughput, other.output_throughput),
    )


@dataclass(frozen=True, slots=True)
class RoundsComparison:
    """`arm` against `base` over all rounds, and round by round (paired)."""

    pooled: Comparison
    rounds: tuple[Comparison, ...]

    def spread(self, figure: Callable[[Comparison], float | None]) -> Spread | None:
        return Spread.of([figure(c) for c in self.rounds])


def compare_rounds(base: ArmRounds, other: ArmRounds) -> RoundsComparison:
    pairs = zip(base.rounds, other.rounds, strict=False)  # round k of each
    return RoundsComparison(
        compare(base.pooled, other.pooled), tuple(compare(a, b) for a, b in pairs)
    )


def _ms_stats(s: ArmSummary, attr: str) -> Stats | None:
    stats: Stats | None = getattr(s, attr)
    return stats


def _stats(s: Stats | None) -> str:
    return "-" if s is None else f"{s.mean:.2f} / {s.median:.2f} / {s.p99:.2f}"


def _fmt_spread(spread: Spread | None, fmt: str, of: int) -> str:
    """` [low..high]` (and the rounds it spans when fewer than `of`); "" without a spread."""
    if spread is None:
        return ""
    rounds = f", {spread.num_rounds} rounds" if spread.num_rounds < of else ""
    return f" [{spread.low:{fmt}}..{spread.high:{fmt}}{rounds}]"


def _stats_spread(a: ArmRounds, attr: str) -> str:
    """Mean / median / p99, each with its per-round spread."""
    s = _ms_stats(a.pooled, attr)
    if s is None:
        return "-"
    n = len(a.rounds)
    parts = []
    for name in ("mean", "median", "p99"):

        def figure(r: ArmSummary, name: str = name) -> float | None:
            st = _ms_stats(r, attr)
            return None if st is None else float(getattr(st, name))

        parts.append(f"{getattr(s, name):.2f}{_fmt_spread(a.spread(figure), '.2f', n)}")
    return " / ".join(parts)


def _tiers(t: TierSums | None) -> str:
    if t is None:
        return "-"
    storage = f", storage {t.storage}" if t.storage else ""
    return f"{t.total} (device {t.device}, host {t.host}{storage})"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.1f}%"


def format_summary(summary: ArmSummary | ArmRounds) -> str:
    """The arm's figures, one row each; with rounds, each value's per-round spread."""
    a = summary if isinstance(summary, ArmRounds) else ArmRounds(summary, ())
    s, n = a.pooled, len(a.rounds)

    def spread(figure: Callable[[ArmSummary], float | None], fmt: str = ".0f") -> str:
        return _fmt_spread(a.spread(figure), fmt, n)

    moved = (
        "-"
        if s.transferred_tokens is None
        else f"{s.transferred_tokens} tokens, {s.transferred_bytes} bytes"
        + spread(lambda r: r.transferred_tokens)
    )
    rows = [
        ("requests", f"{s.num_requests} ({s.num_failed} failed)"),
        ("duration (s)", f"{s.duration_s:.2f}" + spread(lambda r: r.duration_s, ".2f")),
        ("output tokens", f"{s.output_tokens}" + spread(lambda r: r.output_tokens)),
        (
            "output throughput (tok/s)",
            f"{s.output_throughput:.1f}" + spread(lambda r: r.output_throughput, ".1f"),
        ),
        ("TTFT mean/median/p99 (ms)", _stats_spread(a, "ttft_ms")),
        ("ITL mean/median/p99 (ms)", _stats_spread(a, "itl_ms")),
        (
            "cached on prefill (tokens)",
            _tiers(s.cached_prefill) + spread(lambda r: r.cached_prefill.total),
        ),
        *_bound_rows(a),
        (
            "cached on decode (tokens)",
            _tiers(s.cached_decode)
            + spread(lambda r: None if r.cached_decode is None else r.cached_decode.total),
        ),
        ("moved prefill -> decode", moved),
    ]
    title = f" arm: {s.arm} "
    lines = [f"{title:=^64}"]
    if n > 1:
        lines.append(f"{n} interleaved rounds; [min..max] of the per-round values")
    lines += [f"{k:<30}{v}" for k, v in rows]
    if s.failures:
        lines.append(f"{'failed requests, why':<30}(count x error)")
        lines += [f"  {count:>5} x {why[:200]}" for why, count in s.failures]
    return "\n".join(lines)


def _bound_rows(a: ArmRounds) -> list[tuple[str, str]]:
    s = a.pooled
    if s.upper_bound is None:
        return []
    ratio = "-" if s.bound_ratio is None else f"{s.bound_ratio:.3f}"
    ratio += _fmt_spread(a.spread(lambda r: r.bound_ratio), ".3f", len(a.rounds))
    return [("cached upper bound (tokens)", f"{s.upper_bound}"), ("cached / upper bound", ratio)]


def format_comparison(comparison: Comparison | RoundsComparison) -> str:
    """The changes of one arm against the base; with rounds, the spread of the per-round
    (paired) changes."""
    rc = (
        comparison if isinstance(comparison, RoundsComparison) else RoundsComparison(comparison, ())
    )
    c, n = rc.pooled, len(rc.rounds)

    def spread(figure: Callable[[Comparison], float | None]) -> str:
        found = rc.spread(figure)
        if found is None:
            return ""
        rounds = f", {found.num_rounds} rounds" if found.num_rounds < n else ""
        return f" [{found.low:+.1f}%..{found.high:+.1f}%{rounds}]"

    reduction = "-" if c.transfer_reduction is None else f"{c.transfer_reduction:.1f}%"
    rows = [
        ("median TTFT change", _pct(c.median_ttft_change) + spread(lambda x: x.median_ttft_change)),
        ("mean TTFT change", _pct(c.mean_ttft_change) + spread(lambda x: x.mean_ttft_change)),
        ("transfer reduction", reduction + spread(lambda x: x.transfer_reduction)),
        (
            "output throughput change",
            _pct(c.throughput_change) + spread(lambda x: x.throughput_change),
        ),
    ]
    title = f" {c.arm} vs {c.base} "
    lines = [f"{title:=^64}"]
    if n > 1:
        lines.append(f"over {n} rounds; [min..max] of the changes round by round")
    return "\n".join(lines + [f"{k:<30}{v}" for k, v in rows])


def median_ttft_by_turn(results: Sequence[RequestResult]) -> dict[int, float]:
    """Turn -> median TTFT in ms over the completed requests of that turn."""
    by_turn: dict[int, list[float]] = defaultdict(list)
    for r in results:
        if r.ok and r.ttft is not None:
            by_turn[r.turn].append(r.ttft * 1e3)
    return {turn: float(np.median(v)) for turn, v in sorted(by_turn.items())}


def plot(results_by_arm: Mapping[str, Sequence[RequestResult]], path: str, title: str) -> None:
    """Three panels: each arm's TTFT CDF over all rounds (log x); its median TTFT by turn,
    shaded between the least and the greatest per-round median; and its median TTFT round by
    round, in the order the rounds ran (drift shows as a slope shared by every arm)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, MaxNLocator, NullFormatter, ScalarFormatter

    fig, (cdf, turns, rounds) = plt.subplots(1, 3, figsize=(17, 4.5))
    for arm, results in results_by_arm.items():
        ttft = np.sort([r.ttft * 1e3 for r in results if r.ok and r.ttft is not None])
        if ttft.size:
            cdf.step(ttft, np.arange(1, ttft.size + 1) / ttft.size, where="post", label=arm)
        by_turn = median_ttft_by_turn(results)
        (line,) = turns.plot(list(by_turn), list(by_turn.values()), marker="o", label=arm)
        per_round = _by_round(results)
        band = _turn_band([median_ttft_by_turn(rs) for rs in per_round.values()])
        if band:
            xs = sorted(band)
            turns.fill_between(
                xs, [band[t][0] for t in xs], [band[t][1] for t in xs], color=line.get_color(),
                alpha=0.2, linewidth=0,
            )  # fmt: skip
        medians = {k: median_ttft(rs) for k, rs in per_round.items()}
        xs = [k + 1 for k, v in medians.items() if v is not None]
        rounds.plot(xs, [v for v in medians.values() if v is not None], marker="o", label=arm)
    cdf.set_xscale("log")
    cdf.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    cdf.xaxis.set_major_formatter(ScalarFormatter())
    cdf.xaxis.set_minor_formatter(NullFormatter())
    cdf.set_xlabel("TTFT (ms)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("TTFT distribution (all rounds)")
    turns.xaxis.set_major_locator(MaxNLocator(integer=True))
    turns.set_xlabel("turn")
    turns.set_ylabel("median TTFT (ms)")
    turns.set_title("median TTFT by turn (band: per-round min..max)")
    rounds.xaxis.set_major_locator(MaxNLocator(integer=True))
    rounds.set_xlabel("round")
    rounds.set_ylabel("median TTFT (ms)")
    rounds.set_title("median TTFT per round")
    for ax in (cdf, turns, rounds):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def median_ttft(results: Sequence[RequestResult]) -> float | None:
    """Median TTFT in ms over the completed requests; None without any."""
    ttft = [r.ttft * 1e3 for r in results if r.ok and r.ttft is not None]
    return float(np.median(ttft)) if ttft else None


def _by_round(results: Sequence[RequestResult]) -> dict[int, list[RequestResult]]:
    out: dict[int, list[RequestResult]] = defaultdict(list)
    for r in results:
        out[r.round].append(r)
    return dict(sorted(out.items()))


def _turn_band(per_round: Sequence[Mapping[int, float]]) -> dict[int, tuple[float, float]]:
    """Turn -> (min, max) over the rounds of their median TTFT; empty with one round."""
    if len(per_round) < 2:
        return {}
    values: dict[int, list[float]] = defaultdict(list)
    for medians in per_round:
        for turn, v in medians.items():
            values[turn].append(v)
    return {t: (min(v), max(v)) for t, v in sorted(values.items())}
