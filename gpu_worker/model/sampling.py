"""Sampling parameters and the sampler (greedy, temperature, top-p, seeded).

The sampler is safe for every value `SamplingParams` accepts: a temperature below
`GREEDY_TEMPERATURE_EPS` means greedy (dividing by 1e-320 gives inf/NaN), logits are
shifted by their maximum before the division (so a finite temperature never overflows),
NaN logits never win, and +inf logits share the draw among themselves. Only a row with no
usable logit at all raises `SamplingError`, which the scheduler turns into an error for
that one request.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

# Below this a temperature means greedy, as in vLLM; dividing by a subnormal one overflows.
GREEDY_TEMPERATURE_EPS = 1e-5


class SamplingError(ValueError):
    """The logits of one request hold nothing to sample from (all NaN or -inf)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling. `temperature < GREEDY_TEMPERATURE_EPS` means greedy."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise ValueError("max_new_tokens must be an integer")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator for output token `step` of a request seeded with `seed`.

    Seeded draws are a function of (seed, step), not of a generator carried along: so any
    engine that produces token `step` draws the same (P/D: prefill samples token 0, decode
    the rest), whatever ran before.
    """
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from `logits` (vocab,) under `params`.

    Greedy is an argmax; otherwise softmax(logits / T) restricted to the smallest set of
    tokens whose probability reaches `top_p`, drawn with `generator` (seeded per request so a
    rerun with the same seed gives the same tokens). Raises SamplingError when no logit is
    usable.
    """
    if generator is not None and generator.device != logits.device:
        logits = logits.to(generator.device)  # seeded draws use a CPU generator (step_generator)
    scores = _usable_scores(logits)  # (vocab,) float64, finite or -inf, max 0
    if params.greedy:
        return int(torch.argmax(scores).item())
    probs = torch.softmax(scores / params.temperature, dim=-1)  # the max token keeps p > 0
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p
        keep[0] = True  # the most likely token always stays, whatever rounding does
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice].item())
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _usable_scores(logits: torch.Tensor) -> torch.Tensor:
    """`logits` (vocab,) as float64 scores whose maximum is exactly 0: NaN counts as -inf,
    and when some logits are +inf only those remain (tied at 0)."""
    scores = torch.nan_to_num(logits.double(), nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    top = scores.max()
    if top == math.inf:
        return torch.where(scores == math.inf, 0.0, -math.inf).to(scores)
    if top == -math.inf:
        raise SamplingError("the model produced no finite logit for this request")
    return scores - top
