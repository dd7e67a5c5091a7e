"""The markdown report of a replay (`--report FILE.md`). Times print in ms."""

from __future__ import annotations

import shlex
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from services.replay.compare import Mismatch
from services.replay.observation import TIERS, CachedTokens
from services.replay.summary import ArmDiff, ArmReport, Percentiles, ReplayResult, Staleness

MAX_LISTED = 10  # mismatches listed per arm


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return [*lines, ""]


def _ms(p: Percentiles | None) -> list[str]:
    return ["-"] * 3 if p is None else [f"{v * 1e3:.2f}" for v in (p.p50, p.p90, p.p99)]


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.1f}%"


def _tiers(c: CachedTokens) -> list[int]:
    return [c.device, c.host, c.storage, c.total]


def mesh_command(flags: Sequence[str]) -> str:
    """A header's `mesh_flags` as a command line (they may start with `up` itself)."""
    rest = list(flags)
    if rest[:1] == ["up"]:
        rest = rest[1:]
    return f"hicache-mesh up {shlex.join(rest)}"


def render(result: ReplayResult, plot_path: Path | None = None) -> str:
    failures = result.failures()
    rec = result.recording
    lines = [f"# Replay of `{rec.path}`", ""]
    lines.append(f"**{'FAIL' if failures else 'PASS'}**" + (":" if failures else ""))
    lines += [f"- {f}" for f in failures]
    notes = result.notes()
    if notes:
        lines += ["", "Notes:", *(f"- {n}" for n in notes)]
    lines += ["", *_setup(result), *_arms(result), *_outputs(result), *_latency(result)]
    lines += [*_cache(result), *_staleness(result.staleness)]
    if plot_path is not None:
        lines += ["## Figure", "", f"![replay]({plot_path.name})", ""]
    return "\n".join(lines)


def _setup(result: ReplayResult) -> list[str]:
    rec = result.recording
    lines = ["## Setup", ""]
    for h in rec.headers:
        flags = "-" if h.mesh_flags is None else f"`{mesh_command(h.mesh_flags)}`"
        lines.append(
            f"- segment at line {h.line}: model {h.model or '-'}, version "
            f"{h.project_version or '-'}, git {h.git_revision or '-'}, "
            f"{'redacted, ' if h.redacted else ''}mesh {flags}"
        )
    lines.append(
        f"- {result.num_requests} of {len(rec.requests)} recorded requests replayed; "
        f"{rec.num_dropped} records dropped while recording"
    )
    speed = "as fast as allowed" if result.pace.speed == 0 else f"{result.pace.speed:g}x"
    t = result.thresholds
    limits = ", ".join(
        f"{m} +{v:g}%"
        for m, v in (("TTFT", t.ttft_pct), ("ITL", t.itl_pct), ("E2E", t.e2e_pct))
        if v is not None
    )
    lines += [
        f"- speed {speed}, max concurrency {result.pace.max_concurrency or 'none'}; "
        f"strict cache {'on' if result.strict_cache else 'off'}; "
        f"p50 regression limits: {limits or 'none'}",
        "",
    ]
    return lines


def _arms(result: ReplayResult) -> list[str]:
    rows = []
    for a in result.arms:
        statuses = Counter(v.mismatch is None for v in a.verdicts)
        rows.append(
            [
                a.arm,
                a.target.describe(),
                len(a.verdicts),
                a.num_compared,
                len(a.mismatches(result.strict_cache)),
                len(a.cache_differences),
                statuses[True],
                f"{a.duration_s:.2f}",
            ]
        )
    header = [
        "arm",
        "target",
        "requests",
        "outputs compared",
        "mismatches",
        "cache differences",
        "same status and outputs",
        "duration (s)",
    ]
    return ["## Arms against the recording", "", *_table(header, rows)]


def _mismatch_rows(found: Sequence[Mismatch]) -> list[list[object]]:
    return [
        [
            m.line,
            m.endpoint,
            f"{m.arrival_s:.3f}",
            m.what,
            "-" if m.choice is None else m.choice,
            "-" if m.position is None else m.position,
            m.expected,
            m.got,
        ]
        for m in found[:MAX_LISTED]
    ]


def _outputs(result: ReplayResult) -> list[str]:
    """Per arm against the recording, then per arm against the first arm: the first
    `MAX_LISTED` mismatches of each, in arrival order."""
    header = ["line", "endpoint", "arrival (s)", "what", "choice", "token", "{a}", "{b}"]
    pairs: list[tuple[str, str, str, ArmReport | ArmDiff]] = [
        (f"arm {a.arm} against the recording", "recorded", a.arm, a) for a in result.arms
    ]
    pairs += [(f"arm {d.arm} against arm {d.base}", d.base, d.arm, d) for d in result.diffs]
    lines = ["## Mismatches", ""]
    tables: list[str] = []
    for title, ref, got, compared in pairs:
        found = compared.mismatches(result.strict_cache)
        lines.append(f"- {title}: {compared.num_compared} outputs compared, {len(found)} differ")
        if found:
            tables += [f"{title} (first {MAX_LISTED}):", ""]
            tables += _table([c.format(a=ref, b=got) for c in header], _mismatch_rows(found))
    if not tables:
        tables = ["None: every status and every compared output is the same.", ""]
    return [*lines, "", *tables]


def _latency(result: ReplayResult) -> list[str]:
    header = ["arm", "metric", "n", "rec p50", "rec p90", "rec p99"]
    header += ["replay p50", "replay p90", "replay p99", "p50 change"]
    rows = []
    for a in result.arms:
        for row in a.latency:
            rec, got = row.recorded_pct, row.replayed_pct
            n = 0 if rec is None else rec.count
            rows.append([a.arm, row.metric, n, *_ms(rec), *_ms(got), _pct(row.p50_change)])
    note = (
        "Recorded in the router, replayed in the client (adds the HTTP round trip); each "
        "metric over the requests both sides measured (TTFT, ITL: streamed ones)."
    )
    return ["## Latency (ms)", "", note, "", *_table(header, rows)]


def _cache(result: ReplayResult) -> list[str]:
    lines = ["## Cached tokens per tier", ""]
    header = ["arm", "tier", "recorded", "recorded rate", "replayed", "replayed rate"]
    rows = []
    for a in result.arms:
        for tier in TIERS:
            rows.append(
                [
                    a.arm,
                    tier,
                    a.recorded_cache.cached.tier(tier),
                    f"{a.recorded_cache.rate(tier):.3f}",
                    a.replayed_cache.cached.tier(tier),
                    f"{a.replayed_cache.rate(tier):.3f}",
                ]
            )
    lines += _table(header, rows)
    lines += ["Cached tokens an arm did not have (summed per request):", ""]
    header = ["arm", "than", "device", "host", "storage", "total"]
    rows = [[a.arm, "the recording", *_tiers(a.missing_vs_recording)] for a in result.arms]
    rows += [[d.arm, f"arm {d.base}", *_tiers(d.missing)] for d in result.diffs]
    rows += [[d.base, f"arm {d.arm}", *_tiers(d.extra)] for d in result.diffs]
    lines += _table(header, rows)
    if not result.strict_cache:
        lines += ["Cache differences are not mismatches without `--strict-cache`.", ""]
    return lines


def _staleness(s: Staleness) -> list[str]:
    lines = ["## Index staleness (the recording)", ""]
    if not s.count:
        return [*lines, "No request has both a prediction and cached tokens.", ""]
    lines += [
        "`predicted_cached_tokens` (the index, when the router routed) against the cached "
        "tokens delivered; error = delivered - predicted.",
        "",
        f"- requests: {s.count}; mispredicted: {s.num_mispredicted} "
        f"({s.num_over} over-predicted: stale index, {s.num_under} under-predicted)",
        f"- mean error {s.mean_error:+.2f} tokens, mean absolute error {s.mean_abs_error:.2f}",
        "",
    ]
    return lines + _table(["error (tokens)", "requests"], histogram(s.errors))


def histogram(errors: Sequence[int], max_bins: int = 12) -> list[list[object]]:
    """(range, count) rows: one per value when there are few, else equal-width bins."""
    counts = Counter(errors)
    if len(counts) <= max_bins:
        return [[str(v), n] for v, n in sorted(counts.items())]
    hist, edges = np.histogram(errors, bins=max_bins)
    return [
        [f"[{edges[i]:.0f}, {edges[i + 1]:.0f}{']' if i == len(hist) - 1 else ')'}", int(n)]
        for i, n in enumerate(hist)
    ]
