"""`make notebooks` gives a student the lessons and the labs' student versions, never their sources.

`notebooks/labs/` holds otter-assign *source* notebooks: each lab's solution and hidden
tests. `scripts/work_copy.py` (the copy step of `make notebooks`, and the `lessons/` of
the class bundle) builds each lab with otter and copies its student version, stubs and
public tests, to `work/labs/<lab>/`. What reaches `work/` is checked by content: no otter
marker, and no line of a solution block or a hidden test (the strings are derived from
the sources by scripts/class_bundle.py, not written down here). A `work/` made by an
older copy, which held the sources, has them moved aside with a warning.
"""

from __future__ import annotations

import contextlib
import io
import re
import shutil
from pathlib import Path

import pytest

from .conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
work_copy = load_script("work_copy")
bundle_script = load_script("class_bundle")
SOURCES = sorted((ROOT / "notebooks" / "labs").glob("lab*.ipynb"))


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """work/ as a first `make notebooks` leaves it."""
    dest = tmp_path_factory.mktemp("clone") / "work"
    work_copy.copy_lessons(ROOT / "notebooks", dest)
    return dest


def test_the_sources_are_otter_sources_and_hold_answers():
    """What the copy must keep out is there to keep out (else the tests below prove nothing)."""
    assert SOURCES and all(work_copy.is_lab_source(p) for p in SOURCES)
    assert not any(work_copy.is_lab_source(p) for p in (ROOT / "notebooks").glob("*.ipynb"))


def test_make_notebooks_copies_the_labs_student_versions_and_no_answer(work):
    for src in SOURCES:
        lab = work / "labs" / src.stem
        student = (lab / src.name).read_text()
        assert "NotImplementedError" in student and list((lab / "tests").glob("*.py")), lab
    assert not list((work / "labs").glob("*.ipynb")), "a lab's source copied as it is"
    # the README the copy opens on links the student versions where they are
    links = re.findall(r"\]\((labs/[^)#\s]+)\)", (work / "README.md").read_text())
    assert len(links) >= len(SOURCES) and all((work / link).exists() for link in links), links
    assert not [p for p in work.rglob("*.ipynb") if work_copy.is_lab_source(p)]
    forbidden = bundle_script.forbidden_strings(SOURCES)
    assert "return (-req.priority, req.arrival_seq)" in forbidden  # lab 1's answer line
    assert bundle_script.leaks(work, forbidden) == []


def test_a_second_make_notebooks_copies_nothing_and_keeps_the_students_work(work, tmp_path):
    again = tmp_path / "work"
    shutil.copytree(work, again)
    lab = again / "labs" / SOURCES[0].stem / SOURCES[0].name
    lab.write_text(lab.read_text().replace("NotImplementedError", "my answer"))
    assert work_copy.copy_lessons(ROOT / "notebooks", again) == []
    assert "my answer" in lab.read_text()


def test_an_older_work_copy_holding_the_sources_has_them_moved_aside_with_a_warning(work, tmp_path):
    """Before, `make notebooks` copied notebooks/labs/*.ipynb, answers inside, to work/labs/.
    Never copied again; what is there is moved to work-old/ (the student's edits in it
    kept), JupyterLab no longer offers it, and the student is told."""
    old_work = tmp_path / "work"
    shutil.copytree(work, old_work)
    stale = old_work / "labs" / SOURCES[0].name
    stale.write_text(SOURCES[0].read_text().replace("Lab 1", "Lab 1 (my notes)"))
    checkpoint = old_work / "labs" / ".ipynb_checkpoints" / f"{SOURCES[0].stem}-checkpoint.ipynb"
    checkpoint.parent.mkdir()
    shutil.copy(SOURCES[0], checkpoint)  # JupyterLab's, which "Revert" would bring back
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert work_copy.main(["--src", str(ROOT / "notebooks"), "--dest", str(old_work)]) == 0
    assert "WARNING" in err.getvalue() and "work-old" in err.getvalue(), err.getvalue()
    assert not stale.exists() and not checkpoint.exists()
    [moved] = (tmp_path / "work-old").rglob(SOURCES[0].name)
    assert "(my notes)" in moved.read_text() and moved.parent.name == "labs"
    assert not [p for p in old_work.rglob("*.ipynb") if work_copy.is_lab_source(p)]
    assert (old_work / "labs" / SOURCES[0].stem / SOURCES[0].name).exists()
