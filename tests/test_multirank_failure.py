"""A rank that raises takes its engine down cleanly, never silently (issue 8, point 6).

An engine service of two rank processes (TP2, or PP2 where the failing rank is the last
stage) whose rank 1 raises in its step loop when a request holding a test token is admitted
(`--debug-rank-raise 1:TOKEN`). Every request it held, running or queued, gets a final error
chunk marked `engine_crashed` within 2 heartbeat intervals of the poison's arrival, the
engine stops heartbeating before the first error goes out, and the service exits non-zero
(its supervisor would restart it) with no rank process left behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest
from bus_helpers import spawn_engine, wait_heartbeats
from test_engine_failure import Collector

from gpu_worker.engine.rank import EXIT_PEER_LOST, RankExit, RankProcesses
from services.launch.servers import ServerProcess

HEARTBEAT_S = 1.0
POISON = 201
FLAGS = ["--model", "tiny", "--page-size", "4", "--max-total-tokens", "4096"]
FLAGS += ["--max-running-requests", "2"]


def rank_pids(service_pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
            if ppid == service_pid and b"gpu_worker.engine.rank" in argv:
                out.append(int(entry.name))
    return out


@pytest.mark.parametrize("layout", [("--tp-size", "2"), ("--pp-size", "2")], ids=["tp2", "pp2"])
async def test_a_rank_that_raises_ends_its_engine(
    nats_server: ServerProcess, layout: tuple[str, str]
) -> None:
    eid = f"raising-{layout[0][2:4]}"
    flags = [*FLAGS, *layout, "--heartbeat-interval", str(HEARTBEAT_S)]
    proc = spawn_engine(nats_server.url, eid, *flags, "--debug-rank-raise", f"1:{POISON}")
    nc = await nats.connect(nats_server.url)
    try:
        await wait_heartbeats(nc, {eid})
        ranks = rank_pids(proc.pid)
        assert len(ranks) == 1
        col = Collector(nc, eid)
        await col.start()
        running = [await col.send(list(range(20 + i, 40 + i)), 500) for i in range(3)]
        while not (all(col.chunks.get(r) for r in running[:2]) and col.heartbeats):
            await asyncio.sleep(0.02)
        sent_at = time.monotonic()
        poison = await col.send([POISON, 9, 10, 11], 4)
        rids = [*running, poison]
        while not all(col.finished(r) for r in rids):
            assert time.monotonic() - sent_at < 30, "requests never ended"
            await asyncio.sleep(0.02)
        assert col.first_error_at is not None
        took = col.first_error_at - sent_at
        print(f"\n[multirank] {layout}: rank 1 raised; errors out {took:.2f}s after the poison")
        assert took < 2 * HEARTBEAT_S
        for rid in rids:
            last = col.finished(rid)
            assert last is not None and last.engine_crashed and last.error_code == 500
            assert last.error is not None and "rank 1" in last.error
        assert await asyncio.to_thread(proc.wait, 15) == 1
        await asyncio.sleep(3 * HEARTBEAT_S)
        assert not [t for t in col.heartbeats if t > col.first_error_at], "heartbeats went on"
        assert not [p for p in ranks if Path(f"/proc/{p}").exists()], "a rank was left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await nc.close()


def _child(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code])


SLEEP = "import time; time.sleep(60)"


@pytest.mark.parametrize(
    ("children", "killed", "expected", "external"),
    [
        # a rank killed from outside; its peer saw the broken collective first
        ([f"import os; os._exit({EXIT_PEER_LOST})", SLEEP], 2, RankExit(2, -9), True),
        # a rank that raised, and a peer that lost it: the raiser is named, a suspect
        (
            [
                "import os; os._exit(1)",
                f"import os, time; time.sleep(0.2); os._exit({EXIT_PEER_LOST})",
            ],
            None,
            RankExit(1, 1),
            False,
        ),
        # a crash signal is the rank's own fault
        (
            [SLEEP, "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"],
            None,
            RankExit(2, -11),
            False,
        ),
        # only a lost peer and no other exit: nothing a request computed
        (
            [f"import os; os._exit({EXIT_PEER_LOST})", SLEEP],
            None,
            RankExit(1, EXIT_PEER_LOST),
            True,
        ),
    ],
    ids=["killed", "raised", "segfault", "peer-lost-only"],
)
def test_exit_cause_names_the_rank_that_ended_the_world(
    children: list[str], killed: int | None, expected: RankExit, external: bool
) -> None:
    """The rank named to every request, and whether they may be retried elsewhere: a rank
    whose collective broke (exit 3) is a symptom, never the cause while another exited."""
    procs = {rank: _child(code) for rank, code in enumerate(children, start=1)}
    ranks = RankProcesses(procs, None)  # type: ignore[arg-type]  # no world to keep alive
    try:
        while procs[1].poll() is None and procs[2].poll() is None:
            time.sleep(0.01)
        if killed is not None:
            time.sleep(0.1)  # the symptom shows well before the cause
            os.kill(procs[killed].pid, signal.SIGKILL)
        cause = ranks.exit_cause(wait_s=3.0)
        assert cause == expected
        assert cause.external is external
        assert f"rank {expected.rank}" in cause.describe()
    finally:
        ranks.kill()
