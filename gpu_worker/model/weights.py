"""Filling a `LlamaModel` with weights: seeded random ones, or a Hugging Face checkpoint."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from gpu_worker.model.config import PRESETS, ModelConfig
from gpu_worker.model.gguf import (
    GGUF_PRESETS,
    file_digest,
    gguf_path,
    load_gguf,
    read_gguf_meta,
)
from gpu_worker.model.llama import LlamaModel, create_model
from gpu_worker.model.shard import ModelShard, shard_model
from gpu_worker.parallel.config import ParallelConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")

# Random weights: how much larger q/k projections are than 1/sqrt(fan_in) (sharp attention).
QK_SCALE = 3.0

# the weights QK_SCALE enlarges (MLA: the latent projection and the keys' up-projection)
_QK_WEIGHTS = ("q_proj.weight", "k_proj.weight", "kv_a_proj.weight", "k_b_proj.weight")

# Checkpoint tensors that carry no weights of ours (old Llama exports store RoPE buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def build_model(
    name_or_path: str | Path,
    device: torch.device | str,
    dtype: torch.dtype,
    seed: int = 0,
    batch_invariant: bool = False,
    context_len: int | None = None,
    parallel: ParallelConfig | None = None,
    rank: int = 0,
    prepack: bool = True,
) -> tuple[ModelConfig, LlamaModel]:
    """A preset name (e.g. "tiny") gives seeded random weights; a directory is loaded as a
    Hugging Face checkpoint (`seed` is then unused). `batch_invariant`: see `llama.py`.
    `context_len` sets a preset's context length (random weights have no trained limit, so
    `--context-length` may raise it, e.g. for 32K-token benchmarks); a checkpoint keeps its own.

    With a `parallel` layout of more than one rank, the returned model is world rank
    `rank`'s shard (`shard.py`), cut from the whole model built on the CPU first; the
    returned config is always the whole model's. Once the weights are final, float32 CPU
    ones are prepacked for oneDNN unless `prepack` is False (`LlamaModel.prepack_weights`)."""
    if parallel is not None and parallel.world_size > 1:
        config, full = build_model(
            name_or_path, "cpu", dtype, seed, batch_invariant, context_len, prepack=False
        )
        shard = ModelShard.of(config, parallel, rank)  # a clear error if it does not split
        model = shard_model(full, shard, device, dtype)
    elif str(name_or_path) in PRESETS:
        config = PRESETS[str(name_or_path)]
        if context_len is not None:
            config = config.replace(context_len=context_len)
        model = create_model(config, device, dtype, batch_invariant)
        init_random_weights(model, seed)
    elif (gguf := gguf_path(name_or_path)) is not None:
        config, model = load_gguf(gguf, device, dtype)
        model.set_batch_invariant(batch_invariant)
    elif Path(name_or_path).is_dir():
        config, model = load_hf_checkpoint(name_or_path, device, dtype)
        model.set_batch_invariant(batch_invariant)
    else:
        raise ValueError(
            f"{str(name_or_path)!r} is neither a preset "
            f"({sorted(PRESETS) + sorted(GGUF_PRESETS)}), "
            "a *.gguf file nor a Hugging Face checkpoint directory"
        )
    if prepack:
        model.prepack_weights()
    return config, model


def model_config_of(name_or_path: str | Path, context_len: int | None = None) -> ModelConfig:
    """The whole model's config without building it (a launcher checks the layout first)."""
    if str(name_or_path) in PRESETS:
        config = PRESETS[str(name_or_path)]
        return config if context_len is None else config.replace(context_len=context_len)
    gguf = gguf_path(name_or_path)
    if gguf is not None:
        return read_gguf_meta(gguf).model_config()
    path = Path(name_or_path)
    if path.is_dir():
        return config_from_hf(json.loads((path / "config.json").read_text()), name=path.name)
    raise ValueError(
        f"{str(name_or_path)!r} is neither a preset ({sorted(PRESETS) + sorted(GGUF_PRESETS)}), "
        "a *.gguf file nor a Hugging Face checkpoint directory"
    )


def weights_digest(name_or_path: str | Path, seed: int = 0) -> str:
    """16 hex characters naming the weights `build_model(name_or_path, seed=seed)` fills
    in, for the page-hash namespace (`bus_schemas.make_namespace`): KV made by other weights
    must never be read as these weights' KV, whatever `--model` string both were given.

    A preset (seeded random weights): the preset's config, without its context length (the
    weights do not depend on it), and the seed. A GGUF file: the content digest the GGUF
    cache already keeps (`gguf.file_digest`, computed once per file). A Hugging Face
    directory: `config.json` and every weights file (`*.safetensors`, `*.bin`), each by its
    content digest, remembered the same way. Nothing about TP/PP or the device."""
    h = hashlib.blake2b(digest_size=8)
    if str(name_or_path) in PRESETS:
        config = dataclasses.asdict(PRESETS[str(name_or_path)])
        del config["context_len"]
        text = json.dumps({"random": config, "seed": seed}, sort_keys=True, default=str)
        h.update(text.encode())
    elif (gguf := gguf_path(name_or_path)) is not None:
        h.update(b"gguf:" + file_digest(gguf).encode())
    elif (path := Path(name_or_path)).is_dir():
        weights = (f for pattern in ("*.safetensors", "*.bin") for f in path.glob(pattern))
        files = [path / "config.json", *sorted(weights)]
        for f in files:
            h.update(f"{f.name}:{file_digest(f)}\n".encode())
    else:
        h.update(str(name_or_path).encode())  # build_model refuses it; the name is all we have
    return h.hexdigest()


@torch.no_grad()
def init_random_weights(model: LlamaModel, seed: int) -> None:
    """Overwrite every parameter with seeded random values, identical on any device.

    Values are drawn on CPU in float32 in parameter order, then copied to the model's
    device/dtype. Scales keep activations near unit size at any depth and make logits
    non-degenerate: embeddings ~N(0, 1); input projections ~N(0, 1/fan_in); the residual
    outputs (`o_proj`, `down_proj`) a further 1/sqrt(2 * num_layers) smaller; q/k/v biases
    ~N(0, 0.02); norm weights 1. Queries and keys (MLA: the latent projection and the keys'
    up-projection) are `QK_SCALE` larger: with near-uniform
    attention the next token depends on little but the current one, and greedy output falls
    into one repeated token, which would hide KV read from the wrong place; sharp attention
    makes continuations depend on the context (tests/test_model.py checks they are varied).
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    residual_scale = 1.0 / math.sqrt(2 * model.num_layers)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        if name == "embed_tokens.weight":
            std = 1.0
        elif name.endswith(".bias"):
            std = 0.02
        else:
            std = 1.0 / math.sqrt(param.shape[1])
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                std *= residual_scale
            elif name.endswith(_QK_WEIGHTS):
                std *= QK_SCALE
        values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * std
        param.copy_(values)


def config_from_hf(hf: dict[str, Any], name: str = "custom") -> ModelConfig:
    """Map a Hugging Face `config.json` (llama or qwen2) onto a `ModelConfig`.

    Raises ValueError for what this model does not implement: another model_type, RoPE
    scaling, an activation other than silu, sliding-window attention, Llama's o_proj/MLP
    biases.
    """
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r}; only silu")
    if model_type == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        raise ValueError("Llama attention_bias/mlp_bias (o_proj/MLP biases) are not supported")
    sliding = hf.get("use_sliding_window") or "sliding_attention" in hf.get("layer_types", [])
    if sliding:
        raise ValueError("sliding-window attention is not supported")
    num_heads = hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        context_len=hf["max_position_embeddings"],
        rope_theta=_rope_theta(hf),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        attention_bias=model_type == "qwen2",
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        eos_token_ids=_token_ids(hf.get("eos_token_id")),
        bos_token_id=hf.get("bos_token_id"),
        name=name,
    )


def _rope_theta(hf: dict[str, Any]) -> float:
    """rope_theta from transformers 4.x (`rope_theta`, `rope_scaling`) or 5.x
    (`rope_parameters: {rope_type, rope_theta}`) configs; only plain (default) RoPE."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for spec in (params, scaling):
        rope_type = spec.get("rope_type", spec.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"unsupported RoPE scaling {rope_type!r}; only default RoPE")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def load_hf_checkpoint(
    path: str | Path, device: torch.device | str, dtype: torch.dtype
) -> tuple[ModelConfig, LlamaModel]:
    """Load a Hugging Face llama/qwen2 directory (`config.json` + `*.safetensors`, sharded
    with `model.safetensors.index.json` or not) into a `LlamaModel` on `device` in `dtype`.

    Every model parameter must come from the checkpoint exactly once with the right shape;
    anything else in the checkpoint is an error, except `lm_head.weight` when embeddings
    are tied (ignored) and stored RoPE buffers.
    """
    path = Path(path)
    config = config_from_hf(json.loads((path / "config.json").read_text()), name=path.name)
    model = create_model(config, device, dtype)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for hf_name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                name = _model_name(hf_name)
                if name not in params:
                    if not _ignored(name, config):
                        unexpected.append(hf_name)
                    continue
                if name in loaded:
                    raise ValueError(f"{hf_name} appears in more than one file under {path}")
                _copy_into(params[name], f.get_tensor(hf_name), hf_name)
                loaded.add(name)
    if unexpected:
        raise ValueError(f"unexpected tensors in {path}: {sorted(unexpected)[:10]}")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"tensors missing from {path}: {[_hf_name(n) for n in missing][:10]}")
    return config, model


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.exists()]
        if absent:
            raise ValueError(f"files named in {index} do not exist: {absent}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    return files


def _model_name(hf_name: str) -> str:
    """`model.layers.0.mlp.up_proj.weight` -> `layers.0.mlp.up_proj.weight`; `lm_head.*` stays."""
    return hf_name.removeprefix("model.")


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else "model." + name


def _ignored(name: str, config: ModelConfig) -> bool:
    tied_head = config.tie_word_embeddings and name == "lm_head.weight"
    return tied_head or name.endswith(_IGNORED_SUFFIXES)


def _copy_into(param: torch.Tensor, value: torch.Tensor, hf_name: str) -> None:
    if value.shape != param.shape:
        raise ValueError(
            f"{hf_name}: checkpoint shape {tuple(value.shape)} != model shape {tuple(param.shape)}"
        )
    param.copy_(value)  # converts dtype and moves to the model's device
