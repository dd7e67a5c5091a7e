"""The decoder model, its weights and tokenizers, and the forward-pass contracts."""

from gpu_worker.model.config import (
    BYTE_BOS_ID,
    BYTE_EOS_ID,
    BYTE_VOCAB_SIZE,
    PRESETS,
    ModelConfig,
    parse_dtype,
)
from gpu_worker.model.forward_batch import ForwardBatch, KVCache, KVReader
from gpu_worker.model.llama import LlamaModel, create_model
from gpu_worker.model.sampling import SamplingParams, sample
from gpu_worker.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from gpu_worker.model.weights import (
    build_model,
    config_from_hf,
    init_random_weights,
    load_hf_checkpoint,
    weights_digest,
)

__all__ = [
    "BYTE_BOS_ID",
    "BYTE_EOS_ID",
    "BYTE_VOCAB_SIZE",
    "PRESETS",
    "ByteTokenizer",
    "ForwardBatch",
    "HFTokenizer",
    "KVCache",
    "KVReader",
    "LlamaModel",
    "ModelConfig",
    "SamplingParams",
    "Tokenizer",
    "build_model",
    "config_from_hf",
    "create_model",
    "init_random_weights",
    "load_hf_checkpoint",
    "load_tokenizer",
    "parse_dtype",
    "sample",
    "weights_digest",
]
