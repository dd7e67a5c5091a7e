"""`--context-length` raises a preset's context (random weights have no trained limit), so the
router benchmark can run the tiny model at 32K tokens; a checkpoint keeps its own limit."""

from __future__ import annotations

import argparse

import pytest

from gpu_worker.engine.engine import Engine, InvalidRequestError
from gpu_worker.model.config import PRESETS
from gpu_worker.model.sampling import SamplingParams
from services.engine.config import engine_config_from_args
from services.engine.flags import add_engine_args


def make_engine(*flags: str) -> Engine:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return Engine(
        engine_config_from_args(parser.parse_args(["--model", "tiny", "--page-size", "64", *flags]))
    )


def test_context_length_above_the_preset() -> None:
    preset = PRESETS["tiny"].context_len
    engine = make_engine("--context-length", str(4 * preset), "--max-total-tokens", "65536")
    assert engine.context_len == engine.model_config.context_len == 4 * preset
    long_prompt = [i % 256 for i in range(2 * preset)]
    assert len(engine.validate(long_prompt, SamplingParams(max_new_tokens=1))) == 2 * preset


def test_default_and_smaller_context_length() -> None:
    assert make_engine().context_len == PRESETS["tiny"].context_len
    engine = make_engine("--context-length", "128")
    assert engine.context_len == 128
    with pytest.raises(InvalidRequestError, match="context length 128"):
        engine.validate(list(range(120)), SamplingParams(max_new_tokens=9))
