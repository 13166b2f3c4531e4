"""`make lab-check` as tests: the classroom labs grade as a class will be graded (docs/teaching.md).

Each lab in `notebooks/labs/` is one otter-assign source notebook. The labs are built with
otter (`scripts/labs.py build`, into a temporary folder). Then, the way a teacher grades:

* every lab's solution, and every typical wrong submission of `tests/lab_corpus/<lab>/`
  (the student version with its graded cell replaced by the mistake), goes through
  `otter run` with that lab's autograder zip: a fresh kernel runs the notebook, then every
  test, hidden ones included. Solutions score full marks; each mistake scores below full,
  and the messages say what its `# expect:` lines say (the mistake, and where to look).
  The submissions are split over two grading processes (the CPU has two cores).
* the student version, stubs as shipped, fails every test with a message (never a bare
  assert) when its cells run and otter's test runner runs against what they left;
* the student version holds no solution and no hidden test; the autograder holds both;
* no answer key is importable from the installed package, and no check points a student
  to the file that holds the engine's own version of what they write.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
from pathlib import Path

import pytest

from .conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
labs_script = load_script("labs")

LABS = [p.stem for p in labs_script.lab_sources()]
MISTAKES = labs_script.corpus()
# what a blank stub makes each lab's first public check say
STUB_MESSAGE = {
    "lab1_fcfs": "FCFSLab.key is still the stub",
    "lab2_gates": "check_queue_capacity is still the stub",
    "lab3_vtc": "VTCLab.on_request_arrived is still the stub",
    "lab4_padded": "splice_in is still the stub",
    "lab5_blocks": "BlockManagerLab._cached_blocks is still the stub",
    "lab6_chunked": "next_chunk is still the stub",
    "lab7_capstone": "MyPolicy.key is still the stub",
}


def test_there_are_six_labs_and_a_capstone():
    assert len(LABS) >= 7 and LABS[-1].endswith("capstone"), LABS
    assert set(STUB_MESSAGE) == set(LABS)


def test_every_lab_has_a_corpus_of_at_least_four_typical_mistakes():
    for lab in LABS:
        mistakes = [m for m in MISTAKES if m.lab == lab]
        assert len(mistakes) >= 4, (lab, [m.name for m in mistakes])
        for m in mistakes:
            assert m.expect, f"{lab}/{m.name}.py has no '# expect:' line"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return labs_script.build(tmp_path_factory.mktemp("labs"))


@pytest.fixture(scope="module")
def otter_graded(built, tmp_path_factory):
    """label -> `otter run` result, for every solution and every corpus submission. The
    table (scores, seconds per submission, first message) goes to build/labs/."""
    results = labs_script.grade_corpus(built, tmp_path_factory.mktemp("submissions"), workers=2)
    report = ROOT / "build" / "labs" / "grading-report.md"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(labs_script.corpus_report(results) + "\n")
    return results


def _score(result) -> tuple[float, float]:
    qs = result["questions"].values()
    return sum(q["score"] for q in qs), sum(q["possible"] for q in qs)


@pytest.mark.parametrize("lab", LABS)
def test_the_solution_scores_full_marks_under_otter_run(otter_graded, lab):
    result = otter_graded[f"{lab}/solution"]
    failed = [m for q in result["questions"].values() for m in q["failed"]]
    score, possible = _score(result)
    assert possible > 0 and score == possible and not failed, "\n".join(failed)


@pytest.mark.parametrize("mistake", MISTAKES, ids=[f"{m.lab}/{m.name}" for m in MISTAKES])
def test_each_typical_mistake_scores_below_full_and_is_named(otter_graded, mistake):
    result = otter_graded[f"{mistake.lab}/{mistake.name}"]
    score, possible = _score(result)
    assert possible > 0 and score < possible, f"{mistake.what}: {score} / {possible}"
    messages = "\n".join(m for q in result["questions"].values() for m in q["failed"])
    for expected in mistake.expect:
        assert expected in messages, f"{mistake.what}: no {expected!r} in\n{messages}"
    # one message per failed case, each saying where to look; no bare assert, no
    # traceback from inside the engine
    assert "where to look:" in messages and "LabCheckFailed" in messages, messages
    assert "scheduler.py" not in messages and "site-packages" not in messages, messages


@pytest.fixture(scope="module")
def stubs_graded(built):
    """lab -> the student version, stubs as shipped, run and graded by otter's test runner."""
    return {lab: labs_script.grade(d / "student" / f"{lab}.ipynb", d / "autograder" / "tests")
            for lab, d in built.items()}


@pytest.mark.parametrize("lab", LABS)
def test_the_student_version_fails_every_check_with_its_message(stubs_graded, lab):
    stu = stubs_graded[lab]
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


def test_lab7_student_version_keeps_no_scaffolding_of_the_solution(built):
    student_nb = (built["lab7_capstone"] / "student" / "lab7_capstone.ipynb").read_text()
    assert "_arrived_at" not in student_nb and "self.admitted" not in student_nb


def test_lab1_does_not_print_its_key(built):
    student_nb = (built["lab1_fcfs"] / "student" / "lab1_fcfs.ipynb").read_text()
    assert "(-priority, arrival_seq)" not in student_nb
    assert "(-req.priority, req.arrival_seq)" not in student_nb


MODULES = ["fcfs", "gates", "vtc", "padded", "blocks", "chunked", "capstone"]


@pytest.mark.parametrize("name", MODULES)
def test_no_answer_key_is_importable_from_the_package(name):
    """Answer keys live in the autograder (hidden test cells), not in what students install."""
    module = importlib.import_module(f"minserve.labs.{name}")
    keys = [a for a in vars(module) if a.startswith("reference_") or a == "kv_length_splice_in"]
    assert not keys, keys


@pytest.mark.parametrize("name", MODULES)
def test_where_to_look_points_to_docs_and_lessons_not_to_the_solution_file(name):
    where = importlib.import_module(f"minserve.labs.{name}").WHERE
    for solution_file in ("policies.py", "fair.py", "kv_cache.py", "gates.py", "scheduler.py",
                          "backends/padded.py"):
        assert solution_file not in where, where
    assert "docs/" in where


def test_a_check_that_never_ends_becomes_a_message():
    from minserve.labs.common import LabCheckFailed, time_limit

    with pytest.raises(LabCheckFailed, match="did not finish within") as e:
        with time_limit(0.2, "an endless loop", "here"):
            while True:
                pass
    assert "where to look: here" in str(e.value)


def test_the_bench_runs_inside_a_running_event_loop():
    """Jupyter (and so `otter run`) runs cells inside an event loop: the bench must too."""
    from minserve.bench.targets import run_sync

    async def answer():
        return 42

    async def cell():  # a notebook cell calling the synchronous bench
        return run_sync(answer())

    assert asyncio.run(cell()) == 42
    assert run_sync(answer()) == 42


def test_the_padded_lab_shows_the_mixed_workload_crash():
    """Lab 4: the backend that sized splice-in from kv_length dies on the mixed workload,
    and the check names the cause."""
    from minserve.labs import padded

    said = padded.the_crash()
    assert "mixed-workload crash" in said and "Size it from mask.shape[1]" in said, said
