"""`make lab-check` as tests: the classroom labs grade as a class will be graded (docs/teaching.md).

Each lab in `notebooks/labs/` is one otter-assign source notebook. The labs are built with
otter (`scripts/labs.py build`, into a temporary folder). Then, the way a teacher grades:

* every lab's solution, and every typical wrong submission of `tests/lab_corpus/<lab>/`
  (the student version with its graded cell replaced by the mistake), goes through
  `otter run` with that lab's autograder zip: a fresh kernel runs the notebook, then every
  test, hidden ones included. Under `make test` only the solutions and one wrong
  submission per lab do; the rest are graded by the same tests in a forked process
  (`grade_forked`), and a test checks that the two runners agree where both ran. Solutions score full marks; each mistake scores below full,
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
import os
from pathlib import Path

import pytest

from .conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
labs_script = load_script("labs")

LABS = [p.stem for p in labs_script.lab_sources()]
# `make lab-check` sets it: every submission through `otter run`, not only the solutions
# and one wrong submission per lab (`grade_corpus`)
OTTER_ALL = "MINSERVE_LABS_OTTER_RUN_ALL"
CORPUS = labs_script.corpus()
MISTAKES = [m for m in CORPUS if not m.correct]
CORRECT = [m for m in CORPUS if m.correct]
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


def test_every_lab_has_a_corpus_of_at_least_four_typical_mistakes_and_a_correct_one():
    for lab in LABS:
        mistakes = [m for m in MISTAKES if m.lab == lab]
        assert len(mistakes) >= 4, (lab, [m.name for m in mistakes])
        for m in mistakes:
            assert m.expect, f"{lab}/{m.name}.py has no '# expect:' line"
        # written otherwise than the solution: proves the checks give no false failure
        assert [m for m in CORRECT if m.lab == lab], f"{lab} has no '# correct:' submission"
    for m in CORRECT:
        assert not m.expect, f"{m.lab}/{m.name}.py is marked correct and expects messages"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return labs_script.build(tmp_path_factory.mktemp("labs"))


@pytest.fixture(scope="module")
def otter_graded(built, tmp_path_factory):
    """label -> `otter run` result, for every solution and every corpus submission. The
    table (scores, seconds per submission, first message) goes to build/labs/."""
    results = labs_script.grade_corpus(built, tmp_path_factory.mktemp("submissions"), workers=2,
                                       otter_all=os.environ.get(OTTER_ALL) == "1")
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


def _first_lines(result) -> dict[str, list[str]]:
    """Per question, each failed case's LabCheckFailed line: what the student reads."""
    return {name: [next((ln.strip() for ln in m.splitlines() if "LabCheckFailed" in ln), m)
                   for m in q["failed"]] for name, q in result["questions"].items()}


def test_otter_run_grades_each_lab_and_the_forked_runner_agrees_with_it(otter_graded):
    """Every lab's solution and one wrong submission per lab went through `otter run`
    (with MINSERVE_LABS_OTTER_RUN_ALL=1, as `make lab-check` runs, every submission did);
    the rest of the corpus through `grade_forked`: the same autograder tests run by
    otter's own test runner, in a process forked per submission instead of a kernel.
    Where both graded a submission, the scores and the messages are the same: the cheaper
    runner says what otter run would."""
    by_otter = [label for label, r in otter_graded.items() if r["runner"] == "otter run"]
    assert {f"{lab}/solution" for lab in LABS} <= set(by_otter)
    for lab in LABS:  # a wrong submission, not only the solution, through the real tool
        assert any(label.startswith(f"{lab}/") and not label.endswith("/solution")
                   for label in by_otter), lab
    both = [label for label in by_otter if "forked" in otter_graded[label]]
    if os.environ.get(OTTER_ALL) != "1":
        assert len(both) == len(by_otter) == 2 * len(LABS), by_otter
    for label in both:
        ran, forked = otter_graded[label], otter_graded[label]["forked"]
        assert {n: (q["score"], q["possible"]) for n, q in ran["questions"].items()} == {
            n: (q["score"], q["possible"]) for n, q in forked["questions"].items()}, label
        assert _first_lines(ran) == _first_lines(forked), label


@pytest.mark.parametrize("submission", CORRECT, ids=[f"{m.lab}/{m.name}" for m in CORRECT])
def test_each_correct_submission_written_otherwise_scores_full_marks(otter_graded, submission):
    """No false failure: a correct piece written differently from the solution (a heap,
    per-session queues, table-driven gates, a round robin in the capstone) earns every point."""
    result = otter_graded[f"{submission.lab}/{submission.name}"]
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


# ------------------------------------------------------------------ the instructor's secret
SECRETS = ["autumn-2026", "7", "a class of its own"]


def _cell_namespace(lab: str, code: str | None = None) -> dict:
    """The source notebook's cells up to its graded one run in a fresh namespace (the
    imports a student's cell relies on), then the graded cell: the solution as written in
    the source, or `code` (a corpus submission). No otter: the hidden checks are called
    directly, which proves for each secret what the autograder's hidden tests would."""
    import nbformat

    nb = nbformat.read(labs_script.SOURCES / f"{lab}.ipynb", as_version=4)
    cells = [c.source for c in nb.cells if c.cell_type == "code"]
    graded = next(i for i, src in enumerate(cells) if "BEGIN SOLUTION NO PROMPT" in src)
    env: dict = {"__name__": "__main__"}
    for src in cells[:graded] + [code if code is not None else cells[graded]]:
        exec(compile(src, f"{lab} cell", "exec"), env)
    return env


def _mistake(lab: str, name: str) -> dict:
    found = [m for m in MISTAKES if m.lab == lab and m.name == name]
    assert found, f"no corpus file {lab}/{name}.py"
    return _cell_namespace(lab, found[0].code)


def _hidden(lab: str, env: dict, secret: str, answers=None) -> None:
    """What the lab's hidden tests add, drawn from `secret` (the units they rerun first)."""
    from minserve.labs import blocks, capstone, chunked, gates, vtc

    if lab == "lab2_gates":
        gates.check_units(env["check_queue_capacity"], env["check_kv_budget"],
                          env["check_block_pool"], secret=secret)
    elif lab == "lab3_vtc":
        vtc.check_units(env["VTCLab"], secret=secret)
        vtc.check_bound(env["VTCLab"], seeds=vtc.hidden_seeds(secret))
    elif lab == "lab5_blocks":
        blocks.check_units(env["BlockManagerLab"], secret=secret)
    elif lab == "lab6_chunked":
        chunked.check_measure(env["next_chunk"], env["measure"], answers=answers,
                              **chunked.hidden_runs(secret))
    elif lab == "lab7_capstone":
        capstone.check_contract(env["MyPolicy"], seed=capstone.hidden_seed(secret, "c0"), n=30)


# per lab, the corpus submissions that only the secret-drawn hidden inputs catch
HOLES = {
    "lab2_gates": ["g3_hard_on_blocks_needed", "g3_holds_only_when_pool_empty"],
    "lab3_vtc": ["lift_over_every_session", "empty_queue_lift_to_least",
                 "empty_queue_lift_to_last_arrival", "tie_break_by_session_name"],
    "lab5_blocks": ["walk_skips_a_missing_block", "walk_collects_every_cached_block"],
    "lab6_chunked": ["ttft_counts_the_chunks", "ttft_from_admission"],
    "lab7_capstone": ["peek_caches_the_head", "aging_beats_priority", "iter_in_arrival_order"],
}


@pytest.mark.parametrize("lab", sorted(HOLES))
def test_the_solution_passes_and_the_holes_fail_for_several_secrets(lab):
    """Hidden tests that stay hidden in an open repository: whatever secret the instructor
    builds the autograder with, the solution and the correct corpus submissions pass the
    hidden checks, and every submission of a hole fails them. (The engine-heavy labs 6
    and 7 with two secrets, to keep this cheap.)"""
    from minserve.labs.common import LabCheckFailed

    solution = _cell_namespace(lab)
    correct = [_cell_namespace(lab, m.code) for m in CORRECT if m.lab == lab]
    secrets = SECRETS[:2] if lab in ("lab6_chunked", "lab7_capstone") else SECRETS
    answers = (lambda trace, rid: solution["measure"](trace, rid)) if lab == "lab6_chunked" else None
    for secret in secrets:
        for env in [solution, *correct]:
            _hidden(lab, env, secret, answers)
        for name in HOLES[lab]:
            with pytest.raises(LabCheckFailed):
                _hidden(lab, _mistake(lab, name), secret, answers)
                print(f"{lab}/{name} passed the hidden checks with secret {secret!r}")


def test_the_secret_reaches_the_autograder_and_only_it(tmp_path):
    """`scripts/labs.py build --secret S` writes S into the hidden tests of the autograder
    (its tests folder and its zip); the student version holds neither S nor the hidden
    tests; two secrets draw different hidden inputs."""
    import zipfile

    from minserve.labs import capstone, chunked

    secret = "spring-2027 \"quoted\""
    lab = "lab6_chunked"
    d = labs_script.build(tmp_path, labs=[labs_script.SOURCES / f"{lab}.ipynb"],
                          secret=secret)[lab]
    hidden = "".join(p.read_text() for p in (d / "autograder" / "tests").glob("*.py"))
    assert f"hidden_runs({secret!r})" in hidden and "__LAB_SECRET__" not in hidden
    with zipfile.ZipFile(labs_script.autograder_zip(d)) as z:
        assert any(repr(secret) in z.read(n).decode(errors="replace") for n in z.namelist()
                   if n.endswith(".py"))
    student = "".join(p.read_text() for p in (d / "student").rglob("*") if p.is_file())
    assert "spring-2027" not in student and "__LAB_SECRET__" not in student
    # the source (public) keeps only the placeholder
    assert "spring-2027" not in (labs_script.SOURCES / f"{lab}.ipynb").read_text()
    assert chunked.hidden_runs("a") != chunked.hidden_runs("b")
    assert capstone.hidden_seed("a", "workload") != capstone.hidden_seed("b", "workload")
