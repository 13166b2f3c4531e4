"""Shared fixtures: a tiny random Llama for fast tests, the real SmolLM2 for marked ones."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from minserve import Engine, EngineConfig
from minserve.models import tiny_llama

PHASES = ("admit_pending", "advance_prefill_chunk", "evict_finished", "decode_step")
ROOT = Path(__file__).resolve().parents[1]
MAX_AUTO_WORKERS = 4  # each worker imports torch and loads its own models (~2 GB at most)


def pytest_xdist_auto_num_workers(config) -> int:
    """`make test`'s `--numprocesses=auto`: a worker per core, at most MAX_AUTO_WORKERS,
    so a 64-core machine does not start 64 copies of the real model; past 4 workers the
    suite's longest files set its time anyway. PYTEST_XDIST_AUTO_NUM_WORKERS still wins."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    return max(1, min(MAX_AUTO_WORKERS, len(os.sched_getaffinity(0)) if hasattr(
        os, "sched_getaffinity") else (os.cpu_count() or 1)))


def load_script(name: str):
    """A file of scripts/ (not a package) as a module: `load_script("core_size")`.
    Registered in sys.modules, where its dataclasses look their module up."""
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", ROOT / "scripts" / f"{name}.py")
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
WATCHED = ("docs", "notebooks", "README.md", "app.py", "minserve")


def _fingerprints() -> dict[str, str]:
    files = []
    for name in WATCHED:
        p = ROOT / name
        files += [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()
                                           and "__pycache__" not in f.parts
                                           and ".ipynb_checkpoints" not in f.parts]
    return {str(f.relative_to(ROOT)): hashlib.sha1(f.read_bytes()).hexdigest() for f in files}


@pytest.fixture(scope="session", autouse=True)
def tests_write_no_tracked_file():
    """Tests write only to temporary folders: `make test` must leave the docs, the
    notebooks and the code as it found them. Refreshing the docs' images or tables is
    a separate, deliberate command (`make screenshots`, MINSERVE_WRITE_DOCS=1)."""
    if os.environ.get("MINSERVE_WRITE_DOCS") or os.environ.get("MINSERVE_SCREENSHOT_DIR"):
        yield
        return
    before = _fingerprints()
    yield
    after = _fingerprints()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"the test run changed files it must not write: {changed}"


CHROMIUM = Path("/usr/bin/chromium")  # Debian's, driven by playwright: no browser download
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]


@pytest.fixture(scope="module")
def browser(request):
    """One headless chromium per test module. A module's own `CHROMIUM_ARGS` (the site's,
    which also cut the network) replace the flags above."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM),
                              args=getattr(request.module, "CHROMIUM_ARGS", CHROMIUM_ARGS))
        yield b
        b.close()
# Every test this session collected, before -m / -k deselect any: tests/test_page_figures.py
# counts a test file's tests from it instead of a second `pytest --collect-only`.
COLLECTED = pytest.StashKey[list]()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    config.stash[COLLECTED] = [item.nodeid for item in items]


def pytest_terminal_summary(terminalreporter):
    """Browser tests skipped for want of chromium: say so loudly, not as one more `s`."""
    skipped = [r for r in terminalreporter.stats.get("skipped", [])
               if "chromium" in str(getattr(r, "longrepr", ""))]
    if skipped:
        terminalreporter.write_sep("!", f"{len(skipped)} BROWSER TEST(S) SKIPPED: no {CHROMIUM}",
                                   yellow=True, bold=True)
        terminalreporter.write_line("install it with `sudo apt-get install -y chromium` (Debian/"
                                    "Ubuntu; no browser download) and run `make test` again; "
                                    "everything else above did run.")


@pytest.fixture(scope="session")
def tiny_model():
    """2 layers, hidden 64, GQA 4/2 heads, vocab 256; EOS id 0 so some rows stop early."""
    return tiny_llama(eos_token_id=0)


@pytest.fixture(scope="session")
def real_model():
    """The embedded SmolLM2-135M-Instruct, fp32, loaded once per test session."""
    from minserve.models import load_model

    torch.manual_seed(0)
    return load_model(None, "float32", "cpu")


@pytest.fixture(scope="session")
def real_oracle(real_model):
    """hf_greedy on the real model, memoised: several tests share the same oracle runs."""
    model, _ = real_model
    memo: dict[tuple, list[int]] = {}

    def oracle(ids: list[int], n: int) -> list[int]:
        key = (tuple(ids), n)
        if key not in memo:
            memo[key] = hf_greedy(model, ids, n)
        return memo[key]

    return oracle


def make_engine(model, tokenizer=None, **cfg) -> Engine:
    cfg.setdefault("device", "cpu")
    return Engine(EngineConfig(**cfg), model=model, tokenizer=tokenizer)


def run_checked(engine: Engine, max_ticks: int = 10_000, on_phase=None) -> list[dict]:
    """Run ticks phase by phase until idle, checking the invariants after every phase."""
    s = engine.scheduler
    records = []
    for _ in range(max_ticks):
        if not s.has_work():
            break
        tick = {}
        for name in PHASES:
            tick[name] = getattr(s, name)()
            s.check_invariants()
            if on_phase is not None:
                on_phase(name, tick[name])
        s.end_tick(*(tick[name] for name in PHASES))
        records.append(tick)
    assert not s.has_work(), "did not drain"
    return records


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """The oracle: Hugging Face generate on this prompt alone, greedy."""
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()
