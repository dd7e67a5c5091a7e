"""Recording cost under load: `--record` on against off, side by side, 64 clients.

Starts a mesh (`hicache-mesh up --engines 2`, the tiny model) and two more routers on its
nats and redis, alike but for `--record FILE` on one of them. `--clients` clients each send
`--rounds` rounds; every round sends the same request to both routers, in random order,
and times each from send to the whole response. Prompts share prefixes (a few long system
prompts, a short question each), so routing looks up the index as usual. Reported per
router: end-to-end latency percentiles over every request, and the router's own time (its
`Server-Timing` total minus the `engine` stage: HTTP, parsing, routing, the response, and
any time the event loop spent on other requests' records); the p50 ratios with bootstrap
95% intervals, and what the recording router wrote and dropped. With 64 clients on a small
machine the engines' queue dominates end to end; the own time is where recording shows.

    .venv/bin/python benchmarks/bench_record.py
    .venv/bin/python benchmarks/bench_record.py --clients 64 --rounds 20 --prompt-len 512
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson
from tqdm import tqdm

from router.outcome import parse_server_timing
from services.launch.servers import free_port


def start_mesh(args: argparse.Namespace, workdir: Path) -> tuple[subprocess.Popen[bytes], dict]:
    port, status = free_port(), workdir / "status.json"
    argv = [sys.executable, "-m", "services.cli", "up", "--port", str(port)]
    argv += ["--model", "tiny", "--engines", str(args.engines), "--page-size", "16"]
    argv += ["--status-file", str(status)]
    log = (workdir / "up.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while b"is up" not in (workdir / "up.log").read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit((workdir / "up.log").read_text(errors="replace")[-3000:])
        time.sleep(0.2)
    return proc, json.loads(status.read_text())


def start_router(
    mesh: dict, extra: list[str], workdir: Path, name: str
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    argv = [sys.executable, "-m", "router", "--port", str(port)]
    argv += ["--nats-url", mesh["nats_url"], "--redis-url", mesh["redis_url"], *extra]
    log = (workdir / f"router-{name}.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


async def wait_ready(http: aiohttp.ClientSession, url: str, engines: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(f"{url}/health") as resp:
                if resp.status == 200 and len((await resp.json())["ready_engines"]) >= engines:
                    return
        await asyncio.sleep(0.2)
    raise SystemExit(f"router {url} did not become ready")


def stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def own_s(header: str) -> float:
    """The router's own seconds from its Server-Timing header: total minus engine."""
    durs = parse_server_timing(header)
    return (durs["total"] - durs.get("engine", 0.0)) / 1e3


Samples = dict[str, list[float]]


async def run(args: argparse.Namespace, urls: dict[str, str]) -> tuple[Samples, Samples]:
    rng = random.Random(args.seed)
    systems = [[rng.randrange(256) for _ in range(args.prompt_len)] for _ in range(4)]
    times: Samples = {name: [] for name in urls}
    own: Samples = {name: [] for name in urls}
    bar = tqdm(total=args.clients * args.rounds, desc="rounds", unit="round")

    async def client(k: int) -> None:
        crng = random.Random(args.seed * 1000 + k)
        conn = aiohttp.TCPConnector(limit=2)
        async with aiohttp.ClientSession(connector=conn) as http:
            for _ in range(args.rounds):
                prompt = crng.choice(systems) + [crng.randrange(256) for _ in range(16)]
                body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
                order = list(urls.items())
                crng.shuffle(order)
                for name, url in order:
                    start = time.perf_counter()
                    async with http.post(f"{url}/v1/completions", json=body) as resp:
                        await resp.read()
                        if resp.status != 200:
                            raise SystemExit(f"{name}: {resp.status} {await resp.text()}")
                    times[name].append(time.perf_counter() - start)
                    own[name].append(own_s(resp.headers["Server-Timing"]))
                bar.update()

    await asyncio.gather(*(client(k) for k in range(args.clients)))
    bar.close()
    return times, own


def record_cost_us(args: argparse.Namespace, workdir: Path) -> tuple[float, float]:
    """Microseconds per record: queueing it (what the handler pays, on the event loop) and
    writing it (the writer thread: orjson and the file), for a record of this run's size."""
    from array import array

    from bus_schemas import Sampling
    from router.record import Recorder, _default

    rng = random.Random(args.seed)
    ids = array("I", [rng.randrange(256) for _ in range(args.prompt_len + 16)])
    out = [rng.randrange(256) for _ in range(args.max_tokens)]
    body = {"prompt": list(ids), "max_tokens": args.max_tokens, "temperature": 0}

    def record() -> dict[str, object]:
        return {
            "type": "request", "time": time.time(), "endpoint": "/v1/completions",
            "status": 200, "request": body, "input_ids": ids, "seed": None,
            "sampling": [Sampling(args.max_tokens)],
            "choices": [{"output_ids": out, "text": "x" * len(out), "finish_reason": "length"}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out),
                      "cached_tokens": {"device": 256, "host": 0, "storage": 0}},
            "ttft_s": 0.01, "itl_s": [0.001] * (len(out) - 1), "e2e_s": 0.02,
            "engine_id": "engine-0", "bucket": "default", "route_reason": "cache",
            "predicted_cached_tokens": 256, "error": None,
        }  # fmt: skip

    n = 5000
    recorder = Recorder(workdir / "micro.jsonl", {"type": "header"}, max_queue=n + 1)
    start = time.perf_counter()
    for _ in range(n):
        recorder.write(record())
    queue_us = (time.perf_counter() - start) / n * 1e6
    recorder.close()
    recs = [record() for _ in range(n)]
    with (workdir / "micro2.jsonl").open("wb") as f:
        start = time.perf_counter()
        for rec in recs:
            f.write(orjson.dumps(rec, default=_default) + b"\n")
        write_us = (time.perf_counter() - start) / n * 1e6
    return queue_us, write_us


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def bootstrap_ratio(
    on: list[float], off: list[float], seed: int, n: int = 2000
) -> tuple[float, float]:
    rng = random.Random(seed)
    ratios = []
    for _ in range(n):
        a = [rng.choice(on) for _ in on]
        b = [rng.choice(off) for _ in off]
        ratios.append(statistics.median(a) / statistics.median(b))
    ratios.sort()
    return ratios[int(0.025 * n)], ratios[int(0.975 * n)]


async def metric(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-record-") as tmp:
        workdir = Path(tmp)
        record = workdir / "traffic.jsonl"
        mesh_proc, mesh = start_mesh(args, workdir)
        routers = {}
        try:
            routers["off"] = start_router(mesh, [], workdir, "off")
            routers["on"] = start_router(mesh, ["--record", str(record)], workdir, "on")
            urls = {name: url for name, (_, url) in routers.items()}

            async def go() -> tuple[Samples, Samples, float]:
                async with aiohttp.ClientSession() as http:
                    for url in urls.values():
                        await wait_ready(http, url, args.engines)
                times, own = await run(args, urls)
                dropped = await metric(urls["on"], "hicache_router_record_dropped_total")
                return times, own, dropped

            times, own, dropped = asyncio.run(go())
        finally:
            for proc, _ in routers.values():
                stop(proc)
            stop(mesh_proc)
        lines = len(record.read_bytes().splitlines()) if record.exists() else 0
        queue_us, write_us = record_cost_us(args, workdir)
    n = len(times["on"])
    print(
        f"\n{args.clients} clients x {args.rounds} rounds, each request to both routers "
        f"(random order); prompt {args.prompt_len + 16} tokens, max_tokens {args.max_tokens}, "
        f"{args.engines} tiny engines"
    )
    for title, data in (("end to end", times), ("router's own time", own)):
        print(f"\n{title}:")
        print(f"  {'router':<12} {'n':>6} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}")
        for name in ("off", "on"):
            t = data[name]
            print(
                f"  {'record ' + name:<12} {len(t):>6} {pct(t, 0.5) * 1e3:>8.2f} "
                f"{pct(t, 0.9) * 1e3:>8.2f} {pct(t, 0.99) * 1e3:>8.2f}"
            )
        ratio = statistics.median(data["on"]) / statistics.median(data["off"])
        lo, hi = bootstrap_ratio(data["on"], data["off"], args.seed)
        print(f"  p50 on / off: {ratio:.3f}  (bootstrap 95% interval [{lo:.3f}, {hi:.3f}])")
    own_p50_us = statistics.median(own["off"]) * 1e6
    print(
        f"\nper record (this run's size, measured alone): {queue_us:.1f} us to build and queue "
        f"(the handler, on the event loop), {write_us:.1f} us to serialize and append (the "
        f"writer thread); together {100 * (queue_us + write_us) / own_p50_us:.1f}% of the "
        f"router's own p50 without recording ({own_p50_us / 1e3:.2f} ms)"
    )
    print(
        f"recorded lines: {lines} (header + {n} requests expected: {n + 1}); dropped: {dropped:g}"
    )


if __name__ == "__main__":
    main()
