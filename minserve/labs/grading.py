"""Grading a submission where it cannot reach its grader (SPEC L2, L3).

`otter run` executes a notebook in a Jupyter kernel, then runs the tests in that same
kernel against what the cells left (otter/execute: the kernel runs an init cell, the
notebook, then an export cell that runs every test file and pickles the results). Every
cell of a submission runs there, so anything a cell does (replace a check in
`sys.modules`, patch otter's test runner, write the pickle) happens in the process that
grades it: a guard inside that process cannot stop code running beside it. The trust
boundary cannot be inside the kernel.

So grading does not use the kernel's results. What runs, and where:

    otter run (trusted)                              fresh process (forked, rlimits)
    ├─ read the submitted notebook FILE              ├─ import the lab's checks and
    ├─ its graded cell: allowlist.check_cell         │  load the test files first
    ├─ the other cells: allowlist.scan_other_cell    ├─ exec the graded cell alone, with
    ├─ copies: similarity.py                         │  safe_builtins (stdout: /dev/null)
    ├─ fork ───────────────────────────────────────► ├─ run every test with otter's
    ├─ (the kernel runs nothing of the submission)   │  runner: piece names + lab_hidden
    └─ results ◄──── JSON over a pipe ─────────────── └─ exit
                                                      (a seed from the secret, never
                                                       the secret)

Nothing a notebook's other cells do runs while grading; the graded cell runs after the
checks it is graded by were loaded, in a process whose only way out is the pipe, which
its code cannot reach (no `os`, no `sys`, no frames: allowlist.py). Otter's own flow is
kept (the plugin in otter_plugin.py takes the kernel's place), so `otter run`, `otter
grade` and Gradescope grade the same way.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import select
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .allowlist import Violation, check_cell, minserve_names, safe_builtins, scan_other_cell
from .common import LABS, lab_module

ANSWER_TAG = "otter_answer_cell"  # otter assign tags the cells a student writes in
OTTER_INIT = re.compile(r'# Initialize Otter\nimport otter\ngrader = otter\.Notebook\("[\w.-]+"\)')


# ------------------------------------------------------------------ reading the submission
@dataclass
class Submission:
    """What grading reads off a submitted notebook file (never off a kernel)."""

    lab: str
    source: str  # the graded cell(s), in order
    cells: list[int]  # their indices
    violations: list[Violation] = field(default_factory=list)  # the graded cell's
    attempts: list[str] = field(default_factory=list)  # other cells: "cell N: line L: ..."

    @property
    def refused(self) -> str | None:
        """Why the submission scores 0 without running, or None."""
        if self.violations:
            shown = "; ".join(str(v) for v in self.violations[:4])
            more = f" (and {len(self.violations) - 4} more)" if len(self.violations) > 4 else ""
            return (f"LabCheckFailed: the graded cell was not run: {shown}{more}. A graded cell "
                    "may use the standard library's data structures and what the lab's earlier "
                    "cells import.\n    where to look: 'What a graded cell may use' at the top "
                    "of the lab; docs/teaching.md, 'Where the trust boundary is'")
        if self.attempts:
            return (f"LabCheckFailed: the submission reaches for the grader: "
                    f"{'; '.join(self.attempts[:3])}. Grading runs the graded cell alone, so no "
                    "other cell can change a check; a notebook that tries scores 0.\n"
                    "    where to look: docs/teaching.md, 'Where the trust boundary is'")
        return None


def read_submission(path: Path, lab: str | None = None,
                    shipped: set[str] | None = None) -> Submission:
    """The graded cell(s) of a submitted notebook and what the allow-list says of them.
    `shipped`: sha256 hashes of the student version's own code cells (not scanned)."""
    import hashlib

    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    lab = lab or nb.metadata.get("otter", {}).get("assignment_name")
    if lab not in LABS:
        raise ValueError(f"{path}: not a lab notebook (assignment {lab!r})")
    cell = lab_module(lab).CELL
    answers = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
               and ANSWER_TAG in c.get("metadata", {}).get("tags", [])]
    if not answers:  # a notebook without otter's tags (a solution, one rebuilt by hand):
        answers = [i for i, c in enumerate(nb.cells)  # the cells that define the piece
                   if c.cell_type == "code" and _defines(c.source, cell.names)]
    source = "\n\n".join(nb.cells[i].source for i in answers)
    sub = Submission(lab, source, answers)
    if not answers:
        sub.violations.append(Violation(0, f"no graded cell (the code cell tagged {ANSWER_TAG!r} "
                                           f"as the lab shipped it, or one defining "
                                           f"{', '.join(cell.names)}): write your code there"))
    else:
        sub.violations += check_cell(source, cell)
    imported = set().union(*(minserve_names(c.source) for c in nb.cells if c.cell_type == "code"))
    for i, c in enumerate(nb.cells):
        if c.cell_type != "code" or i in answers:
            continue
        if shipped is not None and hashlib.sha256(c.source.encode()).hexdigest() in shipped:
            continue
        if OTTER_INIT.fullmatch(c.source.strip()):  # otter's own first cell, as assign writes it
            continue
        sub.attempts += [f"cell {i}: {v}" for v in scan_other_cell(c.source, imported)]
    return sub


def _defines(source: str, names) -> bool:
    """Whether a cell defines one of `names` at its top level."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names
               for n in tree.body)


# ------------------------------------------------------------------ the fresh process
def warm(lab: str) -> None:
    """Import what grading a lab needs (its checks, otter's test runner, Hypothesis) and
    build the tiny model in this process, so each forked grading process starts with them.
    With one torch thread: no OpenMP thread pool exists yet, so a fork stays safe."""
    lab_module(lab)
    for name in ("otter.test_files", "hypothesis", "minserve.labs.differential"):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    import torch

    from .common import tiny_model

    torch.set_num_threads(1)
    tiny_model()


def _child(write_fd: int, workdir: str, source: str, lab: str, tests_dir: str, seed: int,
           scale: float, shrink: bool) -> None:
    """The grading process, in `workdir` (the parent's, which it removes): the checks and
    the tests first, then the graded cell alone, then every test; the results as JSON on
    write_fd. Never returns."""
    code = 0
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # what the submission prints goes nowhere
        os.dup2(devnull, 2)
        with contextlib.suppress(ValueError, OSError):
            import resource

            resource.setrlimit(resource.RLIMIT_CPU, (600, 600))
        os.chdir(workdir)
        results = run_tests_on(source, lab, tests_dir, seed, scale, shrink)
        payload = json.dumps(results).encode()
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        payload = json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()
        code = 1
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(write_fd, view):]
    finally:
        os._exit(code)


def run_tests_on(source: str, lab: str, tests_dir: str, seed: int, scale: float,
                 shrink: bool = True) -> list:
    """In the grading process: load the checks and every test file, then run the graded
    cell in a namespace of its own, then the tests against its pieces and `lab_hidden`.
    Returns [(test file name, [(case name, passed, message)])]."""
    from otter.test_files import ExceptionTestFile

    from .common import LabCheckFailed, describe_crash, time_limit
    from .differential import Hidden

    module = lab_module(lab)
    cell = module.CELL
    files = [ExceptionTestFile.from_file(str(p)) for p in sorted(Path(tests_dir).glob("*.py"))]
    allowed = set(cell.imports) | set(cell.module_imports) | set(_stdlib())
    env: dict[str, Any] = {"__builtins__": safe_builtins(allowed), "__name__": "submission",
                           **cell.provided()}
    error = None
    try:
        with time_limit(20, "the graded cell", "the graded cell's top level"):
            exec(compile(source, f"<the graded cell of {lab}>", "exec"), env)  # noqa: S102
    except LabCheckFailed as e:
        error = f"LabCheckFailed: {e}"
    except BaseException as e:  # noqa: BLE001 - said in every test's message
        error = (f"LabCheckFailed: the graded cell raised {describe_crash(e, 'the graded cell')}"
                 "\n    where to look: the graded cell (grading runs it alone: what it uses "
                 "must be defined in it)")
    missing = [n for n in cell.names if n not in env]
    if error is None and missing:
        error = (f"LabCheckFailed: the graded cell does not define {', '.join(missing)}"
                 "\n    where to look: the graded cell")
    test_env = {n: env.get(n) for n in cell.names}
    test_env["lab_hidden"] = Hidden(seed, scale, shrink)
    out = []
    for tf in files:
        if error is not None:
            out.append((tf.name, [(tc.name, False, f"❌ Test case failed\n{error}")
                                  for tc in tf.test_cases]))
            continue
        tf.run(test_env)
        out.append((tf.name, [(r.test_case.name, bool(r.passed), str(r.message))
                              for r in tf.test_case_results]))
    return out


def _stdlib() -> list[str]:
    from .allowlist import ALLOWED_MODULES

    return list(ALLOWED_MODULES)


@dataclass
class Job:
    """A grading process started by `start`; `wait` returns its results."""

    pid: int
    read_fd: int
    started: float
    timeout_s: float
    workdir: str  # the process's working folder (what a submission writes lands here)

    def wait(self) -> list | dict:
        chunks, deadline = [], self.started + self.timeout_s
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.pid, signal.SIGKILL)
                    return {"error": f"grading did not finish within {self.timeout_s:g} s"}
                ready, _, _ = select.select([self.read_fd], [], [], min(left, 1.0))
                if ready:
                    data = os.read(self.read_fd, 1 << 16)
                    if not data:
                        break
                    chunks.append(data)
        finally:
            os.close(self.read_fd)
            with contextlib.suppress(ChildProcessError):
                _, status = os.waitpid(self.pid, 0)
            # The child ends with os._exit (no cleanup runs there): its folder goes here,
            # once it is dead, or a term of grading leaves a folder per submission in /tmp.
            shutil.rmtree(self.workdir, ignore_errors=True)
        try:
            return json.loads(b"".join(chunks).decode())
        except ValueError:
            return {"error": "the grading process ended without results (it was killed, or "
                             "ran out of time or memory)"}


def start(source: str, lab: str, tests_dir: Path, seed: int, scale: float = 1.0,
          timeout_s: float = 300, shrink: bool = True) -> Job:
    """Fork the grading process for a graded cell; returns at once. `scale` and `shrink`:
    the hidden checks' share of their sequences and whether a failure is shrunk (both
    as grading has them by default; `make test` builds with less)."""
    workdir = tempfile.mkdtemp(prefix="lab-grading-")
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read_fd)
        _child(write_fd, workdir, source, lab, str(tests_dir), seed, scale, shrink)
    os.close(write_fd)
    return Job(pid, read_fd, time.monotonic(), timeout_s, workdir)


# ------------------------------------------------------------------ one submission
@dataclass
class Graded:
    """One submission's grade: per test file (question) the cases (name, passed, message),
    and what a person should look at (similarity to the engine's code)."""

    lab: str
    questions: dict[str, list[tuple[str, bool, str]]]
    refused: str | None = None
    similarity: dict | None = None
    error: str | None = None
    seconds: float = 0.0


def finish(sub: Submission, tests_dir: Path, job: Job | None, similarity: dict | None,
           t0: float) -> Graded:
    """Turn a grading process's answer (or a refusal) into a Graded."""
    from otter.test_files import ExceptionTestFile

    files = [ExceptionTestFile.from_file(str(p)) for p in sorted(Path(tests_dir).glob("*.py"))]
    questions: dict[str, list] = {}
    error = None
    if sub.refused or job is None:
        why = sub.refused or "not graded"
        questions = {tf.name: [(tc.name, False, f"❌ Test case failed\n{why}")
                               for tc in tf.test_cases] for tf in files}
    else:
        got = job.wait()
        if isinstance(got, dict):  # the process failed: every case fails, saying why
            error = got["error"]
            questions = {tf.name: [(tc.name, False, f"❌ Test case failed\nLabCheckFailed: "
                                                    f"grading did not finish: {error}\n"
                                                    "    where to look: the graded cell (a loop "
                                                    "that never ends? memory?)")
                                   for tc in tf.test_cases] for tf in files}
        else:
            questions = {name: [tuple(c) for c in cases] for name, cases in got}
    return Graded(sub.lab, questions, sub.refused, similarity, error,
                  round(time.monotonic() - t0, 2))


def grade_notebook(path: Path, tests_dir: Path, seed: int, lab: str | None = None,
                   scale: float = 1.0, shipped: set[str] | None = None,
                   timeout_s: float = 300, shrink: bool = True) -> Graded:
    """Grade one submitted notebook file against a tests folder: read it, check it, run
    it in a fresh process (unless refused), compare it with the engine's code."""
    from .similarity import similarity_report

    t0 = time.monotonic()
    sub = read_submission(Path(path), lab, shipped)
    job = None if sub.refused else start(sub.source, sub.lab, tests_dir, seed, scale, timeout_s,
                                         shrink)
    return finish(sub, tests_dir, job, similarity_report(sub.lab, sub.source), t0)


def test_files_with_results(tests_dir: Path, graded: Graded) -> list:
    """otter's TestFile objects of tests_dir (read here, in the trusted process), each case's
    result set from `graded`: what otter's results and Gradescope's JSON are made of."""
    from otter.test_files import ExceptionTestFile
    from otter.test_files.abstract_test import TestCaseResult

    files = []
    for p in sorted(Path(tests_dir).glob("*.py")):
        tf = ExceptionTestFile.from_file(str(p))
        cases = {name: (ok, msg) for name, ok, msg in graded.questions.get(tf.name, [])}
        tf.test_case_results = [
            TestCaseResult(test_case=tc, passed=cases.get(tc.name, (False, ""))[0],
                           message=cases.get(tc.name, (False, "❌ Test case failed\nnot run"))[1])
            for tc in tf.test_cases]
        files.append(tf)
    return files
