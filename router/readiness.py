"""Readiness: whether every configured bucket can serve, and what is missing when not.

`/health` says whether the router serves at all (NATS up and some bucket can serve); a
mesh of two buckets answers it while the slower bucket is still loading, and a request that
needs that bucket then gets 503 `no_live_engine`. `/ready` is the probe for "every request
the router accepts can be served": each bucket of the router's configuration (`--bucket`,
one "default" bucket without it) holds a ready engine (live, its model card here) of each
role it needs: a colocated engine, or a prefill and a decode engine (P/D). Redis is not
needed (without it the router routes by load), NATS is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from router.engines import COLOCATED, DECODE, PREFILL, EngineView, can_serve


@dataclass(frozen=True, slots=True)
class BucketReadiness:
    """One configured bucket: its ready engines by role, and why it cannot serve."""

    name: str
    ready: dict[str, list[str]]  # role -> ids of its ready engines (live, card held)
    loading: list[str]  # live engines whose model card has not arrived yet
    missing: str | None  # what it lacks to serve; None: it can serve

    def as_dict(self) -> dict[str, object]:
        return {"ready": self.missing is None, "engines": self.ready, "loading": self.loading}


def bucket_readiness(
    buckets: Sequence[str], live: Iterable[EngineView], ready: Iterable[EngineView]
) -> list[BucketReadiness]:
    """Each of `buckets` (in order) given the live engines and those of them that are
    ready. Engines of a bucket the router was not configured with are left out."""
    ready_ids = {e.engine_id for e in ready}
    live = list(live)
    out = []
    for name in buckets:
        engines = [e for e in live if e.bucket == name]
        serving = [e for e in engines if e.engine_id in ready_ids]
        by_role: dict[str, list[str]] = {}
        for e in serving:
            by_role.setdefault(e.role, []).append(e.engine_id)
        loading = [e.engine_id for e in engines if e.engine_id not in ready_ids]
        missing = None if can_serve(serving) else _missing(name, by_role, loading)
        out.append(BucketReadiness(name, by_role, loading, missing))
    return out


def _missing(bucket: str, by_role: dict[str, list[str]], loading: list[str]) -> str:
    if PREFILL in by_role:
        need = "no ready decode engine (it has a prefill engine)"
    elif DECODE in by_role:
        need = "no ready prefill engine (it has a decode engine)"
    else:
        need = f"no ready engine ({COLOCATED}, or {PREFILL} and {DECODE})"
    if loading:
        need += f"; {', '.join(loading)} live, waiting for the model card"
    return f"bucket {bucket!r}: {need}"
