#!/usr/bin/env bash
# Creates .venv and installs the project with its dev and model extras. Idempotent.
#
# Every dependency but torch's family comes from requirements/lock.txt: exact versions,
# each checked against the sha256 hashes of its PyPI files (`--require-hashes`, without
# resolving anything else: `--no-deps`); scripts/lock.sh regenerates it. torch and what a
# torch build pins (triton, nvidia-*) are not in it: CPU and CUDA builds differ, and a GPU
# machine brings its own. On machines without a GPU, torch==2.13.0 (a CPU build) goes in
# first so that the project's unpinned torch requirement does not pull a multi-GB CUDA
# build; the project's own install then adds only what the lock leaves out.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.hicache-installed
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt requirements/lock.txt ]; then
    exit 0
fi
# pip and setuptools are in the lock too
"$VPY" -m pip install -q --require-hashes --no-deps -r requirements/lock.txt
if ! command -v nvidia-smi >/dev/null 2>&1 && ! "$VPY" -c "import torch" >/dev/null 2>&1; then
    "$VPY" -m pip install -q torch==2.13.0
fi
# the project itself, built with the locked setuptools (no build isolation: nothing
# unhashed); its dependencies are the lock's, but torch's family (torch, triton, nvidia-*)
"$VPY" -m pip install -q --no-build-isolation -e '.[dev,model]'
touch "$stamp"
