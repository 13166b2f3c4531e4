"""The lessons as files: small, diff-friendly, honest, readable outside Jupyter, framed.

Every notebook under notebooks/ (recursively: a `labs/` folder or a notebook 07 are
held to the same rules the day they land). nbval runs them (pyproject.toml); these
tests check what nbval cannot see: what is stored in the file, and how it is read.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
PATHS = sorted(p for p in NOTEBOOKS.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
LESSONS = [p for p in PATHS if re.match(r"\d\d_", p.name) and p.parent == NOTEBOOKS]
MAX_BYTES = 1_000_000
# what a cell shows (its print lines, its last line) when it depends on the model's exact
# tokens or text, and so on the transformers version: in a real-model notebook nbval
# must not compare it
MODEL_DEPENDENT = re.compile(r"\.text\b|tokenizer|describe_phase|describe_tick|first_token"
                             r"|\.tokens\b|token_ids|finish_reason|\"ticks\"")
REQ_ID = re.compile(r"\b([QTPGCRBKDHA])(\d{1,2})\b")


def ids(path: Path) -> str:
    return path.relative_to(NOTEBOOKS).as_posix()


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def source(cell) -> str:
    return "".join(cell["source"])


def tags(cell) -> list[str]:
    return cell.get("metadata", {}).get("tags", [])


def ignored(cell) -> bool:
    """nbval does not compare this cell's output."""
    return "nbval-ignore-output" in tags(cell) or "check" in tags(cell) or any(
        line.strip() == "# NBVAL_IGNORE_OUTPUT" for line in source(cell).splitlines())


def loads_the_real_model(src: str) -> bool:
    """`load_model(...)`, or an `Engine(...)` call given no `model=` (comments dropped)."""
    src = "\n".join(line.split("#")[0] for line in src.splitlines())
    if "load_model(" in src:
        return True
    for m in re.finditer(r"\bEngine\(", src):
        depth, i = 1, m.end()
        while depth and i < len(src):
            depth += {"(": 1, ")": -1}.get(src[i], 0)
            i += 1
        if "model=" not in src[m.end():i]:
            return True
    return False


def test_the_lessons_are_there():
    assert len(LESSONS) >= 6, [p.name for p in PATHS]


@pytest.mark.parametrize("path", PATHS, ids=ids)
def test_notebook_stores_no_widget_state_and_weighs_under_a_megabyte(path):
    """Saved widget state (plotly FigureWidgets carry plotly.js) made 01 weigh 20 MB.
    scripts/refresh_notebooks.py executes with store_widget_state=False."""
    nb = load(path)
    assert "widgets" not in nb.get("metadata", {}), \
        f"{path.name} stores widget state: run scripts/refresh_notebooks.py, or strip metadata.widgets"
    assert path.stat().st_size < MAX_BYTES, f"{path.name}: {path.stat().st_size} bytes"
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            assert "application/vnd.jupyter.widget-view+json" not in out.get("data", {}), \
                f"{path.name}: a stored widget view points at state that is not stored " \
                f"(JupyterLab logs '[anywidget] Failed to initialize model')"


@pytest.mark.parametrize("path", PATHS, ids=ids)
def test_notebook_stores_no_figure_output_no_stderr_and_defines_no_engine_code(path):
    nb = load(path)
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = source(cell)
        if {"nbval-ignore-output", "check"} & set(tags(cell)):
            assert cell["outputs"] == [], (path.name, src[:60])
        for out in cell["outputs"]:
            assert out.get("name") != "stderr", (path.name, src[:60])
            assert "application/vnd.plotly.v1+json" not in out.get("data", {}), (path.name, src[:60])
        if path in LESSONS:  # (in a lab, the student writes a piece of the engine)
            assert "class " not in src, "notebooks import minserve; they never redefine it"
    text = path.read_text(encoding="utf-8")
    assert "import minserve" in text or "from minserve" in text


@pytest.mark.parametrize("path", LESSONS, ids=ids)
def test_claims_are_checked_by_hidden_cells_that_assert_with_a_message(path):
    """A claim in the prose is followed by a folded cell that asserts it from the computed
    values (tag `check`, source hidden), so text and output cannot drift apart."""
    checks = [c for c in load(path)["cells"] if "check" in tags(c)]
    assert checks, f"{path.name} has no hidden check cell"
    for cell in checks:
        src = source(cell)
        assert cell["cell_type"] == "code" and cell["metadata"].get("jupyter", {}).get(
            "source_hidden") is True, (path.name, src[:60])
        assert src.startswith("# check: "), f"{path.name}: say which claim it checks: {src[:60]}"
        asserts = [line for line in src.splitlines() if line.lstrip().startswith("assert ")]
        assert asserts, (path.name, src[:60])
        assert "print(" not in src, "a check prints nothing: it passes silently or explains why not"


@pytest.mark.parametrize("path", PATHS, ids=ids)
def test_every_figure_has_its_static_picture_linked_for_readers_outside_jupyter(path):
    """Figure outputs are not stored, so a code host shows none: each figure cell's PNG
    (written by `make screenshots`) is linked from the notebook, by a relative path."""
    nb = load(path)
    text = "\n".join(source(c) for c in nb["cells"] if c["cell_type"] == "markdown")
    rel = os.path.relpath(ROOT / "docs" / "img", path.parent).replace(os.sep, "/")
    for cell in nb["cells"]:
        name = cell.get("metadata", {}).get("minserve", {}).get("screenshot")
        if not name:
            continue
        assert f"]({rel}/{name}.png)" in text, f"{path.name}: no picture of {name}"
        assert (ROOT / "docs" / "img" / f"{name}.png").is_file(), f"run make screenshots: {name}"
    for link in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text):
        assert (path.parent / link).is_file(), f"{path.name}: {link} does not resolve"


def test_every_picture_in_docs_img_is_refreshed_by_make_screenshots():
    """No stale PNG: each one is a notebook figure (scripts/screenshots.py) or a browser
    test's screenshot (tests/test_app_browser.py, tests/test_jupyterlab.py, the 1280x720
    test of tests/test_demo_steps_browser.py), each of them run by `make screenshots`."""
    made = {cell.get("metadata", {}).get("minserve", {}).get("screenshot")
            for path in PATHS for cell in load(path)["cells"]} - {None}
    browser = {"app", "app_kv", "app_fairness", "stepper", "app_first_screen_1280"}
    tests = ("test_app_browser.py", "test_jupyterlab.py", "test_demo_steps_browser.py")
    recipe = re.search(r"^screenshots:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)[1]
    assert all(t in recipe for t in tests), recipe
    for name in browser:
        assert re.search(rf"\b{name}\.png\b", "".join((ROOT / "tests" / t).read_text()
                                                      for t in tests)), name
    pngs = {p.stem for p in (ROOT / "docs" / "img").glob("*.png")}
    assert pngs == made | browser, (sorted(pngs - made - browser), sorted(made | browser - pngs))


@pytest.mark.parametrize("path", PATHS, ids=ids)
def test_a_real_model_notebook_says_so_and_compares_no_model_dependent_output(path):
    """The embedded model's greedy text, token ids and chat-template lengths can change
    with the transformers version: a real-model notebook does not let nbval compare them.
    It says so in its metadata, so `make test-fast` leaves it out (notebooks/conftest.py)."""
    nb = load(path)
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    loads_real = any(loads_the_real_model(source(c)) for c in code)
    marked = bool(nb.get("metadata", {}).get("minserve", {}).get("real_model"))
    assert loads_real == marked, f"{path.name}: metadata.minserve.real_model must be {loads_real}"
    if not marked:
        return
    for cell in code:
        if cell["outputs"] and not ignored(cell):
            lines = source(cell).splitlines()
            shown = "\n".join([line for line in lines if "print(" in line] + lines[-1:])
            found = MODEL_DEPENDENT.search(shown)
            assert not found, (f"{path.name}: nbval compares a cell that prints "
                               f"{found.group(0)!r}; start it with # NBVAL_IGNORE_OUTPUT "
                               f"and check stable facts in a hidden check cell", source(cell)[:80])


def test_make_test_runs_every_notebook_and_make_test_fast_none():
    """`make test` (pytest's testpaths) runs every lesson under nbval; `make test-fast`, the
    edit-test loop, collects `tests/` only (tests/test_make_test_fast.py reads its recipe)."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^testpaths = \[.*"notebooks"', pyproject, re.M), "make test: no notebooks"
    assert re.search(r'^addopts = ".*--nbval', pyproject, re.M)
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", "notebooks"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300).stdout
    collected = {line.split("::")[0] for line in out.splitlines() if ".ipynb::" in line}
    # (the labs are otter sources, graded by tests/test_labs.py, not replayed by nbval)
    assert collected >= {p.relative_to(ROOT).as_posix() for p in LESSONS}, sorted(collected)
    recipe = re.search(r"^test-fast:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)[1]
    assert "notebooks" not in shlex.split(recipe.replace("\\\n", " ")), recipe


# --- notebooks/README.md: the course around the lessons ---------------------------------------
README = NOTEBOOKS / "README.md"


def test_readme_frames_the_course_and_lists_every_notebook_in_order():
    text = README.read_text(encoding="utf-8")
    for heading in ("objectives", "prerequisites", "order", "glossary"):
        assert re.search(rf"^#+ .*{heading}", text, re.I | re.M), f"no section on {heading}"
    links = [m for m in re.findall(r"\]\(([^)\s#]+)\)", text) if not re.match(r"[a-z]+:", m)]
    for link in links:
        assert (NOTEBOOKS / link).exists(), f"notebooks/README.md: {link} does not resolve"
    listed = [link for link in links if link.endswith(".ipynb")]
    for path in PATHS:
        assert ids(path) in listed, f"notebooks/README.md does not list {ids(path)}"
    lessons = [link for link in listed if link in {ids(p) for p in LESSONS}]
    assert lessons == sorted(lessons), "the lessons are listed in the order to take them"


def glossary(text: str) -> set[str]:
    section = re.split(r"^#+ .*glossary.*$", text, flags=re.I | re.M)[1]
    return set(re.findall(r"^\|\s*\**`?([A-Z]\d{1,2})`?\**\s*\|", section, flags=re.M))


def test_every_requirement_id_a_lesson_uses_is_in_the_readme_glossary():
    """A student meets `T5`, `G2`, `R1` in the lessons: the glossary says what each is,
    and each id in it is one of docs/spec.md's."""
    spec = set(re.findall(r"^\*\*([A-Z]\d{1,2})\*\*", (ROOT / "docs" / "spec.md").read_text(),
                          flags=re.M))
    used = set()
    for path in PATHS:
        for cell in load(path)["cells"]:
            used |= {a + b for a, b in REQ_ID.findall(source(cell))} & spec
    defined = glossary(README.read_text(encoding="utf-8"))
    assert used, "the lessons cite no requirement id?"
    assert used <= defined, f"add to the glossary in notebooks/README.md: {sorted(used - defined)}"
    assert defined <= spec, f"not ids of docs/spec.md: {sorted(defined - spec)}"
