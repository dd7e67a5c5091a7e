"""The rank consensus checker: do all ranks of an engine take the same cache decisions?

The article's debugging section (SGLang's `rank_consensus_checker`). Scheduler and cache
decisions are decorated with `@rank_consensus(same_params=[...], same_results=[...])`. With
`HICACHE_RANK_CONSENSUS` unset (or 0) the decorator returns the function unchanged: zero
cost. With it set, every rank records each decorated call, in logical order, on the
scheduler thread: the call's name, the selected parameters and the selected results.

A side thread per rank compares the records over a dedicated gloo group (`groups.consensus`):
each round it MIN-agrees how many records every rank has (stages reach the same call at
different times; only records all ranks hold are compared), hashes each of them three ways
(call, parameters, results) and takes MIN and MAX of the hashes across every TP and PP rank
in one all_reduce. The first record whose MIN and MAX differ is a divergence: every rank
logs `Found rank divergence` with that entry as each rank recorded it (all-gathered), and
whether the call order, the parameters or the results differ; the engine's next step then
raises `RankDivergenceError`, so the engine stops with that report as its error.

With `HICACHE_RANK_CONSENSUS_DIR` set, each rank also writes its records to
`DIR/rank{N}.jsonl`; `hicache-mesh consensus DIR` reads them and prints the same report.

Selectors are strings: a parameter's name selects the whole argument's repr; anything else
is an expression over the bound arguments (and `result`, for `same_results`), e.g.
`"len(ids)"` or `"list(result.device_page_ids)"`. Select what is deterministic: never object
reprs that show memory addresses.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from gpu_worker import env
from gpu_worker.consensus.records import Divergence, Record, kind_of
from gpu_worker.parallel.groups import ParallelGroups

log = logging.getLogger(__name__)

ENV = env.RANK_CONSENSUS
ENV_DIR = env.RANK_CONSENSUS_DIR
ROUND_S = 0.02  # how often the side thread compares what it has
VERDICT_WAIT_S = 5.0  # how long a failed rank waits for the checker before it gives up

F = TypeVar("F", bound=Callable[..., Any])
_SAFE_BUILTINS = {f.__name__: f for f in (len, list, tuple, int, sum, min, max, sorted, bool)}


def consensus_enabled() -> bool:
    return env.rank_consensus_enabled()


class RankDivergenceError(RuntimeError):
    """Ranks of one engine took different decisions; the message is the report."""


def rank_label(groups: ParallelGroups) -> str:
    cp = f"/CP{groups.cp_rank}" if groups.config.cp_size > 1 else ""
    return f"rank{groups.rank} PP{groups.pp_rank}{cp}/TP{groups.tp_rank}"


class ConsensusRecorder:
    """One rank's records and the side thread that compares them (see the module doc)."""

    def __init__(self, groups: ParallelGroups, log_dir: Path | None = None) -> None:
        assert groups.consensus is not None, "the world was built without a consensus group"
        self.groups = groups
        self.records: list[Record] = []  # appended by the scheduler thread only
        self.checked = 0  # records compared and found equal on every rank
        self.divergence: Divergence | None = None
        self._owner = threading.get_ident()  # the scheduler thread: only it records
        self._stop = threading.Event()
        self._log = None
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            self._log = (log_dir / f"rank{groups.rank}.jsonl").open("w", buffering=1 << 16)
            header = {"rank": groups.rank, "label": rank_label(groups)}
            self._log.write(json.dumps(header) + "\n")
        self._thread = threading.Thread(target=self._loop, name="rank-consensus", daemon=True)
        self._thread.start()

    def record(self, call: str, params: str, results: str) -> None:
        if threading.get_ident() != self._owner:
            return
        rec = Record(call, params, results)
        if self._log is not None:
            entry = {"i": len(self.records), "call": call, "params": params, "results": results}
            self._log.write(json.dumps(entry) + "\n")
        self.records.append(rec)

    def check(self) -> None:
        """The scheduler thread, each step: raise once the side thread found a divergence."""
        if self.divergence is not None:
            raise RankDivergenceError(self.divergence.report())

    def await_verdict(self, timeout_s: float = VERDICT_WAIT_S) -> Divergence | None:
        """After this rank's step failed: give the side threads time to compare what every
        rank recorded, so an earlier divergence (the cause) is reported instead of its later
        symptom (a shape mismatch, a failed collective). The divergence, or None."""
        deadline = time.monotonic() + timeout_s
        settled = 0
        while self.divergence is None and self._thread.is_alive():
            if time.monotonic() > deadline:
                break
            settled = settled + 1 if self.checked == len(self.records) else 0
            if settled > 10:  # everything this rank holds compared equal, repeatedly
                break
            time.sleep(ROUND_S)
        return self.divergence

    # -- side thread

    def _loop(self) -> None:
        group = self.groups.consensus
        try:
            while True:
                # [records every rank holds, whether every rank goes on]: one MIN for both
                t = torch.tensor(
                    [len(self.records) - self.checked, 0 if self._stop.is_set() else 1],
                    dtype=torch.int64,
                )
                dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
                n, going_on = int(t[0]), bool(t[1])
                if n > 0 and self._compare(n):
                    return
                if not going_on:
                    return
                self._stop.wait(ROUND_S)
        except Exception as e:  # a peer died: the engine's own failure path reports it
            log.warning("rank consensus checker stopped: %s", e)

    def _compare(self, n: int) -> bool:
        """Compare records [checked, checked + n); True when they diverge."""
        start = self.checked
        digests = torch.tensor([r.digests() for r in self.records[start : start + n]])
        packed = torch.cat([digests, -digests])  # MIN of both: the minima and -(the maxima)
        dist.all_reduce(packed, op=dist.ReduceOp.MIN, group=self.groups.consensus)
        differ = (packed[:n] != -packed[n:]).any(dim=1)  # (n,)
        if not bool(differ.any()):
            self.checked += n
            return False
        index = start + int(differ.nonzero()[0, 0])
        mine = (rank_label(self.groups), self.records[index])
        gathered: list[Any] = [None] * self.groups.world_size
        dist.all_gather_object(gathered, mine, group=self.groups.consensus)
        entries = {label: rec for label, rec in gathered}
        kind = kind_of(list(entries.values())) or "results"
        self.divergence = Divergence(index, kind, entries)
        log.error("%s", self.divergence.report())
        if self._log is not None:
            self._log.flush()
        return True

    def close(self) -> None:
        """Every rank calls this: the side threads leave together after one last round."""
        self._stop.set()
        self._thread.join(timeout=30)
        if self._log is not None:
            self._log.close()
            self._log = None


_recorder: ConsensusRecorder | None = None  # one per process (one rank), set by the Engine


def attach(recorder: ConsensusRecorder | None) -> None:
    """Make `recorder` the one this process's decorated calls record into (None: detach)."""
    global _recorder
    _recorder = recorder


def _selector(expr: str) -> Callable[[dict[str, Any]], str]:
    if expr.isidentifier():
        return lambda env: repr(env.get(expr))
    code = compile(expr, f"<selector {expr}>", "eval")

    def select(env: dict[str, Any]) -> str:
        try:
            return repr(eval(code, {"__builtins__": _SAFE_BUILTINS}, env))
        except Exception as e:
            return f"<{type(e).__name__}: {e}>"

    return select


def rank_consensus(
    same_params: Sequence[str] = (), same_results: Sequence[str] = ()
) -> Callable[[F], F]:
    """Record this call for the rank consensus checker (see the module doc). Off, it
    returns the function itself."""
    if not consensus_enabled():
        return lambda fn: fn

    def decorate(fn: F) -> F:
        signature = inspect.signature(fn)
        params = [_selector(s) for s in same_params]
        results = [_selector(s) for s in same_results]
        name = fn.__qualname__

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            recorder = _recorder
            if recorder is None:
                return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            env = dict(bound.arguments)
            p = "; ".join(sel(env) for sel in params)  # before the call: it may change them
            result = fn(*args, **kwargs)
            env["result"] = result
            recorder.record(name, p, "; ".join(sel(env) for sel in results))
            return result

        return wrapper  # type: ignore[return-value]

    return decorate


def recorder_for(groups: ParallelGroups) -> ConsensusRecorder | None:
    """This rank's recorder when the checker is on and the world has a consensus group."""
    if groups.consensus is None:
        return None
    return ConsensusRecorder(groups, env.rank_consensus_dir())
