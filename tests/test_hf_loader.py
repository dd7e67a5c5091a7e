"""Hugging Face checkpoints load onto LlamaModel and give transformers' logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from gpu_worker.model import (
    ByteTokenizer,
    ForwardBatch,
    HFTokenizer,
    LlamaModel,
    build_model,
    load_hf_checkpoint,
    load_tokenizer,
)
from gpu_worker.model.llama import DecoderLayer

DEVICE = torch.device("cpu")
TOKENS = [3, 17, 99, 42, 5, 127, 64, 8, 0, 77, 31, 12]
# transformers computes RMSNorm, the RoPE tables and (eager) softmax in float32 even for a
# float64 model, so its logits differ from ours by ~5e-8 (3e-16 once those steps are
# patched to float64); a mapping or RoPE-layout bug shows up as differences near 0.1.
ATOL = 1e-6

SIZES: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


class DenseKVCache:
    contiguous_slices = False

    def __init__(self, model: LlamaModel, num_slots: int) -> None:
        shape = (model.num_layers, 2, num_slots, model.num_kv_heads, model.head_dim)
        self.kv = torch.zeros(shape, dtype=torch.float64)

    def set_kv(self, layer: int, slot_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv[layer, 0, slot_ids] = k
        self.kv[layer, 1, slot_ids] = v

    def get_kv(self, layer: int, slot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[layer, 0, slot_ids], self.kv[layer, 1, slot_ids]

    def before_attention(self, layer: int, batch: object) -> None:
        pass

    def after_layers(self, batch: object) -> None:
        pass

    def kv_slice(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("a pool without contiguous slices is never sliced")


def save_hf_model(kind: str, path: Path, tie: bool = False, **overrides: Any) -> torch.Tensor:
    """Save a seeded random HF model to `path`; return its float64 logits (T, vocab) on TOKENS.

    Biases and norm weights are randomised too (HF initialises them to 0 and 1), so a
    mix-up between them would not go unnoticed.
    """
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    config = config_cls(**{**SIZES, **overrides}, rope_theta=5000.0, tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    with torch.no_grad():
        return model.double().eval()(torch.tensor([TOKENS])).logits[0]


def logits_per_step(model: LlamaModel, prefill_len: int) -> torch.Tensor:
    """Prefill TOKENS[:prefill_len], then decode the rest: (len(TOKENS) - prefill_len + 1, vocab)."""
    cache = DenseKVCache(model, len(TOKENS))
    slots = torch.arange(len(TOKENS))
    chunks = [(TOKENS[:prefill_len], 0)] + [
        ([t], i) for i, t in enumerate(TOKENS) if i >= prefill_len
    ]
    out = []
    for new, prefix_len in chunks:
        batch = ForwardBatch.build([(new, prefix_len, slots[: prefix_len + len(new)])], DEVICE)
        out.append(model(batch, cache)[0])
    return torch.stack(out)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    path = tmp_path_factory.mktemp("llama")
    return path, save_hf_model("llama", path)


def test_llama_matches_transformers(llama_dir: tuple[Path, torch.Tensor]) -> None:
    path, expected = llama_dir
    config, model = load_hf_checkpoint(path, DEVICE, torch.float64)
    assert (config.num_kv_heads, config.head_dim, config.rope_theta) == (2, 16, 5000.0)
    assert not config.attention_bias and not config.tie_word_embeddings
    assert model.lm_head is not None
    with torch.no_grad():
        got = logits_per_step(model, prefill_len=5)
    torch.testing.assert_close(got, expected[4:], atol=ATOL, rtol=0)
    assert (got.argmax(-1) == expected[4:].argmax(-1)).all()


def test_qwen2_bias_and_tied_embeddings(tmp_path: Path) -> None:
    expected = save_hf_model("qwen2", tmp_path, tie=True)
    config, model = build_model(tmp_path, DEVICE, torch.float64)
    assert config.attention_bias and config.tie_word_embeddings
    assert model.lm_head is None
    assert cast(DecoderLayer, model.layers[0]).self_attn.q_proj.bias is not None
    with torch.no_grad():
        got = logits_per_step(model, prefill_len=len(TOKENS) - 2)
    torch.testing.assert_close(got, expected[-3:], atol=ATOL, rtol=0)


def test_sharded_checkpoint_with_index(tmp_path: Path) -> None:
    expected = save_hf_model("llama", tmp_path / "src")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "src")
    hf.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    _, model = load_hf_checkpoint(tmp_path / "sharded", DEVICE, torch.float64)
    with torch.no_grad():
        got = logits_per_step(model, prefill_len=len(TOKENS))
    torch.testing.assert_close(got, expected[-1:], atol=ATOL, rtol=0)


def corrupt_copy(src: Path, dst: Path, edit_tensors: Any = None, edit_config: Any = None) -> Path:
    shutil.copytree(src, dst)
    if edit_tensors is not None:
        tensors = load_file(dst / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, dst / "model.safetensors")
    if edit_config is not None:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


QPROJ = "model.layers.1.self_attn.q_proj.weight"


@pytest.mark.parametrize(
    ("edit_tensors", "edit_config", "message"),
    [
        (lambda t: t.pop(QPROJ), None, "missing.*layers.1.self_attn.q_proj.weight"),
        (lambda t: t.pop("lm_head.weight"), None, "missing.*lm_head.weight"),
        (lambda t: t.update(extra=torch.zeros(2)), None, "unexpected.*'extra'"),
        (lambda t: t.update({QPROJ: torch.zeros(64, 32)}), None, "q_proj.weight.*shape"),
        (None, lambda c: c.update(model_type="mistral"), "unsupported model_type 'mistral'"),
        (
            None,
            lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}),
            "unsupported RoPE scaling 'yarn'",
        ),
        (
            None,
            lambda c: c.update(rope_scaling={"type": "linear", "factor": 2.0}),
            "unsupported RoPE scaling 'linear'",
        ),
    ],
)
def test_bad_checkpoints_fail_clearly(
    llama_dir: tuple[Path, torch.Tensor],
    tmp_path: Path,
    edit_tensors: Any,
    edit_config: Any,
    message: str,
) -> None:
    bad = corrupt_copy(llama_dir[0], tmp_path / "bad", edit_tensors, edit_config)
    with pytest.raises(ValueError, match=message):
        load_hf_checkpoint(bad, DEVICE, torch.float64)


def test_rope_theta_at_top_level(llama_dir: tuple[Path, torch.Tensor], tmp_path: Path) -> None:
    def old_style(config: dict[str, Any]) -> None:
        config.pop("rope_parameters")
        config.update(rope_theta=5000.0, rope_scaling=None)

    old = corrupt_copy(llama_dir[0], tmp_path / "old", edit_config=old_style)
    config, _ = load_hf_checkpoint(old, DEVICE, torch.float64)
    assert config.rope_theta == 5000.0


def test_load_tokenizer_reads_tokenizer_json(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"])
    tok.train_from_iterator(["the cat sat", "on the mat", "the end"], trainer=trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))

    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, HFTokenizer)
    ids = loaded.encode("the cat sat on the mat")
    assert len(ids) == 6 and ids[0] == ids[4]
    assert loaded.decode(ids) == "the cat sat on the mat"
    assert loaded.eos_token_ids == (tok.token_to_id("</s>"),)
    assert loaded.vocab_size == tok.get_vocab_size()

    (tmp_path / "tokenizer.json").unlink()
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    assert isinstance(load_tokenizer("tiny"), ByteTokenizer)
