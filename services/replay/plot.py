"""The figure of a replay (`--plot FILE.png`), matplotlib with the Agg backend.

Six panels: TTFT, ITL and E2E CDFs (recorded and each arm; log x), the hit rate per tier
(recorded and each arm), cumulative mismatches over the recorded arrival time (each arm
against the recording, each later arm against the first), and the histogram of the
recording's index prediction errors (delivered - predicted cached tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from services.replay.compare import Mismatch
from services.replay.observation import TIERS
from services.replay.summary import ReplayResult


def _cdf(ax: Any, values: Sequence[float], label: str, **style: Any) -> None:
    if not values:
        return
    xs = np.sort(np.asarray(values) * 1e3)
    ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label=label, **style)


def _latency_panel(ax: Any, result: ReplayResult, metric: str) -> None:
    for i, arm in enumerate(result.arms):
        row = next(r for r in arm.latency if r.metric == metric)
        if i == 0:
            _cdf(ax, row.recorded, "recorded", color="black", linestyle="--")
        _cdf(ax, row.replayed, arm.arm)
    ax.set_xscale("log")
    ax.set_xlabel(f"{metric} (ms)")
    ax.set_ylabel("fraction")
    ax.set_title(f"{metric} distribution")


def _hit_rates(ax: Any, result: ReplayResult) -> None:
    series = [("recorded", result.arms[0].recorded_cache)]
    series += [(a.arm, a.replayed_cache) for a in result.arms]
    width = 0.8 / len(series)
    x = np.arange(len(TIERS))
    for i, (name, totals) in enumerate(series):
        ax.bar(x + i * width, [totals.rate(t) for t in TIERS], width, label=name)
    ax.set_xticks(x + width * (len(series) - 1) / 2, TIERS)
    ax.set_ylabel("cached / prompt tokens")
    ax.set_title("hit rate per tier")


def _cumulative(ax: Any, found: Sequence[Mismatch], total_s: float, label: str) -> None:
    times = sorted(m.arrival_s for m in found)
    ax.step(
        [0.0, *times, total_s],
        [0, *range(1, len(times) + 1), len(times)],
        where="post",
        label=f"{label} ({len(times)})",
    )


def _mismatches(ax: Any, result: ReplayResult) -> None:
    total_s = max((v.arrival_s for v in result.arms[0].verdicts), default=0.0)
    for a in result.arms:
        _cumulative(ax, a.mismatches(result.strict_cache), total_s, f"{a.arm} vs recorded")
    for d in result.diffs:
        _cumulative(ax, d.mismatches(result.strict_cache), total_s, f"{d.arm} vs {d.base}")
    ax.set_xlabel("recorded arrival (s)")
    ax.set_ylabel("mismatches so far")
    ax.set_title("mismatches over time")


def _staleness(ax: Any, result: ReplayResult) -> None:
    errors = result.staleness.errors
    if errors:
        lo, hi = min(errors), max(errors)
        ax.hist(errors, bins=min(30, hi - lo + 1), range=(lo - 0.5, hi + 0.5))
    ax.set_xlabel("delivered - predicted cached tokens")
    ax.set_ylabel("requests")
    ax.set_title(f"index prediction error ({result.staleness.num_mispredicted} mispredicted)")


def plot(result: ReplayResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    (ttft, itl, e2e), (hits, mism, stale) = axes
    for ax, metric in ((ttft, "TTFT"), (itl, "ITL"), (e2e, "E2E")):
        _latency_panel(ax, result, metric)
    _hit_rates(hits, result)
    _mismatches(mism, result)
    _staleness(stale, result)
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"replay of {result.recording.path}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
