"""Bus message codec: microseconds per `encode()` and per `decode()` of the messages every
request and every engine heartbeat puts on NATS.

Every request crosses the codec four times on its way (the router encodes a
`GenerateRequest`, the engine decodes it, encodes `TokenChunk`s, the router decodes them),
and the index decodes every `KVEventBatch`. With `--baseline DIR` (a `bus_schemas/` from
another commit, e.g. `git archive HEAD bus_schemas | tar -x -C DIR`) the same messages are
timed with that codec in a child process, and the table shows both and their ratio.

    .venv/bin/python benchmarks/bench_codec.py --baseline /tmp/codec-head
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import timeit
from array import array
from collections.abc import Callable


def messages() -> dict[str, object]:
    """Representative messages, built with whichever `bus_schemas` is on the path."""
    from bus_schemas import GenerateRequest, Heartbeat, KVEvent, KVEventBatch, Sampling, TokenChunk

    def request(n: int) -> object:
        return GenerateRequest(
            request_id="0" * 32,
            input_ids=array("I", range(n)),
            sampling=Sampling(max_new_tokens=16, temperature=0.7, top_p=0.9, seed=1),
            reply_to="_INBOX.abcdefghijklmnop.17",
            cache_salt="",
        )

    chunk = TokenChunk(
        request_id="0" * 32, seq=3, token_ids=[17], engine_id="engine-0", prompt_tokens=1024
    )
    heartbeat = Heartbeat(
        engine_id="engine-0",
        bucket="default",
        epoch="0" * 16,
        model="tiny",
        namespace="ns",
        page_size=64,
        context_len=32768,
        vocab_size=32000,
        eos_token_ids=[2],
        running=3,
        waiting=0,
        inflight_tokens=4096,
        interval_s=0.5,
    )
    events = [KVEvent("stored", "device", [f"{i:032x}" for i in range(16)]) for _ in range(8)]
    batch = KVEventBatch(
        engine_id="engine-0", bucket="default", epoch="0" * 16, seq=9, namespace="ns", events=events
    )
    return {
        "GenerateRequest 1K ids": request(1024),
        "GenerateRequest 32K ids": request(32768),
        "TokenChunk": chunk,
        "Heartbeat": heartbeat,
        "KVEventBatch 8x16 pages": batch,
    }


def per_call_us(fn: Callable[[], object]) -> float:
    """The best of 5 repeats of at least 0.2 s each, in microseconds per call."""
    timer = timeit.Timer(fn)
    number, _ = timer.autorange()
    return min(timer.repeat(repeat=5, number=number)) / number * 1e6


def measure() -> dict[str, list[float]]:
    """[encode us, decode us] per message."""
    out = {}
    for name, msg in messages().items():
        decode = functools.partial(type(msg).decode, msg.encode())  # type: ignore[attr-defined]
        out[name] = [per_call_us(msg.encode), per_call_us(decode)]  # type: ignore[attr-defined]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", metavar="DIR", help="also time the bus_schemas/ in DIR")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # the child
    args = parser.parse_args()
    ours = measure()
    if args.json:
        print(json.dumps(ours))
        return
    base: dict[str, list[float]] = {}
    if args.baseline:  # timed between two runs of ours, each side's best kept
        env = dict(os.environ, PYTHONPATH=os.path.abspath(args.baseline))
        child = [sys.executable, os.path.abspath(__file__), "--json"]
        done = subprocess.run(child, env=env, cwd=args.baseline, check=True, capture_output=True)
        base = json.loads(done.stdout)
        again = measure()
        ours = {k: [min(a, b) for a, b in zip(v, again[k], strict=True)] for k, v in ours.items()}
    head = f"{'message':<26}{'encode us':>10}{'decode us':>10}"
    if base:
        head += f"{'base enc':>10}{'base dec':>10}{'enc x':>7}{'dec x':>7}"
    print(head)
    for name, (enc, dec) in ours.items():
        line = f"{name:<26}{enc:>10.2f}{dec:>10.2f}"
        if name in base:
            benc, bdec = base[name]
            line += f"{benc:>10.2f}{bdec:>10.2f}{benc / enc:>7.2f}{bdec / dec:>7.2f}"
        print(line)


if __name__ == "__main__":
    main()
