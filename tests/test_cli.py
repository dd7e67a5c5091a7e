"""The README's `hicache-mesh generate` example, run as a user runs it (on `--model tiny`)."""

from __future__ import annotations

import re
import subprocess
import sys

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
