"""Model architecture description and the named presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    """Map a `--dtype` string to a torch dtype; a clear error for anything else."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}") from None


def resolve_dtype(name: str, model: str, device: str) -> str:
    """`--dtype auto` (the default of the flags): float64 for the random-weight presets, whose
    cache-off oracle is then exact; for real checkpoints bfloat16 on a GPU, float32 on the
    CPU (which has no fast bfloat16 matmul). Any other name is returned as given."""
    if name != "auto":
        return name
    if model in PRESETS:
        return "float64"
    return "bfloat16" if device.startswith("cuda") else "float32"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A Llama/Qwen2-style decoder. Derived sizes are properties, never stored twice."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_len: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False  # Qwen2 puts a bias on q/k/v
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    name: str = "custom"

    def __post_init__(self) -> None:
        for field in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "context_len",
        ):
            if getattr(self, field) <= 0:
                raise ValueError(f"ModelConfig.{field} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes: object) -> ModelConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


# The byte-level tokenizer's vocabulary: 256 byte values, then the special tokens.
BYTE_BOS_ID = 256
BYTE_EOS_ID = 257
BYTE_VOCAB_SIZE = 260

PRESETS: dict[str, ModelConfig] = {
    # Runs anywhere in seconds; with --dtype float64 the cache-off oracle is exact.
    "tiny": ModelConfig(
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        context_len=8192,
        eos_token_ids=(BYTE_EOS_ID,),
        bos_token_id=BYTE_BOS_ID,
        name="tiny",
    ),
    # For tensor parallelism: 8 query and 8 KV heads split over TP 2, 4 or 8, and 8 layers
    # over PP 2, 4 or 8; float64-exact like tiny.
    "tiny-tp": ModelConfig(
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_layers=8,
        num_heads=8,
        num_kv_heads=8,
        head_dim=8,
        context_len=8192,
        eos_token_ids=(BYTE_EOS_ID,),
        bos_token_id=BYTE_BOS_ID,
        name="tiny-tp",
    ),
}
