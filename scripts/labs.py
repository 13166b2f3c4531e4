"""`make labs` and `make lab-check`: the classroom labs, built and proven by otter-grader.

    python scripts/labs.py build [--secret S] [OUT]   # otter assign every lab -> OUT
                                         # (hidden inputs from S or $MINSERVE_LAB_SECRET)
    python scripts/labs.py check [OUT]   # build, then prove every lab's checks are real
    python scripts/labs.py grade ZIP SUBMISSION...   # `otter run`, many submissions, one process
    python scripts/labs.py corpus [OUT] [-j N]       # solutions + tests/lab_corpus through otter run

One source notebook per lab (`notebooks/labs/`) carries otter-assign's markers; `otter
assign` makes, per lab, `OUT/<lab>/student/` (stubs, public tests) and
`OUT/<lab>/autograder/` (the solution, every test including the hidden ones, and the
autograder zip that `otter run` and Gradescope take). OUT defaults to `build/labs`
(git-ignored).

`make lab-check` (tests/test_labs.py) grades as a teacher will: every lab's solution and
every typical wrong submission of tests/lab_corpus/<lab>/ (the student version with its
graded cell replaced) goes through `otter run` with the lab's autograder zip, in a fresh
kernel each; `grade_corpus` splits them over two processes, each calling otter run's own
function for one submission after another (otter's imports are paid once per process,
the kernel's per submission, as in a grading container). `make test` puts only the
solutions and one wrong submission per lab through `otter run`, and the whole corpus
through `grade_forked` (the same tests and test runner, a fork instead of a kernel).
`check` is the quick in-process
variant: the notebook's code runs top to bottom here (a cell that raises is recorded and
the run goes on), then otter's own test-file runner (`otter.test_files.ExceptionTestFile`)
runs each test against the resulting namespace; the test suite still uses it for the
student versions, stubs as shipped.
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
CORPUS = ROOT / "tests" / "lab_corpus"
SHIMS = ROOT / "scripts" / "grading_shims"  # see its one module: a 2 s import per kernel
DEFAULT_OUT = ROOT / "build" / "labs"


def lab_sources() -> list[Path]:
    return sorted(SOURCES.glob("lab*.ipynb"))


# The hidden tests' placeholder for the instructor's secret (docs/teaching.md, "What is and
# is not secret"): `build` writes the secret in its place, in the autograder's tests only.
SECRET_MARK = '"__LAB_SECRET__"'
SECRET_ENV = "MINSERVE_LAB_SECRET"


def with_secret(src: Path, secret: str, dest_dir: Path) -> Path:
    """A copy of the source notebook whose hidden tests carry `secret` instead of the
    placeholder (the student version has no hidden test, so it never holds it)."""
    import json

    text = src.read_text().replace(json.dumps(SECRET_MARK)[1:-1],  # as the .ipynb's JSON holds it
                                   json.dumps(json.dumps(secret))[1:-1])
    dest_dir.mkdir(parents=True, exist_ok=True)
    copy = dest_dir / src.name
    copy.write_text(text)
    return copy


def build(out: Path = DEFAULT_OUT, labs: list[Path] | None = None,
          secret: str | None = None) -> dict[str, Path]:
    """otter assign each lab into out/<lab>/ (student/ and autograder/). Returns lab -> dir.

    secret: the instructor's secret, from which the hidden tests draw their inputs (default:
    $MINSERVE_LAB_SECRET; without either, the placeholder itself, i.e. the public inputs)."""
    import tempfile

    from otter.assign import main as assign

    secret = secret if secret is not None else os.environ.get(SECRET_ENV) or None
    built = {}
    with tempfile.TemporaryDirectory(prefix="lab-src-") as tmp:
        for src in labs or lab_sources():
            dest = out / src.stem
            nb = with_secret(src, secret, Path(tmp) / src.stem) if secret else src
            with contextlib.redirect_stdout(io.StringIO()):
                assign(str(nb), str(dest), no_pdfs=True, no_run_tests=True)
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


def run_tests(env: dict, tests_dir: Path) -> list:
    """Every test file of tests_dir run by otter's own runner against `env`, in name order:
    otter's TestFile objects (per case `test_case_results`; `score`, `possible`)."""
    from otter.test_files import ExceptionTestFile

    files = [ExceptionTestFile.from_file(str(p)) for p in sorted(tests_dir.glob("*.py"))]
    for tf in files:
        tf.run(env)
    return files


def grade(notebook: Path, tests_dir: Path) -> Graded:
    """Run the notebook, then every test file of tests_dir against its namespace."""
    t0 = time.perf_counter()
    env, errors = run_notebook(notebook)
    g = Graded(notebook, 0.0, errors)
    for tf in run_tests(env, tests_dir):
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


# ------------------------------------------------------------------ grading with `otter run`
@dataclass
class Mistake:
    """One submission of tests/lab_corpus/<lab>/<name>.py: the graded cell as a student
    wrote it. A typical wrong one has `# mistake:` and `# expect:` lines (what the grader's
    messages must say); a correct one written otherwise than the solution has a
    `# correct:` line and must score full marks (the corpus tests false failures too)."""

    lab: str
    name: str
    code: str

    @property
    def expect(self) -> list[str]:
        return [line.split(":", 1)[1].strip() for line in self.code.splitlines()
                if line.startswith("# expect:")]

    @property
    def correct(self) -> bool:
        return any(line.startswith("# correct:") for line in self.code.splitlines())

    @property
    def what(self) -> str:
        return next((line.split(":", 1)[1].strip() for line in self.code.splitlines()
                     if line.startswith(("# mistake:", "# correct:"))), self.name)


def corpus(lab: str | None = None) -> list[Mistake]:
    return [Mistake(p.parent.name, p.stem, p.read_text())
            for p in sorted(CORPUS.glob(f"{lab or 'lab*'}/*.py"))]


def graded_cell(nb) -> int:
    """The student version's graded code cell: the one whose stubs raise NotImplementedError."""
    hits = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
            and "NotImplementedError" in c.source and not c.source.startswith("def test_")]
    if len(hits) != 1:
        raise ValueError(f"expected one graded cell with stubs, found cells {hits}")
    return hits[0]


def write_submission(student_nb: Path, code: str, dest: Path) -> Path:
    """The student version with its graded cell replaced by `code`: what a student hands in."""
    import nbformat

    nb = nbformat.read(student_nb, as_version=4)
    nb.cells[graded_cell(nb)].source = code
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / student_nb.name
    nbformat.write(nb, path)
    return path


def otter_run(zip_path: Path, submission: Path) -> dict:
    """`otter run -a ZIP SUBMISSION` (the CLI's own function, `otter.run.main`): the notebook
    runs in a fresh kernel, then every test, hidden ones too. Returns, per question,
    score, possible and the messages of its failed cases; plus the seconds it took."""
    import resource

    from otter.run import main as run

    def cpu() -> float:  # this process and its reaped children (the kernel)
        return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                      resource.getrusage(resource.RUSAGE_CHILDREN)))

    t0, c0 = time.perf_counter(), cpu()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        results = run(str(submission), autograder=str(zip_path), output_dir=None, no_logo=True)
    out = {"seconds": round(time.perf_counter() - t0, 1), "cpu_seconds": round(cpu() - c0, 1),
           "questions": {}}
    for name, tf in results.results.items():
        out["questions"][name] = {
            "score": tf.score, "possible": tf.possible,
            "failed": [r.message for r in tf.test_case_results if not r.passed]}
    return out


def autograder_zip(lab_dir: Path) -> Path:
    return next((lab_dir / "autograder").glob("*-autograder_*.zip"))


def grade_many(jobs: list[tuple[str, str, str]]) -> list[dict]:
    """jobs: (label, zip, submission). One `otter run` after another in this process (each
    in its own fresh kernel): otter's own imports are paid once."""
    return [{"label": label, **otter_run(Path(z), Path(sub))} for label, z, sub in jobs]


def _graded(notebook: str, tests_dir: str) -> dict:
    """`grade`'s result in `otter_run`'s shape: per question (test file) otter's own score,
    possible and the messages of the failed cases (`otter.test_files`' TestFile)."""
    t0, c0 = time.perf_counter(), time.process_time()
    env, errors = run_notebook(Path(notebook))
    out = {"seconds": 0.0, "cpu_seconds": 0.0, "cell_errors": errors, "questions": {}}
    for tf in run_tests(env, Path(tests_dir)):
        out["questions"][tf.name] = {
            "score": tf.score, "possible": tf.possible,
            "failed": [r.message for r in tf.test_case_results if not r.passed]}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out["cpu_seconds"] = round(time.process_time() - c0, 1)
    return out


def grade_forked(jobs: list[tuple[str, str, str]], timeout_s: float = 300) -> list[dict]:
    """jobs: (label, tests folder, submission). Each submission runs in a process of its
    own, forked from this one, then otter's test-file runner runs every test of the
    folder (the hidden ones too) against what its cells left: a fresh process per
    submission like `otter run`'s fresh kernel, without its kernel start and imports
    (about 3 of its 4 s of CPU). This process has imported what grading needs and run no
    torch operator, so the forks are safe (OpenMP's threads do not survive a fork)."""
    import importlib
    import multiprocessing as mp

    # imported once here, inherited by every fork: the labs' checks, and transformers'
    # Llama (the tiny engine's model; about 2 s of CPU to import)
    for module in ("nbformat", "otter.test_files", "transformers.models.llama.modeling_llama",
                   *(f"minserve.labs.{p.stem}" for p in (ROOT / "minserve" / "labs").glob("*.py"))):
        importlib.import_module(module)

    out = []
    with mp.get_context("fork").Pool(1, maxtasksperchild=1) as pool:
        for label, tests_dir, sub in jobs:
            res = pool.apply_async(_graded, (sub, tests_dir)).get(timeout_s)
            out.append({"label": label, "runner": "forked", **res})
    return out


def grade_corpus(built: dict[str, Path], work: Path, labs: list[str] | None = None,
                 workers: int = 2, otter_all: bool = True) -> dict[str, dict]:
    """Every lab's solution (the autograder's notebook) and every corpus submission, graded
    over `workers` processes. Returns label -> result, with labels "<lab>/solution" and
    "<lab>/<mistake>", and each result's "runner".

    otter_all: every one through `otter run` (`make lab-check`, `labs.py corpus`).
    Otherwise (`make test`) the solutions and each lab's first wrong submission go
    through `otter run`, and every submission, those too, through `grade_forked`: same
    tests, same runner of them, a fork instead of a kernel. Where both graded one, its
    result says what the fork gave under "forked", for the test that the two agree."""
    import json
    import subprocess

    jobs = []  # (kind, label, zip or tests folder, submission)
    for lab, d in built.items():
        if labs and lab not in labs:
            continue
        z, tests = autograder_zip(d), d / "autograder" / "tests"
        written = corpus(lab)
        subs = [(f"{lab}/solution", d / "autograder" / f"{lab}.ipynb")]
        for m in written:
            subs.append((f"{lab}/{m.name}",
                         write_submission(d / "student" / f"{lab}.ipynb", m.code, work / lab / m.name)))
        first_wrong = next(m.name for m in written if not m.correct)
        for label, sub in subs:
            if otter_all or label.endswith(("/solution", f"/{first_wrong}")):
                jobs.append(("otter", label, str(z), str(sub)))
            if not otter_all:
                jobs.append(("forked", label, str(tests), str(sub)))
    # the forks first in each process (before any kernel's threads), the longest first
    jobs.sort(key=lambda j: (j[0] == "otter", "capstone" not in j[1]))
    shards = [jobs[i::workers] for i in range(workers)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(SHIMS), os.environ.get("PYTHONPATH", "")) if p)}
    procs = []
    for i, shard in enumerate(shards):
        spec = work / f"jobs{i}.json"
        spec.write_text(json.dumps(shard))
        procs.append(subprocess.Popen([sys.executable, __file__, "grade-jobs", str(spec)],
                                      stdout=subprocess.PIPE, text=True, cwd=work, env=env))
    results: dict[str, dict] = {}
    forked: dict[str, dict] = {}
    for p in procs:
        out, _ = p.communicate(timeout=1200)
        if p.returncode:
            raise RuntimeError(f"a grading process failed ({p.returncode}): {out[-2000:]}")
        for r in json.loads(out.splitlines()[-1]):
            (forked if r["runner"] == "forked" else results)[r["label"]] = r
    for label, r in forked.items():
        if label in results:
            results[label]["forked"] = r
        else:
            results[label] = r
    return results


def grade_jobs(jobs: list[list[str]]) -> list[dict]:
    """One grading process of `grade_corpus`: its forked jobs, then its `otter run`s."""
    forked = grade_forked([(label, a, sub) for kind, label, a, sub in jobs if kind == "forked"])
    ran = [{"runner": "otter run", **r} for r in
           grade_many([(label, a, sub) for kind, label, a, sub in jobs if kind == "otter"])]
    return forked + ran


def corpus_report(results: dict[str, dict]) -> str:
    lines = ["| submission | score | graded by | seconds | CPU (s) | first message |",
             "|---|---|---|---|---|---|"]
    for label in sorted(results):
        r = results[label]
        score = sum(q["score"] for q in r["questions"].values())
        possible = sum(q["possible"] for q in r["questions"].values())
        msgs = [m for q in r["questions"].values() for m in q["failed"]]
        first = ""
        if msgs:
            first = next((ln.strip() for ln in msgs[0].splitlines() if "LabCheckFailed" in ln),
                         msgs[0].strip().splitlines()[-1])[:110]
        lines.append(f"| {label} | {score:g} / {possible:g} | {r.get('runner', 'otter run')} | "
                     f"{r['seconds']} | "
                     f"{r.get('cpu_seconds', '')} | {first} |")
    return "\n".join(lines)


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else "build"
    if cmd == "grade-jobs":  # internal: one grading process of grade_corpus
        import json

        print(json.dumps(grade_jobs(json.loads(Path(sys.argv[2]).read_text()))))
        sys.exit(0)
    if cmd == "grade":
        import json

        zip_path = sys.argv[2]
        for r in grade_many([(s, zip_path, s) for s in sys.argv[3:]]):
            print(json.dumps(r))
        sys.exit(0)
    if cmd == "corpus":
        import tempfile

        args = [a for a in sys.argv[2:] if not a.startswith("-j")]
        workers = int(next((a[2:] for a in sys.argv[2:] if a.startswith("-j")), "2"))
        out = Path(args[0]) if args else DEFAULT_OUT
        t0 = time.perf_counter()
        built = build(out)
        results = grade_corpus(built, Path(tempfile.mkdtemp(prefix="lab-corpus-")), workers=workers)
        print(corpus_report(results))
        print(f"{len(results)} submissions in {time.perf_counter() - t0:.0f} s with {workers} processes")
        sys.exit(0)
    rest, secret = sys.argv[2:], None
    if "--secret" in rest:  # build --secret S [OUT]: the hidden tests' inputs from S
        i = rest.index("--secret")
        if i + 1 >= len(rest):
            sys.exit("--secret needs a value")
        secret, rest = rest[i + 1], rest[:i] + rest[i + 2:]
    out = Path(rest[0]) if rest else DEFAULT_OUT
    if cmd == "build":
        for lab, d in build(out, secret=secret).items():
            print(f"{lab}: {d / 'student'}  {d / 'autograder'}")
        if not (secret or os.environ.get(SECRET_ENV)):
            print(f"no secret (--secret or ${SECRET_ENV}): the hidden tests use the public "
                  "inputs; see docs/teaching.md, 'What is and is not secret'")
    elif cmd == "check":
        sys.exit(check(out))
    else:
        sys.exit(f"usage: {sys.argv[0]} build|check [OUT]")
