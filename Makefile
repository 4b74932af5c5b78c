# Two entry points: `make up` starts the whole stack, `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: up test setup model protos bench clean

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

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

protos: $(STAMP)
	$(PY) -m llmserve.protogen

clean:
	rm -rf $(VENV) .pytest_cache
