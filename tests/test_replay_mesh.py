"""Replay on real meshes (issue 12, acceptance 1 and 2).

A mesh started with `hicache-mesh up --record FILE` serves ~200 mixed requests
(`replay_traffic`: completions, chat, `/generate`, streams, seeded and unseeded sampling,
n=2, rejected ones). Then `hicache-mesh replay FILE`:
- on a fresh mesh of the same flags: every status and every output the same, exit 0;
- on a mesh whose engines change every request's 3rd token (`--debug-perturb-sampler`):
  exit 1, naming the first request (in arrival order) and its token 2, both values;
- with `--arms cache,cold` and no `--mesh-args` (the recording's own flags, less its port
  and `--record`), after a warmup: both arms give the recording's outputs and each other's,
  the report counts the cached tokens the cold arm (`--disable-radix-cache`) did not have,
  and the input file is left as it was (the recorded `--record` names it).

`--enable-deterministic-inference` makes every row independent of its batch, so outputs do
not depend on which requests happen to be batched together in the recording and the replay.
"""

from __future__ import annotations

import asyncio
import re
import shlex
from pathlib import Path

import orjson
import pytest
from fault_helpers import PAGE, MeshSpec, UpMesh
from replay_traffic import mixed_requests, send_traffic

from services.cli import main
from services.replay.compare import replays_exactly
from services.replay.recording import Recording, read_recording

NUM_REQUESTS = 200
SPEC = MeshSpec(engines=2, extra=("--model", "tiny", "--enable-deterministic-inference"))
# the recording mesh's flags, without its port and --record
MESH_ARGS = shlex.join(SPEC.argv(0)[SPEC.argv(0).index("--port") + 2 :])


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("replay")
    path = workdir / "traffic.jsonl"
    spec = MeshSpec(engines=2, extra=(*SPEC.extra, "--record", str(path)))
    mesh = UpMesh(spec, workdir)
    mesh.start()
    try:
        statuses = asyncio.run(send_traffic(mesh.url, mixed_requests(NUM_REQUESTS)))
    finally:
        code = mesh.stop()  # the router writes what is queued, then closes the file
    assert code == 0, mesh.log_tail()
    assert statuses[200] == 180 and sum(statuses.values()) == NUM_REQUESTS, statuses
    return path


def test_the_recording_has_a_header_and_every_request(recorded: Path) -> None:
    header = orjson.loads(recorded.read_bytes().splitlines()[0])
    assert (header["type"], header["version"], header["page_size"]) == ("header", 1, PAGE)
    flags = header["mesh_flags"]  # `up`'s own flags, and each engine's
    assert flags[0] == "--port" and "--record" in flags and "--engines" in flags
    assert set(header["engine_flags"]) == {"engine-0", "engine-1"}
    assert "--enable-deterministic-inference" in header["engine_flags"]["engine-0"]
    rec = read_recording(recorded)
    assert len(rec.requests) == NUM_REQUESTS and rec.num_dropped == 0
    statuses = {r.reference.status for r in rec.requests if r.reference is not None}
    assert statuses == {200, 400, 404}
    sampled_unseeded = [
        r for r in rec.requests if isinstance(r.body, dict) and r.body.get("temperature")
    ]
    assert any(r.body.get("seed") is None and r.seed is not None for r in sampled_unseeded)
    assert all(replays_exactly(r) for r in rec.requests)  # greedy, or seeded (by the router)


def _ok(rec: Recording) -> int:
    return sum(r.reference is not None and r.reference.status == 200 for r in rec.requests)


def test_replay_on_a_fresh_mesh_gives_every_answer_again(
    recorded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report, figure = tmp_path / "replay.md", tmp_path / "replay.png"
    argv = ["replay", str(recorded), "--mesh-args", MESH_ARGS, "--speed", "2"]
    code = main([*argv, "--disable-tqdm", "--report", str(report), "--plot", str(figure)])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    num_ok = _ok(read_recording(recorded))
    assert f"arm replay: {NUM_REQUESTS} requests, {num_ok} outputs compared, 0 mismatches" in out
    text = report.read_text()
    assert "**PASS**" in text and "None: every status and every compared output is the same" in text
    assert "| replay | TTFT |" in text and "## Index staleness (the recording)" in text
    assert figure.stat().st_size > 10_000


def test_a_perturbed_sampler_is_named_at_its_first_mismatch(
    recorded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rec = read_recording(recorded)
    first = min(
        (
            r
            for r in rec.requests
            if r.reference is not None
            and r.reference.status == 200
            and len(r.reference.choices[0].output_ids) > 2
        ),
        key=lambda r: (r.time_s, r.line),
    )
    assert first.reference is not None
    token = first.reference.choices[0].output_ids[2]
    mesh_args = f"{MESH_ARGS} --debug-perturb-sampler"
    argv = ["replay", str(recorded), "--mesh-args", mesh_args, "--speed", "0"]
    argv += ["--max-concurrency", "8", "--disable-tqdm", "--no-plot"]
    code = main([*argv, "--report", str(tmp_path / "perturbed.md")])
    err = capsys.readouterr().err
    assert code == 1
    expected = (
        f"first: line {first.line} {first.endpoint} choice 0: output token 2 (0-based) "
        f"differs: recorded {token}, replayed {(token + 1) % 256}"
    )
    assert expected in err, err[-3000:]


def test_cache_and_cold_arms_agree_and_the_report_shows_what_cold_missed(
    recorded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "arms.md"
    before = recorded.read_bytes()
    argv = ["replay", str(recorded), "--arms", "cache,cold", "--warmup", "4"]  # the flags: its own
    argv += ["--speed", "0", "--max-concurrency", "8", "--disable-tqdm", "--no-plot"]
    code = main([*argv, "--report", str(report)])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    assert recorded.read_bytes() == before  # its --record named this very file
    assert f"(left out: --port {_recorded_port(recorded)} --record {recorded})" in err
    assert "arm cache: 4 warmup requests sent, unmeasured" in err
    num_ok = _ok(read_recording(recorded))
    for arm in ("cache", "cold"):
        assert f"arm {arm}: {NUM_REQUESTS} requests, {num_ok} outputs compared, 0 mismatch" in out
    found = re.search(
        rf"arm cold vs cache: {num_ok} outputs compared, 0 differ; cached tokens cache had and "
        r"cold did not: (\d+) \(device (\d+), host (\d+), storage (\d+)\)",
        out,
    )
    assert found is not None, out
    missed, device, host, storage = map(int, found.groups())
    assert missed > 0 and missed == device + host + storage
    text = report.read_text()
    assert f"| cold | arm cache | {device} | {host} | {storage} | {missed} |" in text
    assert "| cold | device | " in text and "| 0 | 0.000 |" in text  # cold cached nothing
    assert "(started for the replay, 4 warmup requests)" in text


def _recorded_port(path: Path) -> str:
    flags = orjson.loads(path.read_bytes().splitlines()[0])["mesh_flags"]
    return str(flags[flags.index("--port") + 1])
