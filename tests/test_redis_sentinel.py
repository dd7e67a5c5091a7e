"""A replicated index (issue 24, build 2): `up --redis-replicas 1` runs a Valkey primary, a
replica and 3 sentinels; the index and the router find the primary through Sentinel.

One mesh (nats-server, the Sentinel set, index, router, 2 tiny engines), one scenario:
- a prompt A is cached on one engine E, and its index entries have reached the replica;
- the index is stopped (SIGSTOP) and every engine flushes its cache: the removals are on
  the bus, not in Redis. Then, under load, the primary is killed: Sentinel promotes the
  replica, which lists A's pages for E although E no longer holds them;
- while the index has not resynced, the router reads a Redis whose `INDEX_SYNCED` marker
  names another server: it routes by load (`index_resync`), so A is never predicted as
  cached on E (`prefix_predictions{result="over"}` stays 0: a stale score would predict
  A's prefix and E would deliver none);
- the index resumes, re-fences and resyncs from snapshots, marks the new primary, and
  routing by prefix comes back: A, cached again, is predicted exactly;
- no request of the load fails, and every answer has the tokens of the cold run;
- the killed primary, restarted by `up`'s supervisor, comes back as a replica of the new one.
Then, on the same set: a removal the index applied on the primary but the replica never
received (its link cut) is never served after the next failover; and an index restarted
across a failover resyncs every engine Redis lists before it marks the new primary.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from bus_helpers import credentials_of
from fault_helpers import (
    Load,
    MeshSpec,
    Req,
    UpMesh,
    baseline,
    body_of,
    prompts,
    running_mesh,
    workload,
)
from redis.exceptions import RedisError

from bus_schemas import redis_keys as rk
from bus_schemas.sentinel import DEFAULT_MASTER, INDEX_SYNCED

pytestmark = pytest.mark.timeout(180)

PROMPT_A = Req(prompts(12)[11], 4, False)  # shares no page with the load's prompts


@pytest.fixture(scope="module")
def status_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sentinel") / "status.json"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, status_file: Path) -> Iterator[UpMesh]:
    spec = MeshSpec(extra=("--redis-replicas", "1", "--status-file", str(status_file)))
    with running_mesh(spec, tmp_path_factory, "sentinel") as m:
        yield m


def children(status_file: Path) -> dict[str, dict[str, Any]]:
    return dict(json.loads(status_file.read_text())["children"])


class Set:
    """The test's view of the Sentinel set: the index's Redis user on each node, the
    sentinels' password on sentinel 1."""

    def __init__(self, mesh: UpMesh, status_file: Path) -> None:
        self.status_file = status_file
        self.index_creds = credentials_of(mesh.credentials_dir(), "redis", "index")
        sentinel_creds = credentials_of(mesh.credentials_dir(), "redis", "sentinels")
        port = children(status_file)["redis-sentinel-1"]["port"]
        self.sentinel = aioredis.Redis(
            port=port,
            username=sentinel_creds.user,
            password=sentinel_creds.password,
            decode_responses=True,
        )
        self.nodes: dict[int, aioredis.Redis] = {}

    def node(self, port: int) -> aioredis.Redis:
        if port not in self.nodes:
            self.nodes[port] = aioredis.Redis(
                port=port,
                username=self.index_creds.user,
                password=self.index_creds.password,
                decode_responses=True,
                socket_timeout=1.0,
            )
        return self.nodes[port]

    async def primary_port(self) -> int:
        _host, port = await self.sentinel.execute_command(
            "SENTINEL", "get-master-addr-by-name", DEFAULT_MASTER
        )
        return int(port)

    async def aclose(self) -> None:
        await self.sentinel.aclose()
        for client in self.nodes.values():
            await client.aclose()


@pytest.fixture
async def sentinel_set(mesh: UpMesh, status_file: Path) -> AsyncIterator[Set]:
    s = Set(mesh, status_file)
    yield s
    await s.aclose()


async def metric(http: aiohttp.ClientSession, url: str, name: str, label: str) -> float:
    async with http.get(f"{url}/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        plain = not label and line.startswith(f"{name} ")  # a counter without labels
        if plain or (line.startswith(f"{name}{{") and f'"{label}"' in line):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


COLD_A: list[tuple[int, ...]] = []  # A's greedy tokens on its first (cold) send


async def send_a(http: aiohttp.ClientSession, url: str) -> int:
    """A, plain: the cached tokens the engine reports. Its tokens must be the cold run's."""
    async with http.post(f"{url}/v1/completions", json=body_of(PROMPT_A)) as r:
        assert r.status == 200, await r.text()
        data = await r.json()
    tokens = tuple(data["choices"][0]["token_ids"])
    if not COLD_A:
        COLD_A.append(tokens)
    assert tokens == COLD_A[0], "a cache hit changed A's output"
    return int(data["usage"]["prompt_tokens_details"]["cached_tokens"])


async def index_marked(s: Set, port: int) -> float:
    """Wait until the index marked the server on `port` as resynced; the seconds it took.
    Nothing is sent meanwhile, so no request re-caches a dropped prompt before it is asked."""

    async def marked() -> bool:
        node = s.node(port)
        return bool(await node.get(INDEX_SYNCED) == (await node.info("server"))["run_id"])

    return await until(marked, 30, "the index marks the new primary", 0.05)


async def until(check: Any, timeout_s: float, what: str, step_s: float = 0.1) -> float:
    """Poll the coroutine function `check` until it returns true; the seconds it took."""
    start = time.monotonic()
    while not await check():
        assert time.monotonic() - start < timeout_s, f"not within {timeout_s}s: {what}"
        await asyncio.sleep(step_s)
    return time.monotonic() - start


async def flush_every_engine(http: aiohttp.ClientSession, url: str) -> None:
    """POST /flush_cache until the router answers 200 (every engine flushed)."""

    async def flushed() -> bool:
        async with http.post(f"{url}/flush_cache") as r:
            return r.status == 200

    await until(flushed, 10, "/flush_cache")


class Prompt:
    """One prompt sent through the router: the tokens it got from the cache, and whether
    the router has routed it by prefix (reason `cache`) since `mark`."""

    ROUTING = "hicache_router_routing_decisions_total"

    def __init__(self, http: aiohttp.ClientSession, url: str, req: Req) -> None:
        self.http, self.url, self.body = http, url, body_of(req)
        self.cache_before = 0.0

    async def send(self) -> int:
        async with self.http.post(f"{self.url}/v1/completions", json=self.body) as r:
            assert r.status == 200, await r.text()
            data = await r.json()
        return int(data["usage"]["prompt_tokens_details"]["cached_tokens"])

    async def mark(self) -> None:
        self.cache_before = await metric(self.http, self.url, self.ROUTING, "cache")

    async def by_prefix(self) -> bool:
        cached = await self.send()
        return cached > 0 and await metric(self.http, self.url, self.ROUTING, "cache") > (
            self.cache_before
        )


async def cached_on_the_replica(
    prompt: Prompt, s: Set, mesh: UpMesh, status_file: Path, what: str
) -> tuple[int, int, dict[int, str], dict[str, int]]:
    """Send `prompt` until the router routes it by prefix, then wait until the replica
    lists as many pages per engine as the primary: the primary's and the replica's ports,
    the Redis children's names by port, and the pages each engine holds."""
    await prompt.send()
    await prompt.mark()
    await until(prompt.by_prefix, 10, f"{what} routed by prefix")
    primary = await s.primary_port()
    names = {c["port"]: n for n, c in children(status_file).items() if n.startswith("redis")}
    (replica,) = [p for p, n in names.items() if "sentinel" not in n and p != primary]
    held = {e: await s.node(primary).scard(rk.engine_pages(e)) for e in mesh.spec.engine_ids}

    async def replicated() -> bool:
        cards = [await s.node(replica).scard(rk.engine_pages(e)) for e in held]
        return cards == list(held.values())

    await until(replicated, 10, f"{what}'s entries on the replica")
    return primary, replica, names, held


async def test_failover_routes_by_load_until_resynced_and_serves_no_stale_hit(
    mesh: UpMesh, sentinel_set: Set, status_file: Path
) -> None:
    url, s = mesh.url, sentinel_set
    over = "hicache_router_prefix_predictions_total"
    routing = "hicache_router_routing_decisions_total"
    reqs = workload(4)
    async with aiohttp.ClientSession() as http:
        # A cached on engine E, predicted exactly; its entries reach the replica
        await send_a(http, url)

        async def a_cached() -> bool:
            cached = await send_a(http, url)
            return cached > 0 and await metric(http, url, routing, "cache") > 0

        await until(a_cached, 10, "A served from the cache, routed by prefix")
        primary = await s.primary_port()
        replica = children(status_file)["redis-replica-1"]["port"]
        assert primary == children(status_file)["redis"]["port"]
        held = {e: await s.node(primary).scard(rk.engine_pages(e)) for e in mesh.spec.engine_ids}
        engine_a = max(held, key=lambda e: held[e])
        assert held[engine_a] > 0, held

        async def replicated() -> bool:
            return bool(await s.node(replica).scard(rk.engine_pages(engine_a)) == held[engine_a])

        await until(replicated, 10, "A's entries on the replica")
        over_before = await metric(http, url, over, "over")
        resync_before = await metric(http, url, routing, "index_resync")

        # the index stops; every engine drops A: the removals never reach Redis
        index_pid = mesh.pid_of("index")
        os.kill(index_pid, signal.SIGSTOP)
        try:
            await flush_every_engine(http, url)
            # the load's cold answers, now: the old primary never hears of these prompts
            expected = await baseline(url, reqs)
            async with Load(url, reqs, expected, clients=4) as load:
                await load.wait_answers(4)
                errors_before = await metric(http, url, "hicache_router_store_errors_total", "")
                os.kill(children(status_file)["redis"]["pid"], signal.SIGKILL)
                started = time.monotonic()

                async def promoted() -> bool:
                    return await s.primary_port() == replica

                await until(promoted, 20, "Sentinel promotes the replica")
                stale = await s.node(replica).scard(rk.engine_pages(engine_a))
                assert stale == held[engine_a], "the new primary should list A's stale pages"
                assert (
                    await s.node(replica).get(INDEX_SYNCED)
                    != ((await s.node(replica).info("server"))["run_id"])
                )

                async def reconnected() -> bool:
                    errors = await metric(http, url, "hicache_router_store_errors_total", "")
                    async with http.get(f"{url}/health") as r:
                        health = await r.json()
                    return errors > errors_before and bool(health["redis_connected"])

                # the router lost the primary, then reached the new one: it routes A by load,
                # never by the pages the new primary lists for E
                await until(reconnected, 10, "the router reads the new primary", 0.2)
                for _ in range(3):
                    await send_a(http, url)
                assert await metric(http, url, over, "over") == over_before, "a stale hit"
                assert await metric(http, url, routing, "index_resync") > resync_before
                await load.wait_answers(4)
                os.kill(index_pid, signal.SIGCONT)

                # the index resyncs; routing by prefix comes back (A cached, exact)
                cache_before = await metric(http, url, routing, "cache")

                async def by_prefix_again() -> bool:
                    await send_a(http, url)
                    return await metric(http, url, routing, "cache") > cache_before

                recovery_s = await until(by_prefix_again, 20, "routing by prefix again", 0.2)
                print(f"failover -> prefix routing again: {time.monotonic() - started:.2f}s")
                await load.wait_answers(4)
            assert not load.problems(frozenset({"ok"})), load.summary()
        finally:
            os.kill(index_pid, signal.SIGCONT)
        assert await metric(http, url, over, "over") == over_before
        assert (
            await s.node(replica).get(INDEX_SYNCED)
            == ((await s.node(replica).info("server"))["run_id"])
        )
        assert recovery_s < 20

        # the killed primary comes back as a replica of the new one
        old = children(status_file)["redis"]["port"]

        async def demoted() -> bool:
            try:
                info = await s.node(old).info("replication")
            except (RedisError, OSError):
                return False
            return info.get("role") == "slave" and int(info.get("master_port", 0)) == replica

        await until(demoted, 20, "the old primary replicates the new one", 0.2)


PROMPT_B = Req(prompts(12)[10], 4, False)


async def test_removal_lost_with_the_primary_is_never_served_after_failover(
    mesh: UpMesh, sentinel_set: Set, status_file: Path
) -> None:
    """The index applied a removal on the primary, but the replica never received it (the
    replica frozen with SIGSTOP, and its link cut on the primary's side with `CLIENT KILL
    TYPE replica`, as the sentinels' user may), then the primary dies and the replica,
    resumed, is promoted: only the
    index's resync after the failover can drop the stale entry (the removal event is gone),
    and until then the router must not trust the new primary. Runs on the set the first test
    left (it checks which node is the primary now)."""
    url, s = mesh.url, sentinel_set
    over = "hicache_router_prefix_predictions_total"

    async with aiohttp.ClientSession() as http:
        b = Prompt(http, url, PROMPT_B)
        primary, replica, names, held = await cached_on_the_replica(b, s, mesh, status_file, "B")
        replica_pid = children(status_file)[names[replica]]["pid"]
        over_before = await metric(http, url, over, "over")
        os.kill(replica_pid, signal.SIGSTOP)
        try:
            sentinel_user = credentials_of(mesh.credentials_dir(), "redis", "sentinel")
            cutter = aioredis.Redis(
                port=primary, username=sentinel_user.user, password=sentinel_user.password
            )
            try:  # the replica hears nothing more
                assert await cutter.execute_command("CLIENT", "KILL", "TYPE", "replica") == 1
            finally:
                await cutter.aclose()
            await flush_every_engine(http, url)

            async def removed_on_primary() -> bool:
                cards = [await s.node(primary).scard(rk.engine_pages(e)) for e in held]
                return not any(cards)

            await until(removed_on_primary, 10, "the index removes B's pages on the primary")
            os.kill(children(status_file)[names[primary]]["pid"], signal.SIGKILL)
        finally:
            os.kill(replica_pid, signal.SIGCONT)
        # the primary is gone with the removal: the replica, soon promoted, lists B's pages
        assert any([await s.node(replica).scard(rk.engine_pages(e)) for e in held])

        async def promoted() -> bool:
            return await s.primary_port() == replica

        await until(promoted, 20, "Sentinel promotes the replica")
        await index_marked(s, replica)

        # now B is sent until it is routed by prefix again: never a stale prediction
        async def again() -> bool:
            assert await metric(http, url, over, "over") == over_before, "a stale hit"
            return await b.by_prefix()

        await b.mark()
        await until(again, 20, "B routed by prefix after the resync", 0.05)
        assert await metric(http, url, over, "over") == over_before, "a stale hit"


PROMPT_C = Req(prompts(12)[9], 4, False)


async def test_an_index_restarted_across_the_failover_resyncs_what_redis_lists(
    mesh: UpMesh, sentinel_set: Set, status_file: Path
) -> None:
    """The index is down (SIGSTOP) while the engines drop C and while the primary dies; then
    it is killed and `up` restarts it. The new index knows no engine; it finds a primary whose
    marker is not its own run id, so it drops the entries of every engine Redis lists
    (`hc:engines`) and asks each for a snapshot before marking it: C is never predicted as
    cached on the engine that dropped it. Runs on the set the tests before left."""
    url, s = mesh.url, sentinel_set
    over = "hicache_router_prefix_predictions_total"

    async def linked() -> bool:  # a replica in sync with the primary the sentinels name
        primary = await s.primary_port()
        for name, child in children(status_file).items():
            if name in ("redis", "redis-replica-1") and child["port"] != primary:
                try:
                    info = await s.node(child["port"]).info("replication")
                except (RedisError, OSError):
                    return False
                return (
                    info.get("master_link_status") == "up"
                    and int(info.get("master_port", 0)) == primary
                )
        return False

    await until(linked, 30, "a replica linked to the primary", 0.2)

    async with aiohttp.ClientSession() as http:
        c = Prompt(http, url, PROMPT_C)
        primary, replica, names, held = await cached_on_the_replica(c, s, mesh, status_file, "C")
        over_before = await metric(http, url, over, "over")
        index_pid = mesh.pid_of("index")
        os.kill(index_pid, signal.SIGSTOP)
        try:
            await flush_every_engine(http, url)
            os.kill(children(status_file)[names[primary]]["pid"], signal.SIGKILL)

            async def promoted() -> bool:
                return await s.primary_port() == replica

            await until(promoted, 20, "Sentinel promotes the replica")
            assert any([await s.node(replica).scard(rk.engine_pages(e)) for e in held])
        finally:
            os.kill(index_pid, signal.SIGKILL)  # `up` restarts it: a new index
        await index_marked(s, replica)

        async def again() -> bool:
            assert await metric(http, url, over, "over") == over_before, "a stale hit"
            return await c.by_prefix()

        await c.mark()
        await until(again, 30, "C routed by prefix after the new index resynced", 0.05)
        assert await metric(http, url, over, "over") == over_before, "a stale hit"
        assert mesh.pid_of("index") != index_pid


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--redis-sentinel", "127.0.0.1:1", "--redis-url", "redis://h:6379/0"], "names a server"),
        (["--redis-sentinel", "127.0.0.1"], "expects HOST:PORT"),
        (["--redis-sentinel", "a:1,a:1"], "twice"),
        (["--redis-sentinel", "a:1", "--redis-url", "unix:///tmp/r.sock"], "redis:// or rediss://"),
    ],
)
@pytest.mark.parametrize("module", ["services.index", "router"])
def test_contradictory_or_malformed_sentinel_flags_are_refused(
    module: str, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bad input: exit 2 with a clear error, before connecting to anything."""
    import importlib

    main = importlib.import_module(f"{module}.__main__").main
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_sentinel_flags_give_the_primary_from_sentinel_only() -> None:
    from bus_schemas.sentinel import parse_sentinels, sentinel_redis_url

    sentinels = parse_sentinels(["a:1,b:2", "[::1]:3"])
    assert sentinels == (("a", 1), ("b", 2), ("::1", 3))
    assert sentinel_redis_url(None, sentinels) == "redis:///0"
    assert sentinel_redis_url("rediss://u:p@/2", sentinels) == "rediss://u:p@/2"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--redis-replicas", "1", "--redis-url", "redis://127.0.0.1:1/0"], "not with --redis-url"),
        (["--redis-replicas", "-1"], "must be >= 0"),
    ],
)
def test_up_refuses_redis_replicas_it_cannot_start(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.cli import main
    from services.launch.servers import free_port

    assert main(["up", "--port", str(free_port()), "--model", "tiny", *flags]) == 2
    assert message in capsys.readouterr().err
