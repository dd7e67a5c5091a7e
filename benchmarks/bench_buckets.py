"""Buckets: conversations that grow from the short bucket (TP1) into the long one (TP2), with
unified storage keys against rank-suffix keys, both arms in one run.

Two meshes run side by side (`hicache-mesh up`, each with its own nats, redis, router, file
store and engines): `--bucket short:tp=1,max_len=S --bucket long:tp=2` on `tiny-tp`, every
tier on (device, host, a `file` store written through). Arm "unified" uses
`--hicache-storage-key-scheme unified` (layer partition 4, head partition 2: the article's
grid); arm "rank-suffix" the rank-suffixed keys, which a TP2 engine cannot read from a TP1
one. Each of `--conversations` conversations resends its whole history every turn (a
`--system-tokens` start, then the last output and `--user-tokens` new tokens per turn), so
after a few turns prompt + max_tokens outgrows the short bucket and the router sends it to
the long one. Requests go turn by turn over the conversations, each to arm A then arm B
(order alternating), one at a time, streamed through the router's OpenAI API.

Reported, per arm, on the first long-bucket turn of each conversation: the cached tokens by
tier, as a fraction of the prefix the short bucket stored (its KV of the previous turn's
prompt and output but the last token, whole pages), and the median TTFT (request sent to the
first streamed token). Both arms' outputs must be equal (float64, greedy).

    .venv/bin/python benchmarks/bench_buckets.py
    .venv/bin/python benchmarks/bench_buckets.py --conversations 16 --turns 6
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
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from tqdm import tqdm

from services.launch.servers import free_port

MODEL = "tiny-tp"


@dataclass(slots=True)
class Arm:
    name: str
    scheme: list[str]  # the storage key flags
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    store: str = ""
    # per conversation: (stored prefix, device, host, storage, ttft) of its first long turn
    first_long: list[tuple[int, int, int, int, float]] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start(arm: Arm, args: argparse.Namespace, workdir: Path) -> None:
    arm.port = free_port()
    arm.store = str(workdir / f"store-{arm.name}")
    arm.log = workdir / f"up-{arm.name}.log"
    argv = [sys.executable, "-m", "services.cli", "up", "--port", str(arm.port)]
    argv += ["--model", MODEL, "--page-size", str(args.page_size)]
    argv += ["--bucket", f"short:tp=1,max_len={args.short_max_len},engines=1"]
    argv += ["--bucket", "long:tp=2,engines=1"]
    argv += ["--max-total-tokens", str(args.max_total_tokens), "--enable-hierarchical-cache"]
    argv += ["--hicache-storage-backend", "file", "--hicache-storage-dir", arm.store]
    argv += arm.scheme
    with arm.log.open("wb") as log:
        arm.proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def wait_up(arm: Arm, timeout_s: float = 240.0) -> None:
    assert arm.proc is not None and arm.log is not None
    deadline = time.monotonic() + timeout_s
    while b"is up" not in arm.log.read_bytes():
        if arm.proc.poll() is not None or time.monotonic() > deadline:
            tail = arm.log.read_text(errors="replace")[-3000:]
            raise SystemExit(f"arm {arm.name}: `up` did not come up:\n{tail}")
        time.sleep(0.2)


def stop(arm: Arm) -> None:
    if arm.proc is None:
        return
    with contextlib.suppress(ProcessLookupError):
        arm.proc.send_signal(signal.SIGINT)
    try:
        arm.proc.wait(60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(arm.proc.pid, signal.SIGKILL)
        arm.proc.wait()


async def complete(
    http: aiohttp.ClientSession, arm: Arm, prompt: list[int], max_tokens: int
) -> tuple[str, list[int], dict[str, int], float]:
    """One streamed completion: (bucket engine, output ids, cached tokens by tier, TTFT)."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    ttft = 0.0
    ids: list[int] = []
    tiers: dict[str, int] = {}
    async with http.post(f"{arm.url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise SystemExit(f"arm {arm.name}: {resp.status} {await resp.text()}")
        engine = resp.headers.get("X-Hicache-Engine", "")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            for choice in event.get("choices", []):
                if choice.get("token_ids"):
                    ttft = ttft or time.perf_counter() - sent
                    ids += choice["token_ids"]
            if event.get("usage"):
                tiers = event["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]
    return engine, ids, tiers, ttft


def stored_prefix(history: list[int], page: int) -> int:
    """Tokens of `history` (the previous turn's prompt and output) whose KV the short
    bucket held in whole pages: all but the last token, rounded down to a page."""
    n = len(history) - 1
    return n - n % page


async def run(args: argparse.Namespace, arms: list[Arm]) -> None:
    rng = random.Random(args.seed)
    histories = [
        [rng.randrange(256) for _ in range(args.system_tokens)] for _ in range(args.conversations)
    ]
    last_short = [0] * args.conversations  # stored prefix after the last short turn
    moved = [False] * args.conversations
    for arm in arms:
        arm.outputs = [[] for _ in range(args.conversations)]
    timeout = aiohttp.ClientTimeout(total=300)
    total = args.turns * args.conversations
    async with aiohttp.ClientSession(timeout=timeout) as http:
        with tqdm(total=total, desc="turns", unit="turn") as bar:
            for turn in range(args.turns):
                for c in range(args.conversations):
                    prompt = histories[c] + [rng.randrange(256) for _ in range(args.user_tokens)]
                    order = arms if (turn + c) % 2 == 0 else arms[::-1]
                    results = {}
                    for arm in order:
                        results[arm.name] = await complete(http, arm, prompt, args.output_tokens)
                    outs = {name: r[1] for name, r in results.items()}
                    if len({tuple(o) for o in outs.values()}) != 1:
                        raise SystemExit(f"conversation {c} turn {turn}: the arms' outputs differ")
                    engines = {r[0].split("-")[0] for r in results.values()}
                    if len(engines) != 1:
                        raise SystemExit(f"the arms chose different buckets: {engines}")
                    (bucket,) = engines
                    if bucket == "long" and not moved[c]:
                        moved[c] = True
                        for arm in arms:
                            _, _, tiers, ttft = results[arm.name]
                            arm.first_long.append(
                                (
                                    last_short[c],
                                    tiers.get("device", 0),
                                    tiers.get("host", 0),
                                    tiers.get("storage", 0),
                                    ttft,
                                )
                            )
                    output = outs[arms[0].name]
                    histories[c] = prompt + output
                    if bucket == "short":
                        last_short[c] = stored_prefix(histories[c], args.page_size)
                    bar.update()


def report(args: argparse.Namespace, arms: list[Arm]) -> None:
    print(
        f"\n{args.conversations} conversations x {args.turns} turns; {MODEL}, page "
        f"{args.page_size}; system {args.system_tokens}, +{args.user_tokens} user and "
        f"{args.output_tokens} output tokens per turn; short bucket TP1 max_len "
        f"{args.short_max_len}, long bucket TP2"
    )
    moved = len(arms[0].first_long)
    print(f"conversations that moved to the long bucket: {moved} of {args.conversations}")
    if not moved:
        return
    print("\nfirst long-bucket turn of each conversation:")
    head = f"  {'arm':<12} {'stored':>8} {'device':>7} {'host':>6} {'storage':>8}"
    print(f"{head} {'reused':>7} {'TTFT p50 ms':>12}")
    ttft: dict[str, float] = {}
    for arm in arms:
        stored = sum(r[0] for r in arm.first_long)
        dev, host, sto = (sum(r[i] for r in arm.first_long) for i in (1, 2, 3))
        ttft[arm.name] = statistics.median(r[4] for r in arm.first_long) * 1e3
        reused = (dev + host + sto) / stored if stored else 0.0
        print(
            f"  {arm.name:<12} {stored:>8} {dev:>7} {host:>6} {sto:>8} {reused:>7.3f} "
            f"{ttft[arm.name]:>12.1f}"
        )
    a, b = arms[0].name, arms[1].name
    print(f"\nTTFT p50 {a} / {b}: {ttft[a] / ttft[b]:.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--system-tokens", type=int, default=400)
    parser.add_argument("--user-tokens", type=int, default=150)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--short-max-len", type=int, default=1024)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-total-tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    unified = ["--hicache-storage-key-scheme", "unified"]
    unified += ["--hicache-storage-layer-partition", "4", "--hicache-storage-head-partition", "2"]
    arms = [
        Arm("unified", unified),
        Arm("rank-suffix", ["--hicache-storage-key-scheme", "rank-suffix"]),
    ]
    with tempfile.TemporaryDirectory(prefix="bench-buckets-") as tmp:
        try:
            for arm in arms:
                start(arm, args, Path(tmp))
            for arm in arms:
                wait_up(arm)
            asyncio.run(run(args, arms))
        finally:
            for arm in arms:
                stop(arm)
    report(args, arms)


if __name__ == "__main__":
    main()
