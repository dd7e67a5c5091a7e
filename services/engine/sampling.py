"""The bus's `Sampling` as the engine's `SamplingParams` (one place for both roles)."""

from __future__ import annotations

from bus_schemas import Sampling
from gpu_worker.model.sampling import SamplingParams


def sampling_params(s: Sampling) -> SamplingParams:
    """Raises ValueError (a 400 for the request) for a value the engine does not accept."""
    bias = []
    for key, value in s.logit_bias.items():
        if not key.isdigit():
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        bias.append((int(key), value))
    return SamplingParams(
        s.max_new_tokens,
        s.temperature,
        s.top_p,
        s.seed,
        tuple(s.stop_token_ids),
        s.ignore_eos,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        logit_bias=tuple(sorted(bias)),
        logprobs=s.logprobs,
    )
