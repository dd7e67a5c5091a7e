"""Engines whose ranks span hosts, and a mesh spread over hosts (issue 24, acceptance 1).

The "hosts" are network namespaces joined by a bridge (`tests/netns.py`): a 3-server NATS
cluster (`start_nats_cluster`, every process given the three URLs) and redis-server listen
on the bridge's address, the router, the index and each engine run in a
namespace of their own and reach each other only through NATS and Redis. Engine `tp2` is
one TP2 world over two hosts: node 0 (`node0`, the engine service) and node 1 (`node1`,
started with the same flags plus `--node-rank 1`), its ranks talking gloo over the veth link.

- Through the router, `tp2`'s greedy outputs equal a cold in-process TP1 engine's (float64
  `tiny`), and a branching multi-turn trace passes the oracle: every cache hit gives the
  cold output.
- Then node 1's link is cut (TCP connections hang, nothing resets): a stream held on `tp2`
  ends with a clear error within the bound, both of tp2's processes exit within it, and new
  requests are served by a TP1 engine (`solo`) with the same tokens.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from fault_helpers import (
    PAGE,
    Req,
    cold_reference,
    finish_stream,
    held_stream,
    send_all,
    workload,
)
from netns import Hosts, free_port_on, require_netns, start_on

from services.launch.nats_cluster import start_nats_cluster
from services.launch.readiness import wait_ready

pytestmark = pytest.mark.timeout(180)

FAILURE_BOUND_S = 10.0  # as the multirank failure tests: a lost rank ends its engine by then
HOSTS = ("front", "index", "node0", "node1", "solo")
ENGINE_FLAGS = ("--model", "tiny", "--page-size", str(PAGE), "--max-total-tokens", "4096")
ENGINE_FLAGS += ("--enable-hierarchical-cache", "--heartbeat-interval", "0.5")
LONG_PROMPT = tuple(range(30, 50))


@dataclass(frozen=True, slots=True)
class Bus:
    """Where the mesh's NATS and Redis are: the NATS cluster's URLs and one Redis URL."""

    nats_urls: tuple[str, ...]
    redis_url: str

    @property
    def nats_url(self) -> str:
        return ",".join(self.nats_urls)


@dataclass
class Mesh:
    hosts: Hosts
    bus: Bus
    url: str
    router_pid: int
    logs: Path
    tp2: tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]  # node 0, node 1

    def engine_argv(self, engine_id: str, *flags: str) -> list[str]:
        argv = [sys.executable, "-m", "services.engine", "--engine-id", engine_id]
        return [*argv, "--nats-url", self.bus.nats_url, *ENGINE_FLAGS, *flags]

    def start(self, host: str, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with (self.logs / f"{name}.log").open("ab") as log:
            return self.hosts.run_in(host, argv, stdout=log, stderr=subprocess.STDOUT)

    def start_tp2(self) -> None:
        """Engine `tp2`: node 0 in host `node0`, node 1 in host `node1` (a new world)."""
        rendezvous = f"{self.hosts.ip_of('node0')}:{free_port_on(self.hosts.bridge_ip)}"
        nodes = ("--tp-size", "2", "--dist-init-addr", rendezvous, "--nnodes", "2")
        node0 = self.start("node0", "tp2-node0", self.engine_argv("tp2", *nodes))
        node1_argv = self.engine_argv("tp2", *nodes, "--node-rank", "1")
        self.tp2 = (node0, self.start("node1", "tp2-node1", node1_argv))

    def wait_ready(self, engines: set[str], timeout_s: float = 60.0) -> None:
        wait_ready(self.url, engines, self.router_pid, timeout_s, lambda: False)


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    require_netns()
    with Hosts(HOSTS) as h:
        yield h


@pytest.fixture(scope="module")
def bus(hosts: Hosts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bus]:
    """A 3-server NATS cluster and one redis-server on the bridge's address: every process
    lists the three servers (issue 24: the mesh across hosts talks only through them)."""
    workdir = tmp_path_factory.mktemp("bus")
    cluster, members = start_nats_cluster(3, host=hosts.bridge_ip)
    try:
        redis = start_on("redis", hosts.bridge_ip, workdir)
        try:
            yield Bus(tuple(cluster.urls()), redis.url)
        finally:
            redis.stop()
    finally:
        for member in members:
            member.stop()


@pytest.fixture(scope="module")
def mesh(hosts: Hosts, bus: Bus, tmp_path_factory: pytest.TempPathFactory) -> Mesh:
    logs = tmp_path_factory.mktemp("logs")
    front = hosts.ip_of("front")
    port = free_port_on(hosts.bridge_ip)  # any free number: the router's host is its own
    py = sys.executable
    router = [py, "-m", "router", "--host", front, "--port", str(port)]
    router += ["--nats-url", bus.nats_url, "--redis-url", bus.redis_url]
    index = [py, "-m", "services.index", "--nats-url", bus.nats_url, "--redis-url", bus.redis_url]
    m = Mesh(hosts, bus, f"http://{front}:{port}", 0, logs, None)  # type: ignore[arg-type]
    m.router_pid = m.start("front", "router", router).pid
    m.start("index", "index", index)
    m.start_tp2()
    m.wait_ready({"tp2"})
    return m


def cold_logprobs(prompt: tuple[int, ...], max_tokens: int) -> list[float | None]:
    """Each greedy output token's logprob from an in-process TP1 engine, cache off."""
    from gpu_worker.cache.hicache import CacheConfig
    from gpu_worker.engine.engine import Engine, EngineConfig
    from gpu_worker.model.sampling import SamplingParams

    eng = Engine(EngineConfig(model="tiny", cache=CacheConfig(PAGE, enable_radix_cache=False)))
    try:
        req = eng.submit(prompt, SamplingParams(max_tokens, ignore_eos=True, logprobs=2))
        eng.run([req])
        return [logprob for logprob, _ in req.logprobs]
    finally:
        eng.close()


def branching_trace() -> list[list[tuple[int, ...]]]:
    """Turns of a conversation tree: a shared root, then two branches of two turns each
    (each turn's user tokens; the prompt of a turn is its parent's prompt, answer and
    these)."""
    root = tuple((7 * i + 3) % 250 + 3 for i in range(18))
    return [[root], [(201, 202, 203), (204, 205)], [(211, 212), (213, 214, 215)]]


async def complete(http: aiohttp.ClientSession, url: str, prompt: tuple[int, ...]) -> dict:
    body = {"prompt": list(prompt), "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    async with http.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        data = await r.json()
    return {
        "tokens": tuple(data["choices"][0]["token_ids"]),
        "cached": data["usage"]["prompt_tokens_details"]["cached_tokens"],
        "engine": r.headers.get("X-Hicache-Engine", ""),
    }


async def test_tp2_across_hosts_equals_tp1(mesh: Mesh) -> None:
    reqs = workload()
    answers = await send_all(mesh.url, reqs)
    assert [a.kind for a in answers] == ["ok"] * len(reqs), answers
    assert {a.engine for a in answers} == {"tp2"}
    cold = cold_reference(reqs)
    assert [a.tokens for a in answers] == [cold[r] for r in reqs]
    prompt = reqs[0].prompt
    body = {"prompt": list(prompt), "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{mesh.url}/v1/completions", json=body | {"logprobs": 2}) as r,
    ):
        assert r.status == 200, await r.text()
        got = (await r.json())["choices"][0]["logprobs"]["token_logprobs"]
    want = cold_logprobs(prompt, 6)
    assert got == pytest.approx(want, rel=0, abs=1e-9)  # float64: TP2's sums in another order


async def test_branching_trace_through_the_bus_passes_the_oracle(mesh: Mesh) -> None:
    """Router, index and engine hosts share nothing but NATS and Redis: every turn of a
    branching conversation, a cache hit from the second on, gives the cold output."""
    root, *levels = branching_trace()
    got: dict[tuple[int, ...], dict] = {}
    async with aiohttp.ClientSession() as http:
        parents = [root[0]]
        got[root[0]] = await complete(http, mesh.url, root[0])
        for level in levels:
            children = []
            for parent in parents:  # the branches of a level run at once
                prompts = [parent + got[parent]["tokens"] + user for user in level]
                outs = await asyncio.gather(*(complete(http, mesh.url, p) for p in prompts))
                got |= dict(zip(prompts, outs, strict=True))
                children += prompts
            parents = children[:1] + children[-1:]  # two branches go on
    cold = cold_reference([Req(p, 6, False) for p in got])
    wrong = [p for p in got if got[p]["tokens"] != cold[Req(p, 6, False)]]
    assert not wrong, f"{len(wrong)} of {len(got)} turns differ from the cold run"
    hits = [p for p in got if got[p]["cached"] > 0]
    assert len(hits) >= len(got) - 1, {p[-3:]: got[p]["cached"] for p in got}
    assert {o["engine"] for o in got.values()} == {"tp2"}


async def test_cut_link_ends_the_engine_and_requests_fail_over(mesh: Mesh) -> None:
    solo = mesh.start("solo", "solo", mesh.engine_argv("solo"))
    mesh.wait_ready({"tp2", "solo"})
    reqs = workload(4)
    expected = cold_reference(reqs)
    node0, node1 = mesh.tp2
    async with aiohttp.ClientSession() as http:
        held, engine = await held_stream(http, mesh.url, LONG_PROMPT, "tp2", max_tokens=4000)
        cut_at = time.monotonic()
        mesh.hosts.cut("node1")
        end = await finish_stream(held)
    ended = time.monotonic() - cut_at
    node0_s, node1_s = _exited_within(node0, cut_at), _exited_within(node1, cut_at)
    print(
        f"\n[multihost] node 1 cut: the held stream ended in {ended:.2f}s, node 0 exited "
        f"({node0.returncode}) after {node0_s:.2f}s, node 1 ({node1.returncode}) after "
        f"{node1_s:.2f}s"
    )
    assert engine == "tp2"
    assert end.kind == "error", f"the held stream must end with a clear error: {end}"
    assert "engine rank 1's node stopped answering" in end.detail, end
    assert ended < FAILURE_BOUND_S, f"the held stream took {ended:.1f}s to end"
    assert node0_s < FAILURE_BOUND_S and node0.returncode == 1
    assert node1_s < FAILURE_BOUND_S and node1.returncode == 3  # it lost node 0
    answers = await send_all(mesh.url, reqs)
    assert [a.kind for a in answers] == ["ok"] * len(reqs), answers
    assert {a.engine for a in answers} == {"solo"}
    assert [a.tokens for a in answers] == [expected[r] for r in reqs]
    assert solo.poll() is None


async def test_a_node_killed_ends_the_engine(mesh: Mesh) -> None:
    """After the cut: node 1's link back, a new tp2 world; node 1 killed (its connections
    reset) mid-stream: the stream ends with an error within the bound, node 0 exits."""
    mesh.hosts.restore("node1")
    mesh.start_tp2()
    mesh.wait_ready({"tp2", "solo"})
    node0, node1 = mesh.tp2
    async with aiohttp.ClientSession() as http:
        held, _ = await held_stream(http, mesh.url, LONG_PROMPT, "tp2", max_tokens=4000)
        killed_at = time.monotonic()
        node1.kill()
        end = await finish_stream(held)
    ended, node0_s = time.monotonic() - killed_at, _exited_within(node0, killed_at)
    print(f"\n[multihost] node 1 killed: the held stream ended in {ended:.2f}s")
    assert end.kind == "error", f"the held stream must end with a clear error: {end}"
    assert "node stopped answering" in end.detail, end  # lost, not a request's crash
    assert ended < FAILURE_BOUND_S and node0_s < FAILURE_BOUND_S and node0.returncode == 1
    answers = await send_all(mesh.url, workload(2))
    assert {(a.kind, a.engine) for a in answers} == {("ok", "solo")}


async def test_sigterm_to_node_0_stops_every_node(mesh: Mesh) -> None:
    """A stopped engine (SIGTERM to the service) stops its world: node 1 exits 0 too."""
    mesh.start_tp2()
    mesh.wait_ready({"tp2", "solo"})
    node0, node1 = mesh.tp2
    stopped_at = time.monotonic()
    node0.terminate()
    node0_s, node1_s = _exited_within(node0, stopped_at), _exited_within(node1, stopped_at)
    assert (node0.returncode, node1.returncode) == (0, 0)
    assert node0_s < FAILURE_BOUND_S and node1_s < FAILURE_BOUND_S


def _exited_within(proc: subprocess.Popen[bytes], since: float) -> float:
    """Seconds from `since` until `proc` exited (waits up to twice the bound)."""
    try:
        proc.wait(max(0.0, since + 2 * FAILURE_BOUND_S - time.monotonic()))
    except subprocess.TimeoutExpired:
        return float("inf")
    return time.monotonic() - since


# ------------------------------------------------------------------ flags (no namespaces)

NODE_FLAGS = ["--engine-id", "x", "--model", "tiny", "--tp-size", "2", "--nnodes", "2"]


def test_a_node_started_with_other_flags_is_refused_naming_the_field() -> None:
    """Node 1 with another --page-size: both sides refuse, naming `cache.page_size`."""
    import datetime

    import torch.distributed as dist

    from gpu_worker.engine.nodes import check_same_config
    from services.engine.__main__ import build_parser
    from services.engine.config import engine_config_from_args, node_layout_from_args

    store = dist.TCPStore("127.0.0.1", 0, 2, True, datetime.timedelta(seconds=30), False)
    argv = [*NODE_FLAGS, "--dist-init-addr", f"127.0.0.1:{store.port}", "--page-size", "4"]
    args = build_parser().parse_args(argv)
    node1 = subprocess.Popen(
        [sys.executable, "-m", "services.engine", *argv[:-1], "8", "--node-rank", "1"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with pytest.raises(
            ValueError, match=r"disagree on cache\.page_size \(node 0: 4, node 1: 8\)"
        ):
            config, layout = engine_config_from_args(args), node_layout_from_args(args)
            check_same_config(store, config, layout, 30)
        _, err = node1.communicate(timeout=60)
    finally:
        node1.kill()
    assert node1.returncode == 2, err
    assert "engine nodes disagree on cache.page_size (node 1: 8, node 0: 4)" in err


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        ([], "--nnodes above 1 needs --dist-init-addr"),
        (["--dist-init-addr", "10.0.0.1"], "--dist-init-addr wants HOST:PORT"),
        (["--dist-init-addr", "10.0.0.1:99999"], "--dist-init-addr wants HOST:PORT"),
        (["--dist-init-addr", "127.0.0.1:1", "--node-rank", "2"], "--node-rank must be in [0, 1]"),
        (["--dist-init-addr", "127.0.0.1:1", "--nnodes", "4"], "2 ranks do not split evenly"),
    ],
)
def test_bad_node_flags_are_a_clear_error(
    flags: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.engine.__main__ import main

    for node_rank in ("0", "1"):  # the service, and a node that only runs ranks
        assert main([*NODE_FLAGS, "--node-rank", node_rank, *flags]) == 2
        assert error in capsys.readouterr().err
