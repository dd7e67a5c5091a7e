"""Speculative decoding's configuration (SGLang's flag names), identical on every rank."""

from __future__ import annotations

from dataclasses import dataclass

from gpu_worker.memory.pool_group import DRAFT_HOST_MODES

SPEC_ALGORITHMS = ("standalone",)  # a separate draft model (SGLang's STANDALONE)
DRAFT_QUANTIZATIONS = ("none", "int4", "int5", "int6", "int8")
__all__ = ["DRAFT_HOST_MODES", "DRAFT_QUANTIZATIONS", "SELF_DRAFT", "SPEC_ALGORITHMS", "SpecConfig"]
SELF_DRAFT = "self"  # --speculative-draft-model-path self: a copy of the target's weights


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """`--speculative-algorithm`, `--speculative-draft-model-path`,
    `--speculative-num-steps` and `--speculative-draft-quantization`; off when `algorithm`
    is None.

    The draft is a second model of the target's vocabulary: a preset, a GGUF file, a
    checkpoint directory, or `self` (the target's own weights, re-quantized when
    `draft_quantization` is not "none"). Each decode step it proposes `num_steps` tokens per
    request, which the target verifies in one forward."""

    algorithm: str | None = None
    draft_model: str | None = None
    num_steps: int = 4
    draft_quantization: str = "none"
    # --speculative-draft-host-mode: the draft's host rows packed into the target's, or a
    # sidecar pool (`pool_group.draft_host_rows`); auto packs where the row shapes match
    draft_host_mode: str = "auto"

    def __post_init__(self) -> None:
        if self.draft_host_mode not in DRAFT_HOST_MODES:
            raise ValueError(
                f"--speculative-draft-host-mode {self.draft_host_mode!r}: choose one of "
                f"{list(DRAFT_HOST_MODES)}"
            )
        if self.algorithm is None:
            if self.draft_model is not None or self.draft_quantization != "none":
                raise ValueError(
                    "--speculative-draft-model-path and --speculative-draft-quantization "
                    "need --speculative-algorithm standalone"
                )
            return
        if self.algorithm not in SPEC_ALGORITHMS:
            raise ValueError(
                f"--speculative-algorithm {self.algorithm!r} is not supported; choose one of "
                f"{list(SPEC_ALGORITHMS)}"
            )
        if not self.draft_model:
            raise ValueError(
                "--speculative-algorithm standalone needs --speculative-draft-model-path (a "
                "preset, a GGUF file, a checkpoint directory, or 'self')"
            )
        if isinstance(self.num_steps, bool) or not isinstance(self.num_steps, int):
            raise ValueError("--speculative-num-steps must be an integer")
        if not 1 <= self.num_steps <= 16:
            raise ValueError(f"--speculative-num-steps must be in [1, 16], got {self.num_steps}")
        if self.draft_quantization not in DRAFT_QUANTIZATIONS:
            raise ValueError(
                f"--speculative-draft-quantization {self.draft_quantization!r}: choose one of "
                f"{list(DRAFT_QUANTIZATIONS)}"
            )

    @property
    def enabled(self) -> bool:
        return self.algorithm is not None
