"""Tenants, hidden cache figures and redacted recording on real meshes (issue 20, findings
3 and 8): `hicache-mesh up --model tiny` with one engine, so every request meets the same
prefix cache and a miss can only come from the salt.

- tenant B sending tenant A's prompt gets 0 cached tokens, A again gets its hit; a shared
  namespace both may use shares;
- with `--hide-cache-stats` no response carries a cache figure (body or header), while the
  mesh did reuse the prefix (its /metrics, an operator's, counts it);
- `--record-redact --record-token-ids drop`: a probe carrying secret strings in every field
  leaves none of them, and no token ids, in the 0600 record file.
"""

from __future__ import annotations

import stat
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from fault_helpers import MeshSpec, UpMesh, running_mesh

PROMPT = [(7 * i + 3) % 200 + 20 for i in range(48)]  # 12 pages of 4 tokens
TENANTS = "key-a alice shared=team\nkey-b bob shared=team\n"
SECRETS = [f"SECRET-{name}-7f3a" for name in ("A", "B", "C", "D", "E", "F", "G", "H", "I", "J")]


def post(
    url: str, path: str, body: Any, key: str | None = None
) -> tuple[int, dict[str, str], bytes]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url + path, orjson.dumps(body), headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def cached(url: str, key: str, prompt: list[int], **extra: Any) -> int:
    status, _, data = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 2} | extra, key)
    assert status == 200, data
    return int(orjson.loads(data)["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.fixture(scope="module")
def tenant_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[UpMesh, Path]]:
    workdir = tmp_path_factory.mktemp("tenants")
    keys = workdir / "tenants"
    keys.write_text(TENANTS)
    record = workdir / "traffic.jsonl"
    extra = ("--tenant-keys", str(keys), "--record", str(record), "--record-redact")
    spec = MeshSpec(engines=1, extra=(*extra, "--record-token-ids", "drop"))
    with running_mesh(spec, tmp_path_factory, "tenants") as mesh:
        yield mesh, record


def test_a_tenant_never_hits_another_tenants_prefix(tenant_mesh: tuple[UpMesh, Path]) -> None:
    url = tenant_mesh[0].url
    assert cached(url, "key-a", PROMPT) == 0
    assert cached(url, "key-a", PROMPT) >= 40  # A's own prefix: a hit
    assert cached(url, "key-b", PROMPT) == 0  # B, the same prompt: nothing of A's
    assert cached(url, "key-a", PROMPT) >= 40  # A again: still its hit
    assert cached(url, "key-b", PROMPT) >= 40  # and B's own, now that B sent it
    status, _, data = post(url, "/v1/completions", {"prompt": PROMPT}, "no-such-key")
    assert status == 401 and orjson.loads(data)["error"]["code"] == "invalid_api_key"


def test_a_shared_namespace_shares(tenant_mesh: tuple[UpMesh, Path]) -> None:
    url = tenant_mesh[0].url
    other = [t + 1 for t in PROMPT]
    assert cached(url, "key-a", other, cache_namespace="team") == 0
    assert cached(url, "key-b", other, cache_namespace="team") >= 40  # A's, shared
    assert cached(url, "key-b", other) == 0  # B's own namespace: not A's shared pages
    status, _, data = post(
        url, "/v1/completions", {"prompt": other, "cache_namespace": "x"}, "key-a"
    )
    assert status == 403 and orjson.loads(data)["error"]["code"] == "permission_denied"


def _probes() -> list[tuple[str, dict[str, Any]]]:
    """Requests carrying a secret in every field a client can fill (some refused)."""
    s = SECRETS
    sampling = {"max_new_tokens": 2, "stop": [s[1]], "temperature": 0}
    return [
        ("/generate", {"text": s[0], "sampling_params": sampling, "cache_salt": s[2]}),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": s[3], "name": s[4]}],
                "user": f"{s[5]}@example.com",
                "stop": s[6],
                "cache_salt": s[7],
                "max_tokens": 2,
                "metadata": {"note": s[8]},
                s[9]: s[9],  # an unknown field: its name is text too
            },
        ),
        ("/v1/completions", {"prompt": s[0], "max_tokens": 2, "user": s[5], "stop": [s[1]]}),
        ("/v1/completions", {"prompt": s[0], "suffix": s[3]}),  # refused: suffix
        ("/v1/completions", {"prompt": s[0], "model": s[4]}),  # refused: no such model
        ("/generate", {"text": s[0], s[9]: 1}),  # refused: unknown field
    ]


def test_a_redacted_recording_holds_no_secret_and_no_token_ids(
    tenant_mesh: tuple[UpMesh, Path],
) -> None:
    url, record = tenant_mesh[0].url, tenant_mesh[1]
    statuses = [post(url, path, body, "key-a")[0] for path, body in _probes()]
    assert statuses == [200, 200, 200, 400, 404, 400]
    deadline = time.monotonic() + 30  # the writer thread flushes after each batch
    while time.monotonic() < deadline:
        lines = [orjson.loads(line) for line in record.read_bytes().splitlines()]
        probes = [r for r in lines if r["type"] == "request"][-len(statuses) :]
        if len(probes) == len(statuses) and probes[-1]["status"] == 400:
            break
        time.sleep(0.1)
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    text = record.read_text()
    for secret in SECRETS:
        assert secret not in text, secret
    head = orjson.loads(text.splitlines()[0])
    assert head["redacted"] is True and head["token_ids"] == "drop"
    assert [r["status"] for r in probes] == statuses
    for r in lines[1:]:
        assert r["input_ids"] is None, r
        assert all(c["output_ids"] is None and c["text"] is None for c in r["choices"]), r
    gen, chat, comp = probes[:3]
    assert gen["request"] == {"sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    assert gen["redacted_fields"] == ["cache_salt", "sampling_params.stop", "text"]
    assert chat["request"] == {"max_tokens": 2}
    assert chat["redacted_fields"] == ["...", "cache_salt", "messages", "stop", "user"]
    assert comp["input_len"] == len(SECRETS[0]) and comp["choices"][0]["output_len"] == 2
    assert probes[4]["request"]["model"] == "(redacted)"


@pytest.fixture(scope="module")
def hidden_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpMesh]:
    spec = MeshSpec(engines=1, extra=("--hide-cache-stats",))
    with running_mesh(spec, tmp_path_factory, "hidden") as mesh:
        yield mesh


def _cached_metric(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("hicache_router_cached_tokens_total{")
    )


def test_hidden_cache_figures_appear_nowhere(hidden_mesh: UpMesh) -> None:
    url = hidden_mesh.url
    before = _cached_metric(url)
    answers = []
    for _ in range(2):  # the second meets the first's prefix
        for path, body in [
            ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}),
            ("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}),
            (
                "/v1/completions",
                {
                    "prompt": PROMPT,
                    "max_tokens": 2,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            ),
            ("/generate", {"input_ids": PROMPT, "stream": True}),
        ]:
            if path == "/v1/chat/completions":
                body = body | {"max_tokens": 2}
            answers.append(post(url, path, body))
    assert _cached_metric(url) - before >= 3 * 40  # the mesh did reuse the prefix
    for status, headers, data in answers:
        assert status == 200, data
        lowered = {k.lower() for k in headers}
        for name in ("server-timing", "x-hicache-engine", "x-hicache-prefill-engine"):
            assert name not in lowered, headers
        assert b"cached" not in data and b"engine" not in data, data[:500]
        assert b"prompt_tokens" in data  # usage is there, without its cache figures
