"""`make labs` and `make lab-check`: the classroom labs, built and proven by otter-grader.

    python scripts/labs.py build [OUT]   # otter assign every notebooks/labs/lab*.ipynb -> OUT
    python scripts/labs.py check [OUT]   # build, then prove every lab's checks are real

One source notebook per lab (`notebooks/labs/`) carries otter-assign's markers; `otter
assign` makes, per lab, `OUT/<lab>/student/` (stubs, public tests) and
`OUT/<lab>/autograder/` (the solution, every test including the hidden ones, and the
autograder zip that `otter run` and Gradescope take). OUT defaults to `build/labs`
(git-ignored).

The check, for every lab: the solution notebook passes every test (hidden ones too), and
the student notebook, stubs as shipped, fails every test with a message. Both are graded
the way otter grades: the notebook's code runs top to bottom (a cell that raises is
recorded and the run goes on), then otter's own test-file runner
(`otter.test_files.ExceptionTestFile`) runs each test against the resulting namespace.
The notebooks run in this process, one after the other, so torch is imported once
(`otter run` does the same per notebook in a fresh kernel: about 20 s each here).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "notebooks" / "labs"
DEFAULT_OUT = ROOT / "build" / "labs"


def lab_sources() -> list[Path]:
    return sorted(SOURCES.glob("lab*.ipynb"))


def build(out: Path = DEFAULT_OUT, labs: list[Path] | None = None) -> dict[str, Path]:
    """otter assign each lab into out/<lab>/ (student/ and autograder/). Returns lab -> dir."""
    from otter.assign import main as assign

    built = {}
    for src in labs or lab_sources():
        dest = out / src.stem
        with contextlib.redirect_stdout(io.StringIO()):
            assign(str(src), str(dest), no_pdfs=True, no_run_tests=True)
        built[src.stem] = dest
    return built


@dataclass
class Graded:
    """One notebook graded against one tests folder."""

    notebook: Path
    seconds: float
    cell_errors: list[str] = field(default_factory=list)  # "cell N: Type: message"
    results: dict[str, list[tuple[bool, str]]] = field(default_factory=dict)  # test file -> cases

    @property
    def cases(self) -> list[tuple[str, bool, str]]:
        return [(name, ok, msg) for name, rs in self.results.items() for ok, msg in rs]


def run_notebook(path: Path) -> tuple[dict, list[str]]:
    """Run a generated notebook's code cells in order in a fresh namespace, in its folder,
    skipping otter's own cells (the init cell and `grader.check`); a cell that raises is
    recorded and the run goes on, as a kernel run with errors allowed does."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    env: dict = {"__name__": "__main__"}
    errors = []
    cwd = os.getcwd()
    os.chdir(path.parent)
    try:
        for i, cell in enumerate(nb.cells):
            src = cell.source
            if cell.cell_type != "code" or src.startswith("# Initialize Otter") \
                    or src.lstrip().startswith("grader.check"):
                continue
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    exec(compile(src, f"{path.name} cell {i}", "exec"), env)
            except Exception as e:  # noqa: BLE001 - recorded, as a kernel would show it
                errors.append(f"cell {i}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    finally:
        os.chdir(cwd)
    return env, errors


def grade(notebook: Path, tests_dir: Path) -> Graded:
    """Run the notebook, then every test file of tests_dir against its namespace."""
    from otter.test_files import ExceptionTestFile

    t0 = time.perf_counter()
    env, errors = run_notebook(notebook)
    g = Graded(notebook, 0.0, errors)
    for test_file in sorted(tests_dir.glob("*.py")):
        tf = ExceptionTestFile.from_file(str(test_file))
        tf.run(env)
        g.results[tf.name] = [(r.passed, r.message) for r in tf.test_case_results]
    g.seconds = time.perf_counter() - t0
    return g


def check(out: Path = DEFAULT_OUT) -> int:
    """Build, then: every solution passes all its tests; every student version fails all."""
    t0 = time.perf_counter()
    built = build(out)
    print(f"built {len(built)} labs into {out} in {time.perf_counter() - t0:.1f} s")
    bad = 0
    for lab, d in built.items():
        sol = grade(d / "autograder" / f"{lab}.ipynb", d / "autograder" / "tests")
        stu = grade(d / "student" / f"{lab}.ipynb", d / "autograder" / "tests")
        sol_ok = all(ok for _, ok, _ in sol.cases) and not sol.cell_errors
        stu_ok = stu.cases and not any(ok for _, ok, _ in stu.cases)
        bad += not (sol_ok and stu_ok)
        print(f"{lab}: solution {sum(ok for _, ok, _ in sol.cases)}/{len(sol.cases)} tests pass "
              f"({sol.seconds:.1f} s); student version {sum(not ok for _, ok, _ in stu.cases)}/"
              f"{len(stu.cases)} fail ({stu.seconds:.1f} s)" + ("" if sol_ok and stu_ok else "  <-- WRONG"))
        for e in sol.cell_errors:
            print("   solution cell raised:", e)
        for _name, ok, msg in sol.cases if not sol_ok else stu.cases[:1]:
            if not sol_ok and ok:
                continue
            print("   " + msg.replace("\n", "\n   "))
    return 1 if bad else 0


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else "build"
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT_OUT
    if cmd == "build":
        for lab, d in build(out).items():
            print(f"{lab}: {d / 'student'}  {d / 'autograder'}")
    elif cmd == "check":
        sys.exit(check(out))
    else:
        sys.exit(f"usage: {sys.argv[0]} build|check [OUT]")
