# `make run` and `make test` work on a fresh clone: each sets up what it needs first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# A CPU build of torch. On a CUDA machine use PyPI's Linux wheel, which bundles CUDA: make run TORCH=torch
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.kvscope-installed
PYTEST_WORKERS ?= 2

.PHONY: run test model lint screenshots bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install "$(TORCH)"
	$(BIN)/python -m pip install -e '.[test]'
	touch $@

model: $(STAMP)
	$(BIN)/kvscope fetch-model

run: model
	$(BIN)/kvscope

# lint-imports checks the layers in pyproject.toml's [tool.importlinter] (kernels, engine, app, widgets).
test: model
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist load

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

screenshots: model
	$(BIN)/kvscope screenshots

bench: model
	$(BIN)/kvscope bench --workload all --dtype float32
	$(BIN)/kvscope bench --workload all --dtype bfloat16

clean:
	rm -rf $(VENV) .pytest_cache
