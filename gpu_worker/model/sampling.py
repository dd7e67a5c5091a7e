"""Sampling parameters and the sampler.

Order, as vLLM and SGLang apply them: `logit_bias` is added; `repetition_penalty` divides
the positive logits (multiplies the negative ones) of every token seen in the prompt or the
output (Hugging Face's rule); `presence_penalty` and `frequency_penalty` subtract per output
token (OpenAI's rule); then greedy takes the argmax, or softmax(logits / T) is cut to the
`top_k` most likely tokens, to the smallest set reaching `top_p`, and to tokens at least
`min_p` times as likely as the most likely one, and drawn from. `logprobs` are the model's own
log-probabilities (log_softmax of the raw logits) of the chosen token and of the top
`logprobs` tokens.

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
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Below this a temperature means greedy, as in vLLM; dividing by a subnormal one overflows.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]


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
    top_k: int = 0  # 0: no cut
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt and output tokens; 1: none
    presence_penalty: float = 0.0  # over output tokens, OpenAI's range [-2, 2]
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    logprobs: int | None = None  # None: none; k: the chosen token's and the top k's

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise ValueError("max_new_tokens must be an integer")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: off), got {self.top_k}")
        if not math.isfinite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids, got {token!r}")
            if not math.isfinite(bias) or abs(bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def uses_history(self) -> bool:
        """Whether sampling reads the tokens seen so far (a penalty is on)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass(frozen=True, slots=True)
class Sampled:
    """One sampled token, with its log-probability and the top ones when asked."""

    token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator for output token `step` of a request seeded with `seed`.

    Seeded draws are a function of (seed, step), not of a generator carried along: so any
    engine that produces token `step` draws the same (P/D: prefill samples token 0, decode
    the rest), whatever ran before.
    """
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    prompt_ids: Sequence[int] = (),
    output_ids: Sequence[int] = (),
) -> int:
    """Pick the next token from `logits` (vocab,) under `params` (see the module doc);
    `prompt_ids` and `output_ids` are the tokens seen so far (read by the penalties). Draws
    use `generator` (seeded per request, so a rerun with the same seed gives the same
    tokens). Raises SamplingError when no logit is usable."""
    if generator is not None and generator.device != logits.device:
        logits = logits.to(generator.device)  # seeded draws use a CPU generator (step_generator)
    scores = _usable_scores(_processed(logits, params, prompt_ids, output_ids))
    if params.greedy:
        return int(torch.argmax(scores).item())
    probs = torch.softmax(scores / params.temperature, dim=-1)  # the max token keeps p > 0
    if not (params.top_k or params.top_p < 1.0 or params.min_p > 0.0):
        return int(torch.multinomial(probs, 1, generator=generator).item())
    sorted_probs, order, keep = _cut(probs, params)
    sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    choice = torch.multinomial(sorted_probs, 1, generator=generator)
    return int(order[choice].item())


def _cut(
    probs: torch.Tensor, params: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`probs` sorted descending, their token order, and which of them the top-k / top-p /
    min-p cut keeps (the most likely token always stays, whatever rounding does)."""
    sorted_probs, order = torch.sort(probs, descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if params.top_k:
        keep[params.top_k :] = False
    if params.top_p < 1.0:
        keep &= torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p
    if params.min_p > 0.0:
        keep &= sorted_probs >= params.min_p * sorted_probs[0]
    keep[0] = True
    return sorted_probs, order, keep


def spec_generator(seed: int, step: int, draw: str) -> torch.Generator:
    """Speculative decoding's generator for draw `draw` ("draft", "accept", "residual") of
    output token `step`: a stream apart from `step_generator`'s, so a proposal, its accept
    test and a residual draw never reuse one another's random numbers."""
    digest = hashlib.blake2b(f"{seed}:{step}:{draw}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def distribution(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int] = (),
    output_ids: Sequence[int] = (),
) -> torch.Tensor:
    """The probabilities (vocab,) float64, summing to 1, that `sample` draws from for a
    non-greedy `params` (bias, penalties, temperature, then the top-k/top-p/min-p cut,
    renormalised). Speculative decoding's rejection rule compares the target's and the
    draft's. Raises SamplingError when no logit is usable."""
    scores = _usable_scores(_processed(logits, params, prompt_ids, output_ids))
    probs = torch.softmax(scores / params.temperature, dim=-1)
    if params.top_k or params.top_p < 1.0 or params.min_p > 0.0:
        _, order, keep = _cut(probs, params)
        mask = torch.zeros_like(keep)
        mask[order] = keep
        probs = torch.where(mask, probs, torch.zeros_like(probs))
    return probs / probs.sum()


def with_logprobs(logits: torch.Tensor, params: SamplingParams, token: int) -> Sampled:
    """`token`, chosen from `logits` (vocab,), with the model's log-probabilities when
    `params.logprobs` asks for them."""
    if params.logprobs is None:
        return Sampled(token)
    logp = torch.log_softmax(_usable_scores(logits.to(torch.float64)), dim=-1)  # (vocab,)
    top: tuple[tuple[int, float], ...] = ()
    if params.logprobs:
        values, ids = torch.topk(logp, min(params.logprobs, logp.numel()))
        top = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True))
    return Sampled(token, float(logp[token]), top)


def sample_with_logprobs(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    prompt_ids: Sequence[int] = (),
    output_ids: Sequence[int] = (),
) -> Sampled:
    """`sample`, plus the model's log-probabilities when `params.logprobs` asks for them."""
    return with_logprobs(logits, params, sample(logits, params, generator, prompt_ids, output_ids))


def _processed(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
) -> torch.Tensor:
    """Logits (vocab,) float64 with the bias and the penalties applied."""
    scores = logits.to(torch.float64)
    if not (params.logit_bias or params.uses_history):
        return scores
    scores = scores.clone()
    vocab = scores.numel()
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias if t < vocab], dtype=torch.int64)
        bias = torch.tensor([b for t, b in params.logit_bias if t < vocab], dtype=torch.float64)
        scores.index_add_(0, ids.to(scores.device), bias.to(scores.device))
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*prompt_ids, *output_ids}), dtype=torch.int64)
        seen = seen[seen < vocab].to(scores.device)
        s = scores[seen]
        rp = params.repetition_penalty
        scores[seen] = torch.where(s > 0, s / rp, s * rp)
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        out = torch.tensor(list(output_ids), dtype=torch.int64)
        counts = torch.bincount(out[out < vocab], minlength=vocab).to(scores)
        scores -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return scores


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
