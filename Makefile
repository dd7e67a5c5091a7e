# The two commands of README.md: `make run` (the mesh, serving SmolLM2-135M-Instruct) and
# `make test`. Both install what they need into .venv first.
PY := .venv/bin/python
# The router's port: `make run PORT=8001` when 8000 is taken (up checks it before starting).
PORT ?= 8000
# The served model: `make run MODEL=tiny` for the random-weight test model, or a GGUF file or
# Hugging Face checkpoint directory.
MODEL ?= smollm2-135m-instruct

.PHONY: setup run test lint bench

setup:
	@bash scripts/bootstrap.sh

run: setup
	.venv/bin/hicache-mesh up --port $(PORT) --model $(MODEL)

test: setup
	TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider -n auto --maxprocesses 4 --dist loadfile
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

lint: setup
	$(PY) -m ruff check . && $(PY) -m ruff format --check . && $(PY) -m mypy
