"""How a lab submission is graded (SPEC L1-L3), piece by piece and fast: the allow-list a
graded cell passes before it runs, the process it runs in, the differential check's
message, the similarity to the engine's code. `tests/test_labs.py` grades the whole corpus
with all of it through `otter run`."""

from __future__ import annotations

import hashlib
import importlib
import os
import re
import sys
import tempfile

import nbformat
import pytest

from minserve.labs import allowlist, fcfs, gates, grading, padded, similarity
from minserve.labs.common import LabCheckFailed
from minserve.labs.differential import Hidden, seed_of

from .conftest import load_script

labs_script = load_script("labs")
CORPUS = labs_script.corpus()


def _cell(lab: str):
    return grading.lab_module(lab).CELL


def _graded(m) -> str:
    return m.cells[0]


@pytest.mark.parametrize("lab", sorted(grading.LABS))
def test_every_solution_and_correct_submission_passes_the_allow_list(lab):
    """No false refusal: the solution and every correct corpus submission (heaps, bisect,
    dataclasses, torch.where ...) use only what a graded cell may."""
    cell = _cell(lab)
    assert allowlist.check_cell(labs_script.solution_code(lab), cell) == []
    for m in CORPUS:
        if m.lab == lab and m.correct:
            assert allowlist.check_cell(_graded(m), cell) == [], (m.name, allowlist.check_cell(
                _graded(m), cell))


# one line of each trick a graded cell might try, and what the refusal names
TRICKS = [
    ("import sys\nsys.modules['minserve.labs.fcfs'].check_key = print", "`import sys`"),
    ("import inspect", "`import inspect`"),
    ("import gc", "`import gc`"),
    ("import types", "`import types`"),
    ("import importlib", "`import importlib`"),
    ("import ctypes", "`import ctypes`"),
    ("import builtins", "`import builtins`"),
    ("import otter", "`import otter`"),
    ("from minserve.policies import FCFSPolicy", "the engine's own code is not allowed"),
    ("from minserve.labs import fcfs", "the engine's own code is not allowed"),
    ("from functools import partialmethod", "`from functools import partialmethod`"),
    ("x = Policy.__subclasses__()", "`.__subclasses__`"),
    ("def f(g):\n    return g.__code__", "`.__code__`"),
    ("def f(g):\n    return g.__globals__", "`.__globals__`"),
    ("x = print.__self__", "`.__self__`"),
    ("def f(e):\n    return e.__traceback__.tb_frame.f_back", "`.__traceback__`"),
    ("def f(g):\n    return g.gi_frame", "`.gi_frame`"),
    ("exec('x = 1')", "the builtin `exec`"),
    ("eval('1')", "the builtin `eval`"),
    ("compile('1', 'f', 'eval')", "the builtin `compile`"),
    ("x = globals()", "the builtin `globals`"),
    ("x = vars(Policy)", "the builtin `vars`"),
    ("x = open('/etc/passwd')", "the builtin `open`"),
    ("x = __import__('os')", "`__import__`"),
    ("x = getattr(Policy, '__subclasses__')", "`getattr(..., '__subclasses__')`"),
    ("def f(o, n):\n    return getattr(o, n)", "only with a constant attribute name"),
    ("class A(Policy):\n    def __new__(cls):\n        return None", "defining `__new__`"),
    ("class A(Policy):\n    def __getattribute__(self, n):\n        return 1",
     "defining `__getattribute__`"),
    ("class A(Policy, metaclass=type):\n    pass", "a metaclass"),
    ("class A(Policy):\n    def f(self):\n        return super(A, self).f()", "`super(...)` with"),
    ("P = Policy", "may only be called, subclassed"),
    ("Request.priority = 3", "may only be called, subclassed"),
    ("try:\n    x = 1\nexcept:\n    pass", "a bare `except:`"),
    ("try:\n    x = 1\nexcept BaseException:\n    pass", "`except BaseException`"),
]


@pytest.mark.parametrize("source, said", TRICKS, ids=[t[1] for t in TRICKS])
def test_a_graded_cell_that_reaches_for_the_grader_is_refused_saying_what(source, said):
    found = allowlist.check_cell(source + "\nclass FCFSLab(Policy):\n    pass\n", fcfs.CELL)
    assert found and any(said in str(v) for v in found), found


def test_lab4s_modules_are_limited_to_what_its_functions_need():
    cell = padded.CELL
    ok = "def f(mask):\n    return F.pad(torch.cat([mask, torch.ones_like(mask)]), (1, 0))\n"
    assert allowlist.check_cell(ok + "splice_in = remove = next_positions = f\n", cell) == []
    for bad, said in [("torch.load('x')", "`torch.load`"), ("x = torch", "may only be used as"),
                      ("torch.ops.aten", "`torch.ops`"), ("y = 1\nz = y.numpy()", "`.numpy`"),
                      ("from minserve.backends.padded import PaddedBackend",
                       "the engine's own code is not allowed")]:
        found = allowlist.check_cell(bad + "\n" + ok, cell)
        assert any(said in str(v) for v in found), (bad, found)


def test_super_reaching_the_reference_method_is_refused_and_other_super_calls_are_not():
    cell = grading.lab_module("lab5_blocks").CELL
    ok = ("class BlockManagerLab(BlockManager):\n    def __init__(self, *a):\n"
          "        super().__init__(*a)\n")
    assert allowlist.check_cell(ok, cell) == []
    bad = ok + "    def free(self, s):\n        return super().free(s)\n"
    assert any("`super().free`" in str(v) for v in allowlist.check_cell(bad, cell))
    direct = ok + "    def free(self, s):\n        return BlockManager.free(self, s)\n"
    assert any("an attribute of the engine's" in str(v) for v in allowlist.check_cell(direct, cell))


def test_the_other_cells_are_scanned_only_for_attempts_on_the_grader():
    assert allowlist.scan_other_cell("from minserve.labs import fcfs\nprint(fcfs.check_key)") == []
    assert allowlist.scan_other_cell("%timeit x = 1\norder = fcfs.check_in_engine(A)") == []
    for bad in ("import sys", "import otter.test_files as t", "f.__globals__", "exec(src)",
                "from minserve.labs import fcfs\nfcfs.check_key = print"):
        assert allowlist.scan_other_cell(bad), bad
    # a check's module imported by another cell, changed in this one
    assert allowlist.scan_other_cell("fcfs.check_key = print", {"fcfs"})


def test_the_runtime_builtins_import_only_the_allowed_modules():
    safe = allowlist.safe_builtins({"heapq"})
    env = {"__builtins__": safe}
    exec("import heapq\nx = heapq.nsmallest(1, [3, 1])", env)  # noqa: S102
    assert env["x"] == [1]
    for src in ("import os", "open('x')", "vars", "x = __import__('sys')"):
        with pytest.raises((ImportError, NameError)):
            exec(src, {"__builtins__": safe})  # noqa: S102


def _notebook(tmp_path, lab: str, graded: str, extra: list[str] | None = None):
    nb = nbformat.v4.new_notebook(metadata={"otter": {"assignment_name": lab}})
    nb.cells = [nbformat.v4.new_code_cell("from minserve.labs import gates"),
                nbformat.v4.new_code_cell(graded, metadata={"tags": [grading.ANSWER_TAG]}),
                *[nbformat.v4.new_code_cell(c) for c in extra or []]]
    path = tmp_path / f"{lab}.ipynb"
    nbformat.write(nb, path)
    return path


GATES_TEST = '''from otter.test_files import test_case

OK_FORMAT = False
name = "gates"
points = 2

@test_case(points=None, hidden=False)
def test_g1(check_queue_capacity):
    from minserve.labs import gates
    gates.check_g1(check_queue_capacity)

@test_case(points=None, hidden=True)
def test_the_graded_cell_sees_neither_the_checks_nor_the_seed(check_queue_capacity, lab_hidden):
    assert check_queue_capacity(-1, 0) == "nothing", check_queue_capacity(-1, 0)
    assert repr(lab_hidden) == "Hidden(scale=1)"
'''


@pytest.fixture
def gates_tests(tmp_path, monkeypatch):
    """(a temp folder that tempfile now uses, a tests folder holding GATES_TEST)."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "gates.py").write_text(GATES_TEST)
    return temp, tests


def test_the_grading_process_runs_the_graded_cell_alone_after_the_checks(tmp_path, gates_tests):
    """The graded cell, read from the file, runs in a fresh process with its lab's names
    only: not the notebook's other cells (which would have changed a check), not the
    checks' modules, not the seed (`lab_hidden` is the tests'); what it prints goes
    nowhere; the result comes back per test case; its working folder is gone after."""
    temp, tests = gates_tests
    # G1 that never refuses (check_g1 fails it), and a cell after it that would disable
    # check_g1 if it ran (counted as shipped here, so the scan lets it be: it is not run)
    graded = labs_script.solution_code("lab2_gates") + (
        "\n\nprint('from the graded cell')\n\n\n"
        "def check_queue_capacity(pending, max_queue_size):\n"
        "    return 'nothing' if pending < 0 else None\n")
    patch = "gates.check_g1 = lambda fn: None"
    path = _notebook(tmp_path, "lab2_gates", graded, [patch])
    shipped = {hashlib.sha256(patch.encode()).hexdigest()}
    g = grading.grade_notebook(path, tests, seed_of("x", "lab2_gates"), shipped=shipped)
    assert g.refused is None and g.error is None, (g.refused, g.error)
    (_, g1_ok, g1_said), (_, hidden_ok, hidden_said) = g.questions["gates"]
    assert not g1_ok and "check_queue_capacity(pending=3, max_queue_size=3) returned None" in g1_said
    assert hidden_ok, hidden_said
    assert list(temp.iterdir()) == []  # a term of submissions leaves no folder behind


def test_a_grading_process_past_its_time_is_killed_and_leaves_no_folder(tmp_path, gates_tests):
    """A graded cell that never ends: the parent kills it at the time limit, every case
    fails saying so, and the folder it ran in is removed (the child, killed, cannot)."""
    temp, tests = gates_tests
    graded = labs_script.solution_code("lab2_gates") + "\n\nwhile True:\n    pass\n"
    path = _notebook(tmp_path, "lab2_gates", graded)
    g = grading.grade_notebook(path, tests, 0, timeout_s=2)
    assert g.error and "did not finish within 2 s" in g.error, g.error
    assert not any(ok for _, ok, _ in g.questions["gates"])
    assert list(temp.iterdir()) == []


@pytest.mark.parametrize("cell, said", [
    ("import sys\nsys.modules['minserve.labs.gates'].check_g1 = print", "`import sys`"),
    ("gates.check_g1 = lambda fn: None", "changing `gates.check_g1`")])
def test_a_cell_that_reaches_for_the_grader_makes_the_submission_score_nothing(tmp_path, cell,
                                                                               said):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "gates.py").write_text(GATES_TEST)
    path = _notebook(tmp_path, "lab2_gates", labs_script.solution_code("lab2_gates"), [cell])
    g = grading.grade_notebook(path, tests, 0)
    assert g.refused and "reaches for the grader" in g.refused and said in g.refused, g.refused
    assert not any(ok for _, ok, _ in g.questions["gates"])


def test_a_difference_is_shown_as_the_shortest_sequence_with_both_sides_and_the_contract():
    """L1's message: the sequence (shrunk), the reference's result, the submission's, the
    contract sentence, where to look. Here a peek that remembers its head."""
    src = next(m for m in CORPUS if m.lab == "lab1_fcfs" and m.name == "peek_caches_the_head")
    env = labs_script.cell_env("lab1_fcfs", src.code)
    with pytest.raises(LabCheckFailed) as e:
        fcfs.check_against_the_engine(env["FCFSLab"], Hidden(seed_of("a", "lab1_fcfs"), 0.3))
    said = str(e.value)
    steps = re.findall(r"^\s+\d+\. (.*)$", said, re.M)
    assert steps[0] == "p = FCFSLab()" and len(steps) <= 8, said  # shrunk from up to 31
    assert steps[-1] == "p.peek_next()" and "on_request_arrived" in said, said
    assert "the reference: returned" in said and "yours:" in said, said
    assert "every arrival counts at the next peek" in said, said
    assert said.rstrip().splitlines()[-1].strip().startswith("where to look: FCFSLab.peek_next")


def test_the_same_secret_draws_the_same_sequences_and_another_secret_others():
    """Grades do not depend on the machine: a seed fixes every sequence (and a correct
    piece passes whatever the seed; a wrong one fails the same way each time)."""
    src = next(m for m in CORPUS if m.lab == "lab2_gates" and m.name == "g1_only_when_exactly_full")
    env = labs_script.cell_env("lab2_gates", src.code)
    said = []
    for secret in ("a", "a", "b"):
        with pytest.raises(LabCheckFailed) as e:
            gates.check_against_the_engine(env["check_queue_capacity"], env["check_kv_budget"],
                                           env["check_block_pool"],
                                           Hidden(seed_of(secret, "lab2_gates"), 0.5, shrink=False))
        said.append(str(e.value))
    assert said[0] == said[1] != said[2]


def test_a_renamed_copy_of_the_engine_is_flagged_and_an_honest_answer_is_not():
    copies = [m for m in CORPUS if m.flagged]
    assert copies
    for m in copies:
        report = similarity.similarity_report(m.lab, _graded(m))
        assert report["flagged"] and report["share"] >= 0.8, (m.name, report)
    for lab in ("lab1_fcfs", "lab5_blocks"):
        assert not similarity.similarity_report(lab, labs_script.solution_code(lab))["flagged"]
    # renaming, re-spacing and type hints change nothing
    a = "def f(x: int) -> int:\n    '''doc'''\n    return [y * 2 for y in x if y]  # c\n"
    b = "def g(items):\n    return [item * 2 for item in items if item]\n"
    assert similarity.tokens(a) == similarity.tokens(b)


def test_the_sequences_do_not_depend_on_what_else_the_process_imported(tmp_path, monkeypatch):
    """Hypothesis now and then draws a literal of a "local" module the process has loaded;
    grading keeps that pool empty, so one more module (here one full of numbers) imported
    between two runs changes no sequence (make test's grading process imports every lab's
    checks, a teacher's only one lab's; a wheel's minserve is not local, a checkout's is)."""
    from minserve.labs import differential

    drawn: list[list[int]] = []
    apply = differential.Differential.apply
    monkeypatch.setattr(differential.Differential, "apply",
                        lambda self, code: drawn[-1].append(code) or apply(self, code))
    src = next(m for m in CORPUS if m.lab == "lab1_fcfs" and m.name == "correct_heap")
    env = labs_script.cell_env("lab1_fcfs", src.code)

    def codes() -> list[int]:
        drawn.append([])
        differential.run(fcfs._machine(), Hidden(seed_of("same", "lab1_fcfs"), 0.2, False),
                         "lab1/fcfs", piece="", reference="", where="", bind={"submission": env["FCFSLab"]})
        return drawn[-1]

    before = codes()
    name = f"many_literals_{os.getpid()}"
    (tmp_path / f"{name}.py").write_text(
        "N = [" + ", ".join(str(7919 * k + 13) for k in range(40)) + "]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    del sys.modules[name]
    monkeypatch.setitem(sys.modules, name, module)  # loaded while the checks run, then gone
    assert len(before) > 100 and codes() == before
