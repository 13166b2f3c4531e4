"""`make lab-check` as tests: the classroom labs grade as a class will be graded (docs/teaching.md).

Each lab in `notebooks/labs/` is one otter-assign source notebook. The labs are built with
otter (`scripts/labs.py build`, into a temporary folder, sealed for the labs' grading
plugin). Then, the way a teacher grades:

* every lab's solution, and every submission of `tests/lab_corpus/<lab>/` (the student
  version with its graded cell replaced, and for some another cell added), goes through
  `otter run` with that lab's autograder zip: the plugin reads the notebook file, checks
  the graded cell, runs it alone in a fresh process after the checks (hidden ones
  included). Under `make test` only the solutions and one wrong submission per lab do;
  every submission goes through the plugin's grading functions called directly, and a
  test checks that the two agree where both ran. Solutions and correct submissions score
  full marks; each mistake scores below full and its messages say what its `# expect:`
  lines say (the mistake, and where to look); each attempt on the grader scores 0 and
  says what is not allowed; copies of the engine's code are flagged.
* the student version, stubs as shipped, fails every test with a message;
* the student version holds no solution, no hidden test, no secret; the autograder holds
  them;
* the secret never reaches an output; a rebuild keeps it.

Under `make test` the hidden checks try a quarter of their random sequences (the build's
`scale`); `make lab-check` grades at full scale, as a class is graded.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from .conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
labs_script = load_script("labs")

LABS = [p.stem for p in labs_script.lab_sources()]
# `make lab-check` sets it: every submission through `otter run`, at full scale
OTTER_ALL = "MINSERVE_LABS_OTTER_RUN_ALL"
FULL = os.environ.get(OTTER_ALL) == "1"
SCALE = 1.0 if FULL else 0.25  # the hidden checks' share of their random sequences
CORPUS = labs_script.corpus()
MISTAKES = [m for m in CORPUS if not m.correct and not m.attempt]
ATTEMPTS = [m for m in CORPUS if m.attempt]
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


def test_every_lab_has_a_corpus_of_mistakes_attempts_and_correct_submissions():
    for lab in LABS:
        mistakes = [m for m in MISTAKES if m.lab == lab]
        assert len(mistakes) >= 4, (lab, [m.name for m in mistakes])
        for m in mistakes + [a for a in ATTEMPTS if a.lab == lab]:
            assert m.expect, f"{lab}/{m.name}.py has no '# expect:' line"
        # written otherwise than the solution: proves the checks give no false failure
        assert len([m for m in CORRECT if m.lab == lab]) >= 2, f"{lab}: fewer than 2 correct ones"
    for m in CORRECT:
        assert not m.expect, f"{m.lab}/{m.name}.py is marked correct and expects messages"
    assert len(ATTEMPTS) >= 9 and {a.lab for a in ATTEMPTS} == set(LABS), ATTEMPTS
    assert any(len(a.cells) > 1 for a in ATTEMPTS), "no attempt from another cell"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return labs_script.build(tmp_path_factory.mktemp("labs"), scale=SCALE)


@pytest.fixture(scope="module")
def otter_graded(built, tmp_path_factory):
    """label -> result, for every solution and every corpus submission. The table (scores,
    seconds per submission, similarity, first message) goes to build/labs/."""
    results = labs_script.grade_corpus(built, tmp_path_factory.mktemp("submissions"), workers=2,
                                       otter_all=FULL)
    report = ROOT / "build" / "labs" / "grading-report.md"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(labs_script.corpus_report(results) + "\n")
    return results


def _score(result) -> tuple[float, float]:
    qs = result["questions"].values()
    return sum(q["score"] for q in qs), sum(q["possible"] for q in qs)


def _messages(result) -> str:
    return "\n".join(m for q in result["questions"].values() for m in q["failed"])


@pytest.mark.parametrize("lab", LABS)
def test_the_solution_scores_full_marks_under_otter_run(otter_graded, lab):
    result = otter_graded[f"{lab}/solution"]
    score, possible = _score(result)
    assert possible > 0 and score == possible and not _messages(result), _messages(result)


def _where(result) -> dict[str, list[str]]:
    """Per question, each failed case's "where to look" line: what the student reads."""
    return {name: [next((ln.strip() for ln in m.splitlines() if "where to look" in ln), m)
                   for m in q["failed"]] for name, q in result["questions"].items()}


def test_otter_run_grades_each_lab_and_the_direct_grader_agrees_with_it(otter_graded):
    """Every lab's solution and one wrong submission per lab went through `otter run` (with
    MINSERVE_LABS_OTTER_RUN_ALL=1, as `make lab-check` runs, every submission did); every
    submission through the plugin's grading functions called directly. Where both graded
    a submission, the scores and where each failure points are the same."""
    by_otter = [label for label, r in otter_graded.items() if r["runner"] == "otter run"]
    assert {f"{lab}/solution" for lab in LABS} <= set(by_otter)
    for lab in LABS:  # a wrong submission, not only the solution, through the real tool
        assert any(label.startswith(f"{lab}/") and not label.endswith("/solution")
                   for label in by_otter), lab
    both = [label for label in by_otter if "direct" in otter_graded[label]]
    if not FULL:
        assert len(both) == len(by_otter) == 2 * len(LABS), by_otter
    for label in both:
        ran, direct = otter_graded[label], otter_graded[label]["direct"]
        assert {n: (q["score"], q["possible"]) for n, q in ran["questions"].items()} == {
            n: (q["score"], q["possible"]) for n, q in direct["questions"].items()}, label
        assert _where(ran) == _where(direct), label
        assert ran["plugin"]["similarity"] == direct["plugin"]["similarity"], label


@pytest.mark.parametrize("submission", CORRECT, ids=[f"{m.lab}/{m.name}" for m in CORRECT])
def test_each_correct_submission_written_otherwise_scores_full_marks(otter_graded, submission):
    """No false failure: a correct piece written differently from the solution (a heap,
    per-session queues, table-driven gates, a round robin in the capstone) earns every point."""
    result = otter_graded[f"{submission.lab}/{submission.name}"]
    score, possible = _score(result)
    assert possible > 0 and score == possible and not _messages(result), _messages(result)


@pytest.mark.parametrize("mistake", MISTAKES, ids=[f"{m.lab}/{m.name}" for m in MISTAKES])
def test_each_typical_mistake_scores_below_full_and_is_named(otter_graded, mistake):
    result = otter_graded[f"{mistake.lab}/{mistake.name}"]
    score, possible = _score(result)
    assert possible > 0 and score < possible, f"{mistake.what}: {score} / {possible}"
    messages = _messages(result)
    for expected in mistake.expect:
        assert expected in messages, f"{mistake.what}: no {expected!r} in\n{messages}"
    # one message per failed case, each saying where to look; no traceback from inside
    # the engine
    assert "where to look:" in messages, messages
    assert "scheduler.py\", line" not in messages and "site-packages" not in messages, messages


@pytest.mark.parametrize("attempt", ATTEMPTS, ids=[f"{m.lab}/{m.name}" for m in ATTEMPTS])
def test_each_attempt_on_the_grader_scores_zero_and_says_what_is_not_allowed(otter_graded,
                                                                            attempt):
    """Wrapping, rebuilding, exec'ing or compiling the reference, `__new__` handing out a
    reference object, lab 4 calling PaddedBackend's methods, replacing the checks in
    sys.modules, patching otter's runner, behaving well only for a check's frame: 0 points
    for the piece, and the message says what is not allowed."""
    result = otter_graded[f"{attempt.lab}/{attempt.name}"]
    score, possible = _score(result)
    assert possible > 0 and score == 0, f"{attempt.what}: {score} / {possible}"
    messages = _messages(result)
    for expected in attempt.expect:
        assert expected in messages, f"{attempt.what}: no {expected!r} in\n{messages}"


@pytest.mark.parametrize("submission", [m for m in CORPUS if m.flagged] +
                         [m for m in CORRECT if not m.flagged][:3],
                         ids=lambda m: f"{m.lab}/{m.name}")
def test_a_copy_of_the_engines_code_is_flagged_for_a_person_and_an_answer_is_not(otter_graded,
                                                                                 submission):
    """Renamed copies of the engine's code pass the checks (they behave), so grading flags
    them: their similarity to the engine's implementation is over the threshold, in the
    results and the report. Correct answers written by hand are not flagged."""
    result = otter_graded[f"{submission.lab}/{submission.name}"]
    similarity = result["plugin"]["similarity"]
    assert similarity["flagged"] is submission.flagged, similarity
    assert ("FLAGGED" in result["report"]) is submission.flagged, result["report"]


@pytest.fixture(scope="module")
def stubs_graded(built):
    """lab -> the student version, stubs as shipped, graded the plugin's way."""
    return {lab: labs_script.grade(d / "student" / f"{lab}.ipynb", d / "autograder" / "tests",
                                   labs_script.lab_seed(d), scale=SCALE)
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
def test_the_student_version_holds_no_solution_no_hidden_test_and_no_grader(built, lab):
    d = built[lab]
    student_nb = (d / "student" / f"{lab}.ipynb").read_text()
    assert "SOLUTION" not in student_nb and "NotImplementedError" in student_nb
    assert "**Answer.**" not in student_nb
    assert "**Answer.**" in (d / "autograder" / f"{lab}.ipynb").read_text()
    public = "".join(p.read_text() for p in (d / "student" / "tests").glob("*.py"))
    every = "".join(p.read_text() for p in (d / "autograder" / "tests").glob("*.py"))
    assert "hidden=True" not in public and "hidden=True" in every
    assert "lab_hidden" not in public and "lab_hidden" in every
    student = "".join(p.read_text() for p in (d / "student").rglob("*") if p.is_file())
    assert "otter_plugin" not in student
    assert labs_script.plugin_config(json.loads(
        (d / "autograder" / "otter_config.json").read_text()))["lab"] == lab


def test_lab7_student_version_keeps_no_scaffolding_of_the_solution(built):
    student_nb = (built["lab7_capstone"] / "student" / "lab7_capstone.ipynb").read_text()
    assert "_arrived_at" not in student_nb and "self.admitted" not in student_nb


def test_lab1_does_not_print_its_key(built):
    student_nb = (built["lab1_fcfs"] / "student" / "lab1_fcfs.ipynb").read_text()
    assert "(-priority, arrival_seq)" not in student_nb
    assert "(-req.priority, req.arrival_seq)" not in student_nb


MODULES = ["fcfs", "gates", "vtc", "padded", "blocks", "chunked", "capstone"]


@pytest.mark.parametrize("name", MODULES)
def test_the_checks_hold_no_answer_only_the_engines_own_reference(name):
    """The hidden checks compare with the engine's own code (minserve's FCFSPolicy,
    FairPolicy, gates, PaddedBackend, BlockManager, Scheduler.next_chunk): the package
    students install defines no answer of a lab's piece under the piece's name."""
    module = importlib.import_module(f"minserve.labs.{name}")
    answers = [n for n in module.CELL.names if n in vars(module)]
    assert not answers, answers


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


def test_a_failed_check_in_a_cell_shows_its_message_not_a_traceback():
    """Jupyter (IPython) asks an exception for `_render_traceback_`: a demo cell after a
    failed check shows what is wrong and where to look, not a wall of frames."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    shell = InteractiveShell.instance()
    with capture_output() as out:
        shell.run_cell("from minserve.labs.common import fail\n"
                       "def inner():\n    fail('the queue drained as [b, a]', 'docs/x.md')\n"
                       "def demo():\n    inner()\n"
                       "demo()")
    assert out.stdout == "LabCheckFailed: the queue drained as [b, a]\n    where to look: docs/x.md\n"


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
def test_the_detection_table_covers_the_corpus_and_every_case_is_caught_by_every_secret():
    """docs/lab_detection.md is `python scripts/labs.py detection` (`make lab-detection`):
    each corpus case under 200 secrets. Every wrong submission is caught by every secret,
    every correct one passes every secret, and the table lists the corpus as it is."""
    text = (ROOT / "docs" / "lab_detection.md").read_text()
    rows = re.findall(r"^\| (lab\w+) \| (\w+) \| ([\w -]+) \| (\d+) / (\d+) \|", text, re.M)
    table = {(lab, name): (kind, int(caught), int(n)) for lab, name, kind, caught, n in rows}
    want = {(m.lab, m.name) for m in CORPUS if not m.attempt} | {(lab, "solution") for lab in LABS}
    assert set(table) == want, sorted(set(table) ^ want)
    for (lab, name), (kind, caught, n) in table.items():
        # a wrong one under 200 secrets; a correct one (every check runs to its end, some
        # 3 s a secret) under 20
        assert n >= (20 if kind == "correct" else 200), (lab, name, n)
        assert caught == (0 if kind == "correct" else n), (lab, name, kind, caught, n)


def test_a_rebuild_keeps_the_secret_and_public_drops_it_on_purpose(tmp_path):
    """`make labs` (no secret) after `build --secret S` keeps S, and says so; `--public`
    rebuilds with the public inputs only when asked."""
    source = [labs_script.SOURCES / "lab2_gates.ipynb"]
    d = labs_script.build(tmp_path, labs=source, secret="winter-2027")["lab2_gates"]
    said: list[str] = []
    labs_script.build(tmp_path, labs=source, said=said)
    assert labs_script.built_secret(d) == "winter-2027"
    assert any("kept the secret" in s for s in said), said
    with zipfile.ZipFile(labs_script.autograder_zip(d)) as z:
        assert "winter-2027" in z.read("otter_config.json").decode()
    said.clear()
    labs_script.build(tmp_path, labs=source, public=True, said=said)
    assert labs_script.built_secret(d) is None and any("no secret" in s for s in said), said


def test_the_secret_never_appears_in_any_output_of_grading(tmp_path):
    """A wrong submission graded as a teacher grades it, with an autograder built with a
    secret: `otter run -o DIR` (the CLI, a fresh process) and `scripts/labs.py grade`. The
    secret is in none of the files written, nor in stdout or stderr; the hidden tests'
    messages show the check's line (`lab_hidden`), never a value drawn from it."""
    secret = "Zq7-spring-2027-secret"
    lab = "lab2_gates"
    d = labs_script.build(tmp_path / "built", labs=[labs_script.SOURCES / f"{lab}.ipynb"],
                          secret=secret, scale=0.25)[lab]
    hidden = "".join(p.read_text() for p in (d / "autograder" / "tests").glob("*.py"))
    assert secret not in hidden and "__LAB_SECRET__" not in hidden
    wrong = next(m for m in MISTAKES if m.lab == lab and m.name == "g1_only_when_exactly_full")
    sub = labs_script.write_submission(d / "student" / f"{lab}.ipynb", wrong.code, tmp_path / "sub")
    out_dir = tmp_path / "results"
    out_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(labs_script.SHIMS)}
    otter = Path(sys.executable).with_name("otter")
    ran = subprocess.run([str(otter), "run", "-a", str(labs_script.autograder_zip(d)), "-o",
                          str(out_dir), str(sub)], capture_output=True, text=True, env=env,
                         timeout=600)
    graded = subprocess.run([sys.executable, str(ROOT / "scripts" / "labs.py"), "grade",
                             str(labs_script.autograder_zip(d)), str(sub)],
                            capture_output=True, text=True, env=env, timeout=600)
    assert ran.returncode == 0 and graded.returncode == 0, ran.stderr[-2000:] + graded.stderr[-2000:]
    results = json.loads((out_dir / "results.json").read_text())
    said = json.dumps(results)
    assert "lab_hidden" in said and "however far beyond it pending already is" in said, said
    outputs = [ran.stdout, ran.stderr, graded.stdout, graded.stderr]
    outputs += [p.read_bytes().decode(errors="replace") for p in out_dir.rglob("*") if p.is_file()]
    outputs += [p.read_bytes().decode(errors="replace") for p in (tmp_path / "sub").rglob("*")
                if p.is_file()]
    leaks = [o[:200] for o in outputs if secret in o or "spring-2027" in o]
    assert not leaks, leaks


def test_the_counts_teaching_md_quotes_are_the_corpus_by_kind():
    """docs/teaching.md quotes the corpus's split by kind through docs/figures.json,
    counted here from each file's header (its size and the labs' tests are counts of
    scripts/repo_counts.py, held by tests/test_page_figures.py)."""
    from minserve import figures

    quoted = {k: v["value"] for k, v in figures.load().items()}
    assert quoted["count.corpus_submissions"] == len(CORPUS)
    assert quoted["labs.corpus_wrong"] == len(MISTAKES)
    assert quoted["labs.corpus_attempts"] == len(ATTEMPTS)
    assert quoted["labs.corpus_correct"] == len(CORRECT)
