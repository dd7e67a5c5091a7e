"""The router speaks each model's language from its engines' model cards, and passes every
OpenAI parameter through (issue 11).

Against scripted engines (`fake_engine`) on a real nats-server and real HTTP:
- the card's tokenizer (a `tokenizers` JSON) tokenizes prompts and detokenizes output, its
  Jinja chat template renders chat prompts, sandboxed; a template that refuses the
  messages is a 400, one that does not compile a 500 for chat only;
- engines of one model with different cards never get a request tokenized by the other's;
- no card yet: 503 `model_loading`; an unknown model 404; two models and none named 400;
- `n` choices: choice 0 first, the others on its engine once its prompt is cached, seeds
  `seed + i`, usage counting the prompt once;
- logprobs in each endpoint's shape, streamed and whole;
- every sampling parameter reaches the engine as given (a parameter the router dropped
  fails here; what the engine does with each is tests/test_sampling.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from typing import Any

import pytest
import tokenizers
from fake_engine import FakeEngine, expected_tokens, expected_top, read_sse, running_mesh
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from services.launch.servers import ServerProcess

pytestmark = pytest.mark.timeout(60)

WORDS = ["[UNK]", "hello", "world", "<s>", "</s>", "<|user|>", "<|bot|>", "ok", "again"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'system' %}{{ raise_exception('no system role here') }}{% endif %}"
    "<|{{ 'user' if m.role == 'user' else 'bot' }}|> {{ m.content }} "
    "{% endfor %}{% if add_generation_prompt %}<|bot|>{% endif %}"
)


def word_tokenizer_json() -> str:
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = tokenizers.Tokenizer(WordLevel(vocab, "[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<|user|>", "<|bot|>"])
    return str(tok.to_str())


WORD_ENGINE = {
    "tokenizer_json": word_tokenizer_json(),
    "chat_template": TEMPLATE,
    "vocab_size": len(WORDS),
    "bos_token_id": 3,
    "model": "words",
}


async def post(mesh: Any, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    r = await mesh.client.post(path, json=body)
    return r.status, await r.json()


async def test_the_cards_tokenizer_and_chat_template_are_used(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    async with running_mesh(nats_server.url, redis_server.url, 1, engine_kw=WORD_ENGINE) as mesh:
        engine = mesh.engines[0]
        status, body = await post(
            mesh, "/v1/completions", {"prompt": "hello world", "max_tokens": 3}
        )
        assert status == 200, body
        assert engine.received[-1].input_ids.tolist() == [1, 2]  # words, not UTF-8 bytes
        want = expected_tokens([1, 2], 3, len(WORDS))  # [2, 3, 2]: world <s> world
        assert body["choices"][0]["token_ids"] == want
        assert body["choices"][0]["text"] == "world world"  # special tokens dropped

        chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
        status, body = await post(mesh, "/v1/chat/completions", chat)
        assert status == 200, body
        # "<s><|user|> hello <|bot|>", tokenized without adding specials a second time
        assert engine.received[-1].input_ids.tolist() == [3, 5, 1, 6]

        # the template's raise_exception: a 400 naming it, nothing sent to the engine
        sent = len(engine.received)
        bad = {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]}
        status, body = await post(mesh, "/v1/chat/completions", bad)
        assert status == 400 and body["error"]["code"] == "chat_template_error"
        assert "no system role here" in body["error"]["message"]
        assert len(engine.received) == sent


async def test_the_cards_eos_token_reaches_the_chat_template(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    """A template that closes each turn with `{{ eos_token }}` (as many real ones do) gets the
    card's first eos id as text, so the prompt holds that token."""
    template = (
        "{% for m in messages %}<|{{ 'user' if m.role == 'user' else 'bot' }}|> "
        "{{ m.content }} {{ eos_token }} {% endfor %}{% if add_generation_prompt %}<|bot|>"
        "{% endif %}"
    )
    kw = WORD_ENGINE | {"chat_template": template, "eos_token_ids": [4]}  # "</s>"
    async with running_mesh(nats_server.url, redis_server.url, 1, engine_kw=kw) as mesh:
        chat = {
            "messages": [
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "again"},
            ],
            "max_tokens": 1,
        }
        status, body = await post(mesh, "/v1/chat/completions", chat)
        assert status == 200, body
        # <|user|> hello </s> <|bot|> ok </s> <|user|> again </s> <|bot|>
        assert mesh.engines[0].received[-1].input_ids.tolist() == [5, 1, 4, 6, 7, 4, 5, 8, 4, 6]


async def test_a_card_whose_digest_is_not_the_heartbeats_is_refused(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    """An engine answers the card request with another card than the one its heartbeats
    name: the router must not parse requests for that engine with it."""
    engine = FakeEngine("liar-a", nats_server.url, context_len=300)
    engine.served_card = dataclasses.replace(engine.card, chat_template="{{ messages }}")
    assert engine.served_card.digest != engine.card.digest
    async with running_mesh(nats_server.url, redis_server.url, 1) as mesh:
        await engine.start()
        try:
            mesh.engines[0].silent = True  # only the lying engine is left
            await asyncio.sleep(1.0)  # the silent one's heartbeats lapse
            deadline = asyncio.get_running_loop().time() + 5.0
            while engine.card_requests < 2:  # asked again: the first card was refused
                if asyncio.get_running_loop().time() > deadline:
                    break  # never asked again: the first card was taken (the bug)
                await asyncio.sleep(0.05)
            status, body = await post(
                mesh, "/v1/completions", {"prompt": "hi", "model": "tiny-test", "max_tokens": 1}
            )
            assert status == 503 and body["error"]["code"] == "model_loading", body
            assert engine.received == []
            text = await (await mesh.client.get("/metrics")).text()
            assert re.search(r'bus_errors_total\{kind="model_card"\} [1-9]', text), text
            engine.served_card = None  # the right card: served
            await mesh.wait_for_ready(["liar-a"])
            status, body = await post(mesh, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
            assert status == 200 and len(engine.received) == 1
        finally:
            await engine.stop()


async def test_a_sandboxed_template_cannot_reach_python(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    kw = {"chat_template": escape}
    async with running_mesh(nats_server.url, redis_server.url, 1, engine_kw=kw) as mesh:
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        status, body = await post(mesh, "/v1/chat/completions", chat)
        assert status == 400 and "unsafe" in body["error"]["message"], body
        assert mesh.engines[0].received == []


async def test_a_template_that_does_not_compile_fails_chat_only(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    kw = {"chat_template": "{% for m in messages %}"}  # never closed
    async with running_mesh(nats_server.url, redis_server.url, 1, engine_kw=kw) as mesh:
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        status, body = await post(mesh, "/v1/chat/completions", chat)
        assert status == 500 and body["error"]["code"] == "chat_template_unusable"
        status, _ = await post(mesh, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
        assert status == 200


async def test_engines_of_one_model_with_other_cards_never_mix(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    """Same served name, different tokenizers (a rolling upgrade): a request is tokenized by
    the card most engines speak and goes only to engines of that card."""
    async with running_mesh(
        nats_server.url, redis_server.url, 3, engine_kw={"model": "m", "vocab_size": 300}
    ) as mesh:
        a, b, c = mesh.engines
        c.tokenizer_json = word_tokenizer_json()  # c restarts with another card
        await c.beat()
        await mesh.wait_for_engines(3)
        for _ in range(6):
            status, _ = await post(mesh, "/v1/completions", {"prompt": "hello", "max_tokens": 1})
            assert status == 200
        assert c.received == [] and len(a.received) + len(b.received) == 6
        assert all(r.input_ids.tolist() == list(b"hello") for r in a.received + b.received)


async def test_no_card_yet_is_503_model_loading(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    # another card than the mesh's engine (its context length), which nobody answers yet
    engine = FakeEngine("nocard-a", nats_server.url, mute_card=True, context_len=300)
    async with running_mesh(nats_server.url, redis_server.url, 1) as mesh:
        await engine.start()
        try:
            mesh.engines[0].silent = True  # only the card-less engine is left
            await asyncio.sleep(1.0)  # the silent one's heartbeats lapse
            status, body = await post(
                mesh, "/v1/completions", {"prompt": "hi", "model": "tiny-test"}
            )
            assert status == 503 and body["error"]["code"] == "model_loading", body
            health = await mesh.client.get("/health")
            assert health.status == 503
            assert "model cards" in (await health.json())["error"]["message"]
            assert engine.received == []
            engine.mute_card = False  # the card arrives: served
            await mesh.wait_for_ready(["nocard-a"])
            status, body = await post(mesh, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
            assert status == 200 and len(engine.received) == 1
        finally:
            await engine.stop()


async def test_unknown_model_404_and_two_models_need_a_name(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    async with running_mesh(nats_server.url, redis_server.url, 1) as mesh:
        status, body = await post(mesh, "/v1/completions", {"prompt": "hi", "model": "gpt-9"})
        assert status == 404 and body["error"]["code"] == "model_not_found"
        other = FakeEngine("words-a", nats_server.url, **WORD_ENGINE)
        await other.start()
        try:
            await mesh.wait_for_ready([mesh.engines[0].engine_id, "words-a"])
            status, body = await post(mesh, "/v1/completions", {"prompt": "hi"})
            assert status == 400 and body["error"]["param"] == "model"
            assert "['tiny-test', 'words']" in body["error"]["message"]
            status, _ = await post(mesh, "/v1/completions", {"prompt": "hello", "model": "words"})
            assert status == 200 and other.received[-1].input_ids.tolist() == [1]
            models = await (await mesh.client.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["tiny-test", "words"]
        finally:
            await other.stop()


# ------------------------------------------------------------------ n choices


async def test_n_choices_share_the_prompt_on_choice_zeros_engine(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    kw = {"token_delay_s": 0.01}
    async with running_mesh(nats_server.url, redis_server.url, 3, engine_kw=kw) as mesh:
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "n": 3, "seed": 41, "temperature": 0.7}
        status, out = await post(mesh, "/v1/completions", body)
        assert status == 200, out
        assert [c["index"] for c in out["choices"]] == [0, 1, 2]
        want = expected_tokens([5, 6, 7], 4)
        assert all(c["token_ids"] == want for c in out["choices"])
        served = [e for e in mesh.engines if e.received]
        assert len(served) == 1  # every choice where choice 0 cached the prompt
        seeds = sorted(r.sampling.seed for r in served[0].received)
        assert seeds == [41, 42, 43]
        assert out["usage"]["prompt_tokens"] == 3 and out["usage"]["completion_tokens"] == 12

        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2}
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        r = await mesh.client.post("/v1/chat/completions", json=body)
        events, done = await read_sse(r)
        assert done and events[-1]["usage"]["completion_tokens"] == 6
        by_choice: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
        for e in events[:-1]:
            (choice,) = e["choices"]
            by_choice[choice["index"]].append(choice)
        for choices in by_choice.values():
            assert choices[0]["delta"] == {"role": "assistant", "content": ""}
            assert sum(len(c["token_ids"]) for c in choices) == 3
            assert choices[-1]["finish_reason"] == "length"


async def test_n_choices_fail_together(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    async with running_mesh(
        nats_server.url, redis_server.url, 1, engine_kw={"error": (400, "bad logit_bias")}
    ) as mesh:
        status, body = await post(mesh, "/v1/completions", {"prompt": "hi", "n": 4})
        assert status == 400 and "bad logit_bias" in body["error"]["message"]
        assert len(mesh.engines[0].received) == 1  # the others never started


# ------------------------------------------------------------------ logprobs


async def test_logprobs_in_every_shape(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    async with running_mesh(nats_server.url, redis_server.url, 1) as mesh:
        ids = list(b"abc")
        want = expected_tokens(ids, 3)
        body = {"prompt": "abc", "max_tokens": 3, "logprobs": 2}
        status, out = await post(mesh, "/v1/completions", body)
        assert status == 200, out
        lp = out["choices"][0]["logprobs"]
        assert lp["tokens"] == [chr(t) for t in want]
        assert lp["token_logprobs"] == [-0.1, -0.2, -0.3]
        assert lp["top_logprobs"] == [
            {chr(t): v for t, v in expected_top(tok, i, 2)} for i, tok in enumerate(want)
        ]
        assert lp["text_offset"] == [0, 1, 2]
        assert mesh.engines[0].received[-1].sampling.logprobs == 2

        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        chat |= {"logprobs": True, "top_logprobs": 1}
        status, out = await post(mesh, "/v1/chat/completions", chat)
        content = out["choices"][0]["logprobs"]["content"]
        toks = out["choices"][0]["token_ids"]
        assert [c["bytes"] for c in content] == [[t] for t in toks]
        assert [c["logprob"] for c in content] == [-0.1, -0.2]
        assert [len(c["top_logprobs"]) for c in content] == [1, 1]
        assert content[0]["top_logprobs"][0] == {
            "token": chr(toks[0]),
            "logprob": -0.1,
            "bytes": [toks[0]],
        }

        # streamed: each chunk carries its own tokens' logprobs
        r = await mesh.client.post("/v1/completions", json=body | {"stream": True})
        events, _ = await read_sse(r)
        streamed = [v for e in events for v in e["choices"][0]["logprobs"]["token_logprobs"]]
        assert streamed == [-0.1, -0.2, -0.3]
        offsets = [v for e in events for v in e["choices"][0]["logprobs"]["text_offset"]]
        assert offsets == [0, 1, 2]

        gen = {"text": "abc", "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
        gen["top_logprobs_num"] = 1
        status, out = await post(mesh, "/generate", gen)
        meta = out["meta_info"]
        assert meta["output_token_logprobs"] == [[-0.1, want[0], None], [-0.2, want[1], None]]
        assert meta["output_top_logprobs"] == [[[-0.1, want[0], None]], [[-0.2, want[1], None]]]

        status, out = await post(mesh, "/v1/completions", {"prompt": "abc", "max_tokens": 2})
        assert out["choices"][0]["logprobs"] is None
        assert mesh.engines[0].received[-1].sampling.logprobs is None


# ------------------------------------------------------------------ parameters


async def test_every_sampling_parameter_reaches_the_engine(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    params = {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 12,
        "min_p": 0.05,
        "repetition_penalty": 1.3,
        "presence_penalty": 0.4,
        "frequency_penalty": -0.6,
        "logit_bias": {"100": -7.5, "42": 3},
        "seed": 9,
        "stop_token_ids": [77],
        "ignore_eos": True,
    }
    want = {k: v for k, v in params.items() if k not in ("logit_bias", "stop_token_ids")}
    async with running_mesh(nats_server.url, redis_server.url, 1) as mesh:
        engine = mesh.engines[0]
        for path, body in (
            ("/v1/completions", {"prompt": "x"} | params),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]} | params),
            ("/generate", {"text": "x", "sampling_params": params}),
        ):
            status, out = await post(mesh, path, body)
            assert status == 200, (path, out)
            s = engine.received[-1].sampling
            assert {k: getattr(s, k) for k in want} == want, path
            assert s.logit_bias == {"42": 3.0, "100": -7.5} and s.stop_token_ids == [77], path
        # top_k -1 is "off" (SGLang's spelling) and reaches the engine as 0
        await post(mesh, "/v1/completions", {"prompt": "x", "top_k": -1})
        assert engine.received[-1].sampling.top_k == 0
        # the engine stops on a stop token id it was given
        status, out = await post(mesh, "/v1/completions", {"prompt": [76], "stop_token_ids": [77]})
        assert out["choices"][0]["token_ids"] == [77]
        assert out["choices"][0]["finish_reason"] == "stop"


# ------------------------------------------------------------------ buckets


async def test_buckets_by_length_with_fallback(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    """Two buckets: prompt + max_tokens up to 64 go to `short`, longer to `long`; `long`'s
    engine has another context length (another card, the same speech) and still serves;
    with `short` gone, short prompts go to `long` too."""
    from router.buckets import Bucket

    buckets = (Bucket("long"), Bucket("short", 64))
    async with running_mesh(nats_server.url, redis_server.url, 1, buckets=buckets) as mesh:
        (default,) = mesh.engines
        default.silent = True  # its bucket ("default") is not one of the router's
        short = FakeEngine("bk-short", nats_server.url, bucket="short", context_len=256)
        long = FakeEngine("bk-long", nats_server.url, bucket="long", context_len=2048)
        for e in (short, long):
            await e.start()
        try:
            await mesh.wait_for_ready(["bk-short", "bk-long"])
            status, _ = await post(mesh, "/v1/completions", {"prompt": [1] * 40, "max_tokens": 8})
            assert status == 200 and len(short.received) == 1 and not long.received
            body = {"prompt": [1] * 60, "max_tokens": 8}  # 68 > 64: the long bucket
            status, out = await post(mesh, "/v1/completions", body)
            assert status == 200 and len(long.received) == 1, out
            body = {"prompt": [1] * 300, "max_tokens": 8}  # beyond short's context too
            status, out = await post(mesh, "/v1/completions", body)
            assert status == 200 and len(long.received) == 2, out
            short.silent = True
            await mesh.wait_for_ready(["bk-long"], timeout_s=5)
            status, _ = await post(mesh, "/v1/completions", {"prompt": [1] * 10, "max_tokens": 4})
            assert status == 200 and len(long.received) == 3  # fell back to the larger bucket
            text = await (await mesh.client.get("/metrics")).text()
            assert 'hicache_router_bucket_requests_total{bucket="short"} 1.0' in text
            assert 'hicache_router_bucket_requests_total{bucket="long"} 3.0' in text
        finally:
            for e in (short, long):
                await e.stop()


async def test_a_bucket_serves_exactly_its_max_len(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    """prompt + max_tokens == max_len goes to that bucket; one token more to the next."""
    from router.buckets import Bucket, select

    buckets = (Bucket("short", 64), Bucket("long"))
    assert select(buckets, 64, lambda b: True) == "short"
    assert select(buckets, 65, lambda b: True) == "long"
    async with running_mesh(nats_server.url, redis_server.url, 0, buckets=buckets[::-1]) as mesh:
        short = FakeEngine("edge-short", nats_server.url, bucket="short", context_len=256)
        long = FakeEngine("edge-long", nats_server.url, bucket="long", context_len=256)
        for e in (short, long):
            await e.start()
        try:
            await mesh.wait_for_ready(["edge-short", "edge-long"])
            for prompt_len, engine in ((56, short), (57, long)):
                body = {"prompt": [1] * prompt_len, "max_tokens": 8}
                status, out = await post(mesh, "/v1/completions", body)
                assert status == 200, out
                assert [len(r.input_ids) for r in engine.received] == [prompt_len], out
        finally:
            for e in (short, long):
                await e.stop()


async def test_a_buckets_context_length_is_its_shortest_engines(
    nats_server: ServerProcess, redis_server: ServerProcess
) -> None:
    """Two engines of one model and bucket, contexts 128 and 256: a request that fits only
    the longer one is refused (it could land on either), and nothing reaches an engine."""
    async with running_mesh(nats_server.url, redis_server.url, 0) as mesh:
        engines = [
            FakeEngine(f"ctx-{n}", nats_server.url, context_len=n, namespace="ctx")
            for n in (128, 256)
        ]
        for e in engines:
            await e.start()
        try:
            await mesh.wait_for_ready(["ctx-128", "ctx-256"])
            body = {"prompt": [1] * 150, "max_tokens": 8}
            status, out = await post(mesh, "/v1/completions", body)
            assert status == 400 and out["error"]["code"] == "context_length_exceeded", out
            assert "context length 128" in out["error"]["message"], out
            assert all(e.received == [] for e in engines)
            body = {"prompt": [1] * 120, "max_tokens": 8}  # fits both
            status, out = await post(mesh, "/v1/completions", body)
            assert status == 200, out
        finally:
            for e in engines:
                await e.stop()


def test_bucket_flags_parse_and_order() -> None:
    from router.__main__ import build_parser, config_from_args
    from router.buckets import Bucket, parse_bucket

    argv = ["--bucket", "long", "--bucket", "short:tp=1,pp=1,max_len=4096"]
    config = config_from_args(build_parser().parse_args(argv))
    assert config.buckets == (Bucket("short", 4096), Bucket("long"))
    for bad in ("", "a b", "x:max_len=0", "x:max_len=abc", "x:oops"):
        with pytest.raises(ValueError):
            parse_bucket(bad)
    with pytest.raises(ValueError, match="unique"):
        config_from_args(build_parser().parse_args(["--bucket", "a", "--bucket", "a:max_len=3"]))
    with pytest.raises(ValueError, match="unbounded"):
        config_from_args(build_parser().parse_args(["--bucket", "a", "--bucket", "b"]))
