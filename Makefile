# Two entry points: `make up` starts the whole stack, `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: up test lint setup model protos bench clean test-kernels-asan

setup: $(STAMP) model

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

model: $(STAMP)
	$(VENV)/bin/llmserve fetch-model

up: setup
	$(VENV)/bin/llmserve up

test: setup lint
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# Opt-in: the CPU-executed CUDA kernel tests built with AddressSanitizer (reports name the .cu line).
test-kernels-asan: setup
	LLMSERVE_KERNELS_ASAN=1 ASAN_OPTIONS=detect_leaks=0 LD_PRELOAD="$$(g++ -print-file-name=libasan.so)" \
		$(PY) -m pytest tests/cuda_cpu -p no:cacheprovider $(PYTEST_ARGS)

protos: $(STAMP)
	$(PY) -m llmserve.protogen

clean:
	rm -rf $(VENV) .pytest_cache
