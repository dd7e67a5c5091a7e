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
    """A Llama/Qwen2-style decoder. Derived sizes are properties, never stored twice.

    With `kv_lora_rank > 0` attention is a simplified DeepSeek-style multi-head latent
    attention (MLA, `mla.MLAttention`): per token and layer the KV cache holds one latent
    row of `kv_lora_rank + qk_rope_head_dim` elements (the normed compressed KV, then one
    rotary key part shared by every head); each query head's K (`head_dim` from the latent,
    plus the shared rotary part) and V (`head_dim`) are up-projected from it. The cache then
    has one "KV head" (`num_kv_heads` must be 1), the latent row, replicated over TP."""

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
    kv_lora_rank: int = 0  # MLA: the latent's compressed KV width; 0: MHA/GQA
    qk_rope_head_dim: int = 0  # MLA: rotary dims of each query head and of the shared key

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
        if self.kv_lora_rank < 0 or self.qk_rope_head_dim < 0:
            raise ValueError("kv_lora_rank and qk_rope_head_dim must not be negative")
        if self.mla and (self.num_kv_heads != 1 or self.qk_rope_head_dim % 2):
            raise ValueError("MLA needs num_kv_heads 1 (the latent) and an even qk_rope_head_dim")
        if not self.mla and self.qk_rope_head_dim:
            raise ValueError("qk_rope_head_dim is for MLA (kv_lora_rank > 0) only")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def mla(self) -> bool:
        """Multi-head latent attention: one latent KV row per token, replicated over TP."""
        return self.kv_lora_rank > 0

    @property
    def num_kv(self) -> int:
        """KV planes per layer in the cache: 2 (K and V) for MHA, 1 (the latent) for MLA."""
        return 1 if self.mla else 2

    @property
    def kv_head_dim(self) -> int:
        """Elements per cached KV head per token: `head_dim`, or MLA's latent row."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def rope_dim(self) -> int:
        """Rotary dims per head: the whole head, or MLA's rotary part."""
        return self.qk_rope_head_dim if self.mla else self.head_dim

    def replace(self, **changes: object) -> ModelConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


# The byte-level tokenizer's vocabulary: 256 byte values, then the special tokens.
BYTE_BOS_ID = 256
BYTE_EOS_ID = 257
BYTE_VOCAB_SIZE = 260

# Runs anywhere in seconds; with --dtype float64 the cache-off oracle is exact.
_TINY = ModelConfig(
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
)

PRESETS: dict[str, ModelConfig] = {
    "tiny": _TINY,
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
    # tiny-tp's shape with multi-head latent attention (see ModelConfig): 8 query heads
    # (TP 2, 4 or 8) of 8 + 4 dims over one 20-element latent row per token and layer,
    # replicated on every TP rank; 8 layers over PP 2, 4 or 8; float64-exact like tiny.
    "tiny-mla": ModelConfig(
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_layers=8,
        num_heads=8,
        num_kv_heads=1,
        head_dim=8,
        context_len=8192,
        eos_token_ids=(BYTE_EOS_ID,),
        bos_token_id=BYTE_BOS_ID,
        name="tiny-mla",
        kv_lora_rank=16,
        qk_rope_head_dim=4,
    ),
    # A speculative draft for tiny (same byte vocabulary) of another shape: 2 layers and one
    # KV head of 32 dims, so its KV pool differs from the target's in every dimension but
    # the page; float64-exact like tiny.
    "tiny-draft": dataclasses.replace(
        _TINY, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, name="tiny-draft"
    ),
    # tiny-draft's TP-ready sibling: tiny's first 2 layers (the seeded weights are drawn in
    # parameter order, so they are tiny's own), one per stage at PP 2, and 2 KV heads (one
    # per rank at TP 2): its KV pool differs from tiny's in the layer count; it proposes
    # tiny's tokens part of the time. float64-exact like tiny.
    "tiny-tp-draft": dataclasses.replace(_TINY, num_layers=2, name="tiny-tp-draft"),
    # SmolLM2-135M's KV bytes per token on a small random model, for P/D and KV-size tests:
    # 15 layers x 3 KV heads x head_dim 64 x K,V x 8 bytes (float64) = 46,080 bytes, what
    # SmolLM2's 30 layers hold in float32; float64-exact like tiny, and cheap to compute.
    "tiny-smollm2-kv": ModelConfig(
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_layers=15,
        num_heads=3,
        num_kv_heads=3,
        head_dim=64,
        context_len=8192,
        eos_token_ids=(BYTE_EOS_ID,),
        bos_token_id=BYTE_BOS_ID,
        name="tiny-smollm2-kv",
    ),
}
