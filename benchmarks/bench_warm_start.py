"""What an engine serving SmolLM2-135M-Instruct waits for at start, cold and warm.

Each round runs, in fresh processes, back to back (interleaved, so machine noise hits both):
- cold: an empty weight cache (`HICACHE_CACHE_DIR` a new directory): the GGUF is hashed,
  de-quantized and cached;
- warm: the shared cache of this run holds the entry.
and reports, per case, the median and the spread (min-max) over rounds of:
- `torch`: importing torch;
- `weights`: the weights ready (`build_model`: the cache read or de-quantization, the
  model's parameters, the oneDNN prepack of float32 CPU weights);
- `tokenizer`: the GGUF's tokenizer (cached beside the weights);
- `kv pool`: the device KV pool of `--max-total-tokens` tokens, zeroed;
- `engine`: a whole `Engine(...)` after the rows above, in the same process (the weight
  cache is filled by then in both cases: what a warm engine costs beyond importing torch);
- `service`: `python -m services.engine` spawned to its first heartbeat on NATS (what `up`
  and the router wait for).
Also: hashing the GGUF (its content digest keys the cache) against reading the digest
remembered for its path, size and mtime.

    .venv/bin/python benchmarks/bench_warm_start.py --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

MODEL = "smollm2-135m-instruct"

PHASES = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads(int(sys.argv[2]))
t_torch = time.perf_counter() - t0
from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.cache.hicache import CacheConfig
from gpu_worker.memory.device_pool import DeviceKVPool
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.model.tokenizer import load_tokenizer
from gpu_worker.model.weights import build_model
model, tokens = sys.argv[1], int(sys.argv[3])
out = {"torch": t_torch}
t = time.perf_counter(); config, _ = build_model(model, "cpu", torch.float32)
out["weights"] = time.perf_counter() - t
t = time.perf_counter(); load_tokenizer(model); out["tokenizer"] = time.perf_counter() - t
spec = KVSpec(config.num_layers, config.num_kv_heads, config.kv_head_dim, 16, torch.float32,
              config.num_kv)
t = time.perf_counter(); DeviceKVPool(spec, tokens // 16, torch.device("cpu"))
out["kv pool"] = time.perf_counter() - t
t = time.perf_counter()
Engine(EngineConfig(model=model, dtype="float32",
                    cache=CacheConfig(page_size=16, num_device_pages=tokens // 16))).close()
out["engine"] = time.perf_counter() - t
print(json.dumps(out))
"""


def phases(cache_dir: str, threads: int, tokens: int) -> dict[str, float]:
    env = os.environ | {"HICACHE_CACHE_DIR": cache_dir}
    cmd = [sys.executable, "-c", PHASES, MODEL, str(threads), str(tokens)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


async def service_start(nats_url: str, cache_dir: str, tokens: int) -> float:
    """Seconds from spawning an engine service to its first heartbeat."""
    import nats

    from bus_schemas import Heartbeat, subjects

    nc = await nats.connect(nats_url)
    beat: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    engine_id = f"warm-{os.getpid()}-{time.monotonic_ns()}"

    async def on(msg: object) -> None:
        if Heartbeat.decode(msg.data).engine_id == engine_id and not beat.done():  # type: ignore[attr-defined]
            beat.set_result(None)

    sub = await nc.subscribe(subjects.HEARTBEAT_ALL, cb=on)
    argv = [sys.executable, "-m", "services.engine", "--engine-id", engine_id]
    argv += ["--nats-url", nats_url, "--model", MODEL, "--max-total-tokens", str(tokens)]
    argv += ["--log-level", "WARNING"]
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=os.environ | {"HICACHE_CACHE_DIR": cache_dir})
    try:
        await asyncio.wait_for(beat, 600)
        return time.perf_counter() - start
    finally:
        proc.terminate()
        proc.wait(60)
        await sub.unsubscribe()
        await nc.close()


def digest_costs(rounds: int) -> tuple[list[float], list[float]]:
    from gpu_worker.model.gguf import file_digest, preset_path

    path = preset_path(MODEL)
    assert path is not None
    hashed, remembered = [], []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["HICACHE_CACHE_DIR"] = tmp
            t = time.perf_counter()
            file_digest(path)
            hashed.append(time.perf_counter() - t)
            t = time.perf_counter()
            file_digest(path)
            remembered.append(time.perf_counter() - t)
    return hashed, remembered


def gguf_size() -> int:
    from gpu_worker.model.gguf import preset_path

    path = preset_path(MODEL)
    assert path is not None
    return path.stat().st_size


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (engines: 1)")
    parser.add_argument("--max-total-tokens", type=int, default=32768, help="the KV pool")
    args = parser.parse_args()
    from services.launch.servers import start_nats

    nats_server = start_nats()
    warm_dir = tempfile.mkdtemp(prefix="bench-warm-")
    phases(warm_dir, args.threads, args.max_total_tokens)  # fill the shared cache
    results: dict[str, dict[str, list[float]]] = {"cold": {}, "warm": {}}
    try:
        for _ in range(args.rounds):
            for case in ("cold", "warm"):
                cache_dir = tempfile.mkdtemp(prefix="bench-cold-") if case == "cold" else warm_dir
                for name, value in phases(cache_dir, args.threads, args.max_total_tokens).items():
                    results[case].setdefault(name, []).append(value)
                if case == "cold":
                    cache_dir = tempfile.mkdtemp(prefix="bench-cold-")
                seconds = asyncio.run(
                    service_start(nats_server.url, cache_dir, args.max_total_tokens)
                )
                results[case].setdefault("service", []).append(seconds)
    finally:
        nats_server.stop()
    hashed, remembered = digest_costs(args.rounds)
    cpu = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    load = os.getloadavg()[0]
    print(
        f"{MODEL}, float32, KV pool {args.max_total_tokens} tokens; {cpu}, {os.cpu_count()} "
        f"CPUs, load average {load:.1f}; seconds, median (min-max) of {args.rounds} "
        f"interleaved rounds"
    )
    print(f"{'':10} {'cold':>20} {'warm':>20}")
    for name in results["warm"]:
        print(f"{name:10} {spread(results['cold'][name]):>20} {spread(results['warm'][name]):>20}")
    print(
        f"the GGUF's content digest ({gguf_size() / 1e6:.0f} MB): hashed {spread(hashed)} s, "
        f"remembered {statistics.median(remembered) * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
