"""The labs' otter plugin: grading.py in otter's own flow (SPEC L2, L3).

Each lab's autograder zip names this plugin in its otter_config.json, with the lab and
(`scripts/labs.py build --secret`) the instructor's secret:

    "plugins": [{"minserve.labs.otter_plugin.LabGrader":
                 {"lab": "lab1_fcfs", "secret": "...", "shipped": [sha256 of each code
                  cell of the student version, which the scan of other cells skips]}}]

`otter run`, `otter grade` and Gradescope call it at fixed points:

    before_grading    read the submitted notebook file; check its graded cell; move the
                      tests out of the kernel's folder; fork the grading process (it runs
                      while otter starts its kernel)
    before_execution  the notebook otter's kernel runs: no cell of the submission at all
    after_grading     the grading process's results replace the kernel's (none: it ran no
                      test); what a person should look at goes to the results' output
    generate_report   the same, printed after the score

The kernel thus runs only otter's own init and export cells: nothing of the submission
runs in a process that can touch the results. The secret stays in this process: the
grading process gets `seed_of(secret, lab)`, and no message quotes either.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from pathlib import Path

from otter.plugins import AbstractOtterPlugin

from . import grading
from .differential import seed_of
from .similarity import similarity_report

PUBLIC_SECRET = "__LAB_SECRET__"  # no secret given: inputs anyone can reproduce
NAME = "minserve.labs.otter_plugin.LabGrader"


class LabGrader(AbstractOtterPlugin):
    """Grades a lab submission outside otter's kernel (module docstring)."""

    def before_grading(self, config) -> None:
        cfg = self.plugin_config or {}
        self.t0 = time.monotonic()
        self.lab = cfg.get("lab")
        self.job = self.sub = self.similarity = None
        self.error = None
        # the tests leave the folder the kernel runs in: it must not run them
        self.tests = Path(tempfile.mkdtemp(prefix="lab-tests-"))
        for p in sorted(Path("tests").glob("*.py")):
            shutil.copy(p, self.tests / p.name)
            p.unlink()
        try:
            self.sub = grading.read_submission(Path(self.submission_path), self.lab,
                                               set(cfg.get("shipped", [])))
            self.similarity = similarity_report(self.sub.lab, self.sub.source)
            if not self.sub.refused:
                seed = seed_of(cfg.get("secret") or PUBLIC_SECRET, self.sub.lab)
                self.job = grading.start(self.sub.source, self.sub.lab, self.tests, seed,
                                         float(cfg.get("scale", 1.0)),
                                         float(cfg.get("timeout_s", 300)),
                                         bool(cfg.get("shrink", True)))
        except Exception as e:  # noqa: BLE001 - reported in every case's message
            self.error = f"the grader could not read this submission: {type(e).__name__}: {e}"

    def before_execution(self, submission):
        import nbformat

        if isinstance(submission, str):
            return ""
        return nbformat.v4.new_notebook(metadata=submission.get("metadata", {}))

    def after_grading(self, results) -> None:
        if self.error is not None or self.sub is None:
            graded = _failed(self.tests, self.error or "the grader did not run")
        else:
            graded = grading.finish(self.sub, self.tests, self.job, self.similarity, self.t0)
        files = grading.test_files_with_results(self.tests, graded)
        results.clear_results()
        results.results = {tf.name: tf for tf in files}
        self.report = report(graded)
        results.set_output(self.report)
        results.set_plugin_data(NAME, {"similarity": graded.similarity, "refused": graded.refused,
                                       "error": graded.error, "seconds": graded.seconds})
        with contextlib.suppress(OSError):
            shutil.rmtree(self.tests)

    def generate_report(self) -> str:
        return getattr(self, "report", "")


def _failed(tests: Path, why: str) -> grading.Graded:
    from otter.test_files import ExceptionTestFile

    files = [ExceptionTestFile.from_file(str(p)) for p in sorted(tests.glob("*.py"))]
    return grading.Graded("?", {tf.name: [(tc.name, False, f"❌ Test case failed\n{why}")
                                          for tc in tf.test_cases] for tf in files}, error=why)


def report(graded: grading.Graded) -> str:
    """What a person should read beside the score: a refusal, a failed grading process,
    the similarity to the engine's own code."""
    lines = []
    if graded.refused:
        lines.append(f"Refused: {graded.refused}")
    if graded.error:
        lines.append(f"Grading failed: {graded.error}")
    s = graded.similarity
    if s:
        verdict = ("FLAGGED: a person should compare it with the engine's code" if s["flagged"]
                   else "below the flag" if s["threshold"] is not None
                   else "measured, not flagged for this lab")
        lines.append(f"Similarity of the graded cell to the engine's {s['of']}: {s['share']:.2f} "
                     f"({verdict}; threshold "
                     f"{'none' if s['threshold'] is None else format(s['threshold'], 'g')})")
    return "\n".join(lines)
