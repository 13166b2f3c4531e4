"""`make lab-check` as tests: the classroom labs' checks are real (docs/teaching.md).

Each lab in `notebooks/labs/` is one otter-assign source notebook. The labs are built with
otter (`scripts/labs.py build`, into a temporary folder), then graded as otter grades:
the notebook runs top to bottom, otter's test-file runner runs every test, hidden ones
included, against what it left behind. For every lab:

* the solution (the autograder's notebook) passes every test;
* the student version, stubs as shipped, fails every test, each with a message that says
  what is wrong and where to look (never a bare assert);
* the student version holds no solution and no hidden test; the autograder holds both.

One lab also goes through `otter run` with the autograder zip, the way a teacher grades.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("labs_script", ROOT / "scripts" / "labs.py")
labs_script = importlib.util.module_from_spec(spec)
sys.modules["labs_script"] = labs_script  # its dataclasses look their module up
spec.loader.exec_module(labs_script)

LABS = [p.stem for p in labs_script.lab_sources()]
# what a blank stub makes each lab's first public check say
STUB_MESSAGE = {
    "lab1_fcfs": "FCFSLab.key is still the stub",
    "lab2_gates": "check_queue_capacity is still the stub",
    "lab3_vtc": "on_request_arrived is still the stub",
    "lab4_padded": "splice_in is still the stub",
    "lab5_blocks": "BlockManagerLab.allocate_prompt is still the stub",
    "lab6_chunked": "next_chunk is still the stub",
    "lab7_capstone": "is still the stub (MyPolicy.key",
}


def test_there_are_six_labs_and_a_capstone():
    assert len(LABS) >= 7 and LABS[-1].endswith("capstone"), LABS
    assert set(STUB_MESSAGE) == set(LABS)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return labs_script.build(tmp_path_factory.mktemp("labs"))


@pytest.fixture(scope="module")
def graded(built):
    """lab -> (solution graded, student version graded), both against every test."""
    out = {}
    for lab, d in built.items():
        tests = d / "autograder" / "tests"
        out[lab] = (labs_script.grade(d / "autograder" / f"{lab}.ipynb", tests),
                    labs_script.grade(d / "student" / f"{lab}.ipynb", tests))
    return out


@pytest.mark.parametrize("lab", LABS)
def test_the_solution_passes_every_check_hidden_ones_too(graded, lab):
    sol, _ = graded[lab]
    failed = [msg for _, ok, msg in sol.cases if not ok]
    assert not sol.cell_errors, sol.cell_errors
    assert sol.cases and not failed, "\n".join(failed)


@pytest.mark.parametrize("lab", LABS)
def test_the_student_version_fails_every_check_with_its_message(graded, lab):
    _, stu = graded[lab]
    assert stu.cases
    for name, ok, msg in stu.cases:
        assert not ok, f"{lab}: a test passes on the blank stubs: {name}"
        # otter shows the line of the test and our LabCheckFailed: what, and where to look
        assert "LabCheckFailed: " in msg and "where to look:" in msg, msg
    assert STUB_MESSAGE[lab] in stu.cases[0][2], stu.cases[0][2]


@pytest.mark.parametrize("lab", LABS)
def test_the_student_version_holds_no_solution_and_no_hidden_test(built, lab):
    d = built[lab]
    student_nb = (d / "student" / f"{lab}.ipynb").read_text()
    assert "SOLUTION" not in student_nb and "NotImplementedError" in student_nb
    assert "**Answer.**" not in student_nb
    assert "**Answer.**" in (d / "autograder" / f"{lab}.ipynb").read_text()
    public = "".join(p.read_text() for p in (d / "student" / "tests").glob("*.py"))
    every = "".join(p.read_text() for p in (d / "autograder" / "tests").glob("*.py"))
    assert "hidden=True" not in public and "hidden=True" in every
    assert list((d / "autograder").glob(f"{lab}-autograder_*.zip"))


def test_the_padded_checker_reproduces_the_mixed_workload_crash():
    """Lab 4: a splice-in sized from kv_length instead of the mask's width dies on the mixed
    workload, and the checker names the cause."""
    from minserve.labs import padded
    from minserve.labs.common import LabCheckFailed

    with pytest.raises(LabCheckFailed, match="mixed-workload crash") as e:
        padded.check_mixed_workload(padded.kv_length_splice_in, padded.reference_remove,
                                    padded.reference_positions, trim=False)
    assert "Size it from mask.shape[1]" in str(e.value)
    padded.check_mixed_workload(padded.kv_length_splice_in, padded.reference_remove,
                                padded.reference_positions, trim=True)  # trimmed: it survives


def test_otter_run_grades_the_student_version_with_the_autograder_zip(built, tmp_path):
    """The teacher's path: `otter run -a <zip> <submission>` in a fresh kernel."""
    d = built["lab2_gates"]
    zip_path = next((d / "autograder").glob("lab2_gates-autograder_*.zip"))
    subprocess.run([sys.executable, "-m", "otter", "run", "-a", str(zip_path), "-o", str(tmp_path),
                    str(d / "student" / "lab2_gates.ipynb")], check=True, capture_output=True,
                   cwd=tmp_path, timeout=300)
    results = json.loads((tmp_path / "results.json").read_text())
    scores = {t["name"]: (t["score"], t["max_score"]) for t in results["tests"] if "score" in t}
    assert scores["gates"] == (0.0, 3.0), scores
    assert "LabCheckFailed: check_queue_capacity is still the stub" in json.dumps(results)
