"""`make test-fast`, the edit-test loop: what it runs is what the README says it runs.

Read from the Makefile's own recipe (its marker, its paths, its `FAST_SKIP`) and from the
test files it leaves in, not from a list written here:

* no real model (`-m "not real_model"`), no notebook (only `tests/` is collected);
* no browser (no file left in drives chromium through playwright), no labs or their
  corpus, no class bundle (no file left in builds the labs or reads `tests/lab_corpus`);
* the engine's invariants (files that check them after every phase) and every backend,
  prefill mode, model runner and decode attention (a file left in configures each);
* the README says so, with its budget.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from minserve.config import BACKENDS, DECODE_ATTENTIONS, MODEL_RUNNERS, PrefillMode

ROOT = Path(__file__).resolve().parents[1]
MAKEFILE = (ROOT / "Makefile").read_text()


def recipe() -> list[str]:
    """The words of `make test-fast`'s pytest command, $(FAST_SKIP) expanded."""
    body = re.search(r"^test-fast:.*\n((?:\t.*\n)+)", MAKEFILE, re.M)[1]
    line = " ".join(re.sub(r"\\\n", " ", body).split())
    skip = re.search(r"^FAST_SKIP\s*:=\s*((?:.*\\\n)*.*)$", MAKEFILE, re.M)[1]
    names = re.sub(r"\\\n", " ", skip).split()
    line = line.replace("$(FAST_SKIP:%=--ignore=tests/%.py)",
                        " ".join(f"--ignore=tests/{n}.py" for n in names))
    return shlex.split(line)


def fast_files() -> dict[str, str]:
    words = recipe()
    ignored = {w.split("=", 1)[1] for w in words if w.startswith("--ignore=")}
    assert all((ROOT / p).exists() for p in ignored), ignored  # no stale name
    return {p.name: p.read_text() for p in sorted((ROOT / "tests").glob("test_*.py"))
            if f"tests/{p.name}" not in ignored and p.name != Path(__file__).name}


def test_test_fast_leaves_out_the_real_model_the_notebooks_the_browser_and_the_labs():
    words = recipe()
    assert words[:3] == ["$(BIN)/python", "-m", "pytest"], words
    marker = words[words.index("-m", 3) + 1]
    assert marker == "not real_model", marker
    paths = [w for w in words[3:] if not w.startswith("-") and w != marker]
    assert paths == ["tests"], paths  # notebooks/ is not collected
    files = fast_files()
    browser = [n for n, text in files.items() if "sync_playwright" in text]
    labs = [n for n, text in files.items()
            if re.search(r'load_script\("(labs|work_copy)"\)|lab_corpus|import otter', text)]
    assert browser == [] and labs == [], (browser, labs)


def test_test_fast_covers_the_invariants_and_every_backend_and_path():
    text = "\n".join(fast_files().values())
    assert len(re.findall(r"check_invariants\(|run_checked\(", text)) >= 10
    for field, values in (("backend", BACKENDS), ("prefill_mode", [m.value for m in PrefillMode]),
                          ("model_runner", MODEL_RUNNERS),
                          ("decode_attention", DECODE_ATTENTIONS)):
        for value in values:
            if value == "auto":
                continue  # a choice among the others, each covered
            set_ = rf"""\b{field}\s*=\s*["']{value}["']|["']{field}["']\s*:\s*["']{value}["']"""
            swept = rf"""parametrize\(\s*["'][^"']*\b{field}\b[^"']*["'][^)]*["']{value}["']"""
            assert re.search(set_, text) or re.search(swept, text), \
                f"test-fast never runs {field}={value!r}"


def test_the_readme_says_what_test_fast_runs_and_its_budget():
    readme = (ROOT / "README.md").read_text()
    said = " ".join(readme.split("make test-fast", 2)[-1].split()[:90])
    assert "3 minutes" in readme and "make test-fast" in readme
    for word in ("invariants", "backend", "notebooks", "browser", "labs"):
        assert word in readme.split("## Tests", 1)[1], word
    assert said


def test_make_test_runs_a_worker_per_core_and_at_most_four(monkeypatch):
    """`make test` and `make test-fast` say `--numprocesses=auto`; conftest's hook turns
    that into a worker per core the process may use, capped (a 64-core machine would
    otherwise start 64 copies of the real model), with xdist's own variable still first."""
    from tests import conftest

    make_test = MAKEFILE.split("\ntest: ", 1)[1].split("\n\n", 1)[0]
    assert "--numprocesses=auto" in make_test and "--numprocesses=auto" in recipe()
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    for cores, workers in ((1, 1), (2, 2), (64, conftest.MAX_AUTO_WORKERS)):
        monkeypatch.setattr(conftest.os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert conftest.pytest_xdist_auto_num_workers(None) == workers
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "7")
    assert conftest.pytest_xdist_auto_num_workers(None) == 7
