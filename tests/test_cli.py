"""The README's `hicache-mesh generate` example, run as a user runs it (on `--model tiny`)."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.cli import main

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_generate_repeat_shows_device_then_host_hits() -> None:
    proc = run_cli(
        "generate",
        "--model",
        "tiny",
        "--prompt",
        PROMPT,
        "--max-tokens",
        "8",
        "--repeat",
        "3",
        "--page-size",
        "4",
        "--enable-hierarchical-cache",
        "--flush-device",
    )
    assert proc.returncode == 0, proc.stderr
    runs = re.findall(r"cached_tokens=(\d+) \(device=(\d+), host=(\d+)\)", proc.stdout)
    outputs = re.findall(r"output_ids=(\[.*\])", proc.stdout)
    prompt_len = len(PROMPT.encode())
    aligned = (prompt_len - 1) // 4 * 4
    host_hit = (str(aligned), "0", str(aligned))
    assert runs == [("0", "0", "0"), host_hit, host_hit]
    assert len(set(outputs)) == 1


def test_generate_rejects_bad_input_cleanly(capsys) -> None:  # type: ignore[no-untyped-def]
    tiny = ["generate", "--model", "tiny"]
    assert main([*tiny, "--input-ids", "1,2,999", "--max-tokens", "2"]) == 2
    assert "token ids must be integers in [0, 260)" in capsys.readouterr().err
    assert main([*tiny, "--prompt", "hi", "--max-tokens", "-3"]) == 2
    assert ">= 0" in capsys.readouterr().err
    assert main([*tiny, "--hicache-ratio", "0", "--enable-hierarchical-cache"]) == 2


def test_the_real_model_is_the_default_and_random_weights_say_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`up`, `generate` and the engine service serve SmolLM2 unless told otherwise (issue 19,
    defect 5: `up` served the random-weight `tiny` while `make run` served SmolLM2); an engine
    of random weights says so in its log, one of real weights does not."""
    from gguf_files import write_llama_gguf
    from test_gguf import SMALL

    from gpu_worker.engine.engine import Engine, EngineConfig
    from gpu_worker.model.llama import create_model
    from gpu_worker.model.weights import init_random_weights
    from services.cli import build_parser
    from services.engine.__main__ import build_parser as engine_parser

    assert build_parser().parse_args(["up"]).model == "smollm2-135m-instruct"
    assert build_parser().parse_args(["generate"]).model == "smollm2-135m-instruct"
    assert engine_parser().parse_args(["--engine-id", "e"]).model == "smollm2-135m-instruct"

    caplog.set_level(logging.INFO, logger="gpu_worker.engine.engine")
    Engine(EngineConfig(model="tiny")).close()
    assert "serving random weights (preset tiny): outputs are noise" in caplog.text
    caplog.clear()
    model = create_model(SMALL, "cpu", torch.float32)
    init_random_weights(model, seed=1)  # a GGUF's weights: to the engine, a real model's
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("rotary")}
    path = write_llama_gguf(tmp_path / "real.gguf", SMALL, state)
    Engine(EngineConfig(model=str(path), dtype="float32")).close()
    assert "random weights" not in caplog.text


def test_every_subcommand_has_a_runner() -> None:
    """`services/parser.py` names the subcommands and `services/cli.py` runs them: the two
    lists agree, in order."""
    import argparse

    from services.cli import COMMANDS, build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert list(sub.choices) == list(COMMANDS)
