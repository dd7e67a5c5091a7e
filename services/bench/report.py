"""Summaries of an arm's requests, the comparison of two arms, and the plot.

Percentiles interpolate linearly between ranks (numpy's default). Times print in ms.
Cached tokens "on prefill" are the P/D block's prefill counts when the server sends one,
else the response's own `cached_tokens_by_tier` (a colocated engine does the prefill);
"on decode" and the prefill -> decode transfer exist only with the P/D block. A trace's arm
also shows the offline upper bound of cached tokens (`services.bench.mooncake`) and the
share of it cached on prefill.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
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
        duration_s=max((r.start + r.latency for r in results), default=0.0),
        ttft_ms=Stats.of([r.ttft * 1e3 for r in ok if r.ttft is not None]),
        itl_ms=Stats.of([gap * 1e3 for r in ok for gap in r.itl]),
        output_tokens=sum(r.output_len for r in ok),
        cached_prefill=prefill,
        cached_decode=decode,
        transferred_tokens=sum(d.transferred_tokens for d in disagg) if disagg else None,
        transferred_bytes=sum(d.transferred_bytes for d in disagg) if disagg else None,
        upper_bound=upper_bound,
    )


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


def _stats(s: Stats | None) -> str:
    return "-" if s is None else f"{s.mean:.2f} / {s.median:.2f} / {s.p99:.2f}"


def _tiers(t: TierSums | None) -> str:
    if t is None:
        return "-"
    storage = f", storage {t.storage}" if t.storage else ""
    return f"{t.total} (device {t.device}, host {t.host}{storage})"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.1f}%"


def format_summary(s: ArmSummary) -> str:
    moved = (
        "-"
        if s.transferred_tokens is None
        else f"{s.transferred_tokens} tokens, {s.transferred_bytes} bytes"
    )
    rows = [
        ("requests", f"{s.num_requests} ({s.num_failed} failed)"),
        ("duration (s)", f"{s.duration_s:.2f}"),
        ("output tokens", f"{s.output_tokens}"),
        ("output throughput (tok/s)", f"{s.output_throughput:.1f}"),
        ("TTFT mean/median/p99 (ms)", _stats(s.ttft_ms)),
        ("ITL mean/median/p99 (ms)", _stats(s.itl_ms)),
        ("cached on prefill (tokens)", _tiers(s.cached_prefill)),
        *_bound_rows(s),
        ("cached on decode (tokens)", _tiers(s.cached_decode)),
        ("moved prefill -> decode", moved),
    ]
    title = f" arm: {s.arm} "
    lines = [f"{title:=^64}"] + [f"{k:<30}{v}" for k, v in rows]
    return "\n".join(lines)


def _bound_rows(s: ArmSummary) -> list[tuple[str, str]]:
    if s.upper_bound is None:
        return []
    ratio = "-" if s.bound_ratio is None else f"{s.bound_ratio:.3f}"
    return [("cached upper bound (tokens)", f"{s.upper_bound}"), ("cached / upper bound", ratio)]


def format_comparison(c: Comparison) -> str:
    rows = [
        ("median TTFT change", _pct(c.median_ttft_change)),
        ("mean TTFT change", _pct(c.mean_ttft_change)),
        (
            "transfer reduction",
            "-" if c.transfer_reduction is None else f"{c.transfer_reduction:.1f}%",
        ),
        ("output throughput change", _pct(c.throughput_change)),
    ]
    title = f" {c.arm} vs {c.base} "
    return "\n".join([f"{title:=^64}"] + [f"{k:<30}{v}" for k, v in rows])


def median_ttft_by_turn(results: Sequence[RequestResult]) -> dict[int, float]:
    """Turn -> median TTFT in ms over the completed requests of that turn."""
    by_turn: dict[int, list[float]] = defaultdict(list)
    for r in results:
        if r.ok and r.ttft is not None:
            by_turn[r.turn].append(r.ttft * 1e3)
    return {turn: float(np.median(v)) for turn, v in sorted(by_turn.items())}


def plot(results_by_arm: Mapping[str, Sequence[RequestResult]], path: str, title: str) -> None:
    """Two panels: the TTFT CDF of each arm (log x) and each arm's median TTFT by turn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, MaxNLocator, NullFormatter, ScalarFormatter

    fig, (cdf, turns) = plt.subplots(1, 2, figsize=(12, 4.5))
    for arm, results in results_by_arm.items():
        ttft = np.sort([r.ttft * 1e3 for r in results if r.ok and r.ttft is not None])
        if ttft.size:
            cdf.step(ttft, np.arange(1, ttft.size + 1) / ttft.size, where="post", label=arm)
        by_turn = median_ttft_by_turn(results)
        turns.plot(list(by_turn), list(by_turn.values()), marker="o", label=arm)
    cdf.set_xscale("log")
    cdf.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    cdf.xaxis.set_major_formatter(ScalarFormatter())
    cdf.xaxis.set_minor_formatter(NullFormatter())
    cdf.set_xlabel("TTFT (ms)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("TTFT distribution")
    turns.xaxis.set_major_locator(MaxNLocator(integer=True))
    turns.set_xlabel("turn")
    turns.set_ylabel("median TTFT (ms)")
    turns.set_title("median TTFT by turn")
    for ax in (cdf, turns):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
