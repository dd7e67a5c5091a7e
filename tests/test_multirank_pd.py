"""P/D between multi-rank engines over the bus (issue 8, point 8; issue 10 across layouts).

A TP2 prefill engine and a TP2 decode engine (each a world of 2 rank processes) over a real
nats-server, the test playing the router as in `test_pd_service.py`. Prefill packs its KV
past `decode_prefix_len` on every rank, rank 0 collects the shards and sends one frame per
rank for each chunk; decode's rank 0 hands each chunk to its ranks once every rank's frame
of it came. Outputs equal a cold TP1 run, only the suffix moves, and the second turn reuses
decode's own cache. A TP1 prefill feeds the TP2 decode engine too, and the TP2 prefill a
TP1 decode engine: decode cuts its ranks' heads and layers from the frames
(`tests/test_pd_layouts.py` checks the logits of every such pairing at the engine level).
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import AsyncIterator, Iterator

import nats
import pytest
from nats.aio.client import Client as NATS
from test_pd_service import cold, pd_generate, spawn, stats, wait_engines

from services.launch.servers import ServerProcess

TP2 = ("--tp-size", "2")


@pytest.fixture(scope="module")
def engines(nats_server: ServerProcess) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    url = nats_server.url
    procs = {
        "tp2-prefill": spawn(url, "tp2-prefill", *TP2, "--disaggregation-mode", "prefill"),
        "tp2-decode": spawn(
            url,
            "tp2-decode",
            *TP2,
            "--disaggregation-mode",
            "decode",
            "--disaggregation-decode-enable-radix-cache",
            "--enable-hierarchical-cache",
        ),
        "tp1-prefill": spawn(url, "tp1-prefill", "--disaggregation-mode", "prefill"),
        "tp1-decode": spawn(
            url,
            "tp1-decode",
            "--disaggregation-mode",
            "decode",
            "--disaggregation-decode-enable-radix-cache",
        ),
    }
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    assert all(p.returncode == 0 for p in procs.values())


@pytest.fixture
async def nc(nats_server: ServerProcess) -> AsyncIterator[NATS]:
    client = await nats.connect(nats_server.url)
    yield client
    await client.drain()


async def test_tp2_prefill_to_tp2_decode_equals_tp1(
    engines: dict[str, subprocess.Popen[bytes]], nc: NATS
) -> None:
    await wait_engines(nc, {"tp2-prefill", "tp2-decode"})
    turn1 = list(range(30, 71))  # 41 tokens
    turn2 = [*turn1, *range(100, 117)]  # 58 tokens
    for turn, prompt in enumerate((turn1, turn2)):
        reply, chunks = await pd_generate(nc, "tp2-prefill", "tp2-decode", prompt, 6)
        first = chunks[0]
        assert [t for c in chunks for t in c.token_ids] == cold(prompt, 6)
        assert first.transferred_tokens == len(prompt) - reply.decode_prefix_len
        assert reply.decode_prefix_len == (0 if turn == 0 else 40)
    s = await stats(nc, "tp2-decode")
    assert s["cached_tokens_device"] == 40  # turn 2 reused decode's own cache


@pytest.mark.parametrize(
    ("prefill", "decode"), [("tp1-prefill", "tp2-decode"), ("tp2-prefill", "tp1-decode")]
)
async def test_prefill_and_decode_of_other_layouts(
    engines: dict[str, subprocess.Popen[bytes]], nc: NATS, prefill: str, decode: str
) -> None:
    await wait_engines(nc, {prefill, decode})
    base = 3 if prefill == "tp1-prefill" else 5  # each pairing its own conversation
    turn1 = [(base * i + 1) % 256 for i in range(29)]
    turn2 = [*turn1, *range(200, 211)]
    for turn, prompt in enumerate((turn1, turn2)):
        reply, chunks = await pd_generate(nc, prefill, decode, prompt, 5)
        assert chunks[-1].error is None, chunks[-1].error
        assert [t for c in chunks for t in c.token_ids] == cold(prompt, 5)
        assert chunks[0].transferred_tokens == len(prompt) - reply.decode_prefix_len
        assert reply.decode_prefix_len == (0 if turn == 0 else 28)
