"""Small llama GGUF files written with the `gguf` package, for loader tests.

`write_llama_gguf` takes a model's Hugging Face-layout state dict (this project's parameter
names) and writes it the way llama.cpp's converter does: GGUF tensor names, `attn_q` and
`attn_k` rows interleaved per head for its RoPE, each tensor in the requested type, and a
byte-level BPE tokenizer (the 256 byte tokens, a few merges, two control tokens) with a
chat template.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from gpu_worker.model.config import ModelConfig
from gpu_worker.model.gguf import byte_alphabet

TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
CONTROL = ["<|im_start|>", "<|im_end|>"]

_PARTS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(name: str) -> str:
    fixed = {
        "embed_tokens.weight": "token_embd.weight",
        "norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in fixed:
        return fixed[name]
    _, layer, rest = name.split(".", 2)
    return f"blk.{layer}.{_PARTS[rest.removesuffix('.weight')]}.weight"


def interleave_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Half-split rows -> llama.cpp's interleaved pairs, head by head (its converter's
    `permute`)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def vocab() -> tuple[list[str], list[int]]:
    """Byte tokens (GPT-2's alphabet), merged tokens, control tokens; and their types."""
    tokens = [byte_alphabet()[b] for b in range(256)]
    tokens += [m.replace(" ", "") for m in MERGES] + CONTROL
    types = [1] * (len(tokens) - len(CONTROL)) + [3] * len(CONTROL)
    return tokens, types


def write_llama_gguf(
    path: Path,
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    raw: dict[str, tuple[GGMLQuantizationType, bytes]] | None = None,
) -> Path:
    """Write `state` as a llama GGUF. Matrices go in `qtype`, norms in F32; `raw` replaces a
    tensor (by our name) with bytes stored under another type."""
    tokens, types = vocab()
    assert config.vocab_size == len(tokens)
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(config.num_layers)
    w.add_context_length(config.context_len)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_rope_dimension_count(config.head_dim)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    for name, tensor in state.items():
        a = tensor.detach().to(torch.float32).numpy()
        if name.endswith("q_proj.weight"):
            a = interleave_rope_rows(a, config.num_heads)
        elif name.endswith("k_proj.weight"):
            a = interleave_rope_rows(a, config.num_kv_heads)
        if raw and name in raw:  # (rows, bytes per row) of another type
            kind, data = raw[name]
            rows = np.frombuffer(data, np.uint8).reshape(a.shape[0], -1)
            w.add_tensor(gguf_name(name), rows, raw_dtype=kind)
        elif a.ndim == 1 or qtype == GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(a))
        else:  # quantize gives the stored form, (rows, bytes per row) for block types
            w.add_tensor(gguf_name(name), quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
