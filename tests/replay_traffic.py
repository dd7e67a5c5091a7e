"""Mixed traffic for the replay tests: what a recording mesh (`up --record`) is sent.

`mixed_requests(n)` is a fixed list of (endpoint, body) pairs, cycling through kinds:
completions (token-id and text prompts, whole and streamed), chat (whole and streamed),
`/generate`, sampled requests with and without a seed (n=2 among them), and requests the
router rejects (bad parameters, bodies that are not JSON objects, an unknown model). Prompts
share prefixes (a few system prompts), so the cache serves some of them. `send_traffic`
sends them `clients` at a time with small seeded gaps, so arrivals are spread and overlap.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import aiohttp

SYSTEMS = ["Answer in one word. ", "Translate to French. ", "Summarize this. "]
TOKEN_PREFIXES = [[(31 * k + 7 * i) % 250 + 3 for i in range(16)] for k in range(3)]

# Raw bodies the router refuses (sent as bytes): not JSON, and JSON that is not an object.
NOT_JSON = b"{not json"
NOT_AN_OBJECT = b"[1, 2, 3]"


def _rejected(i: int) -> tuple[str, Any]:
    """One request the router refuses with a 4xx, by `i`."""
    cases: list[tuple[str, Any]] = [
        ("/v1/completions", {"prompt": "hi", "temperature": -1}),
        ("/v1/completions", {"prompt": "hi", "top_p": 2.0}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [1]}),
        ("/v1/completions", {"max_tokens": 4}),  # no prompt
        ("/v1/completions", NOT_JSON),
        ("/v1/chat/completions", NOT_AN_OBJECT),
        ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}),  # 404
        ("/v1/completions", {"prompt": [1, 2, 300000]}),  # outside the vocabulary
        ("/generate", {"text": "hi", "sampling_params": {"bogus": 1}}),
    ]
    return cases[i % len(cases)]


def mixed_requests(n: int = 200) -> list[tuple[str, Any]]:
    """`n` requests, a fixed mix (the same list every call)."""
    out: list[tuple[str, Any]] = []
    for i in range(n):
        kind = i % 10
        system = SYSTEMS[i % len(SYSTEMS)]
        prefix = TOKEN_PREFIXES[i % len(TOKEN_PREFIXES)]
        question = f"Q{i // 10}: item {i % 7}?"
        chat = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        if kind == 0:  # greedy, token ids, whole
            body: Any = {"prompt": [*prefix, i % 250, (3 * i) % 250], "max_tokens": 6}
            out.append(("/v1/completions", body | {"temperature": 0, "ignore_eos": True}))
        elif kind == 1:  # greedy text, streamed without usage
            out.append(
                ("/v1/completions", {"prompt": system + question, "max_tokens": 5, "stream": True})
            )
        elif kind == 2:  # chat greedy, whole
            out.append(("/v1/chat/completions", {"messages": chat, "max_completion_tokens": 5}))
        elif kind == 3:  # chat sampled, no seed (the router draws one), streamed with usage
            body = {"messages": chat, "max_tokens": 6, "temperature": 0.8, "stream": True}
            out.append(("/v1/chat/completions", body | {"stream_options": {"include_usage": True}}))
        elif kind == 4:  # seeded sampling, two choices
            body = {"prompt": [*prefix, i % 250], "max_tokens": 5, "temperature": 1.0}
            out.append(("/v1/completions", body | {"seed": 1000 + i, "n": 2, "ignore_eos": True}))
        elif kind == 5:  # sampled, no seed, streamed with usage
            body = {"prompt": system + question, "max_tokens": 6, "temperature": 0.7, "top_p": 0.9}
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            out.append(("/v1/completions", body))
        elif kind == 6:  # SGLang native, greedy, every other one streamed
            sp = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
            body = {"input_ids": [*prefix, 9, i % 250], "sampling_params": sp}
            out.append(("/generate", body | {"stream": (i // 10) % 2 == 1}))
        elif kind == 7:
            out.append(_rejected(i // 10))
        elif kind == 8:  # chat greedy streamed, with a stop string
            body = {"messages": chat, "max_tokens": 8, "stream": True, "stop": ["zz"]}
            out.append(("/v1/chat/completions", body))
        else:  # an exact repeat of an earlier prompt: a whole-prefix hit
            body = {
                "prompt": [*prefix, 5, 6],
                "max_tokens": 4,
                "temperature": 0,
                "ignore_eos": True,
            }
            out.append(("/v1/completions", body))
    return out


async def send_traffic(url: str, requests: list[tuple[str, Any]], clients: int = 8) -> Counter[int]:
    """Every request once, `clients` at a time, each after a small seeded gap; the statuses."""
    sem = asyncio.Semaphore(clients)
    gaps = random.Random(12)
    statuses: Counter[int] = Counter()

    async def one(http: aiohttp.ClientSession, endpoint: str, body: Any) -> None:
        data = body if isinstance(body, bytes) else None
        async with (
            sem,
            http.post(
                f"{url}{endpoint}",
                json=None if data is not None else body,
                data=data,
                headers={"Content-Type": "application/json"},
            ) as r,
        ):
            await r.read()
            statuses[r.status] += 1

    async with aiohttp.ClientSession() as http, asyncio.TaskGroup() as tg:
        for endpoint, body in requests:
            await asyncio.sleep(gaps.uniform(0.0, 0.02))
            tg.create_task(one(http, endpoint, body))
    return statuses
