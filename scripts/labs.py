"""`make labs` and `make lab-check`: the classroom labs, built and proven by otter-grader.

    python scripts/labs.py build [--secret S | --public] [OUT]   # otter assign every lab -> OUT
    python scripts/labs.py check [OUT]   # build, then prove every lab's checks are real
    python scripts/labs.py grade ZIP SUBMISSION...   # `otter run`, many submissions, one process
    python scripts/labs.py corpus [OUT] [-j N]       # solutions + tests/lab_corpus through otter run
    python scripts/labs.py detection [SECRETS] [LAB] [--write]  # each corpus case, many secrets
    python scripts/labs.py timing [OUT] [--write]   # docs/teaching.md's grading command, timed

One source notebook per lab (`notebooks/labs/`) carries otter-assign's markers; `otter
assign` makes, per lab, `OUT/<lab>/student/` (stubs, public tests) and
`OUT/<lab>/autograder/` (the solution, every test including the hidden ones, and the
autograder zip that `otter run` and Gradescope take). OUT defaults to `build/labs`
(git-ignored). `build` then seals each autograder: its otter_config.json (in the folder and
in the zip) names the labs' grading plugin (`minserve/labs/otter_plugin.py`) with the lab,
the instructor's secret and the hashes of the student version's own code cells.

The secret. `--secret S` or $MINSERVE_LAB_SECRET; without either, a rebuild keeps the
secret the existing build in OUT was sealed with (and says so): `make labs` after a
secret build never falls back to the public inputs silently. `--public` builds with the
public placeholder on purpose.

Grading. The plugin grades outside otter's kernel (minserve/labs/grading.py): the graded
cell alone, checked by an allow-list, in a fresh process that loaded the checks first.
`grade_corpus` puts the corpus through it in two ways: `otter run` (the plugin, as a
teacher grades; `make lab-check`: every submission), and the same grading functions called
directly in a grading process that imported the checks once and forks per submission
(`make test`: every submission this way, the solutions and one wrong submission per lab
through `otter run` as well; a test checks the two agree).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "notebooks" / "labs"
CORPUS = ROOT / "tests" / "lab_corpus"
SHIMS = ROOT / "scripts" / "grading_shims"  # see its one module: a 2 s import per kernel
DEFAULT_OUT = ROOT / "build" / "labs"
SECRET_ENV = "MINSERVE_LAB_SECRET"
PUBLIC_SECRET = "__LAB_SECRET__"  # the placeholder: inputs anyone can reproduce
PLUGIN = "minserve.labs.otter_plugin.LabGrader"
EXTRA_CELL = "# --- another cell ---"  # a corpus file's cells after the graded one


def lab_sources() -> list[Path]:
    return sorted(SOURCES.glob("lab*.ipynb"))


# ------------------------------------------------------------------ build and seal
def plugin_config(config: dict) -> dict | None:
    """The labs' plugin's entry in an otter_config.json (None if it has none)."""
    for entry in config.get("plugins", []):
        if isinstance(entry, dict) and PLUGIN in entry:
            return entry[PLUGIN]
    return None


def built_secret(lab_dir: Path) -> str | None:
    """The secret an existing build of a lab was sealed with, if any."""
    path = lab_dir / "autograder" / "otter_config.json"
    if not path.exists():
        return None
    cfg = plugin_config(json.loads(path.read_text())) or {}
    return cfg.get("secret")


def shipped_cells(student_nb: Path) -> list[str]:
    """sha256 of each code cell of the student version as shipped: cells grading does not
    scan for attempts on the grader (otter's init cell, the lab's imports, its demos)."""
    nb = json.loads(student_nb.read_text())
    return sorted({hashlib.sha256("".join(c["source"]).encode()).hexdigest()
                   for c in nb["cells"] if c["cell_type"] == "code"})


def seal(lab_dir: Path, secret: str | None, scale: float = 1.0) -> None:
    """Write the plugin's configuration (lab, secret, shipped cells) into the autograder's
    otter_config.json and into the copy inside its zip (what `otter run` reads). `scale`
    (1 when grading) multiplies the hidden checks' number of random sequences."""
    lab = lab_dir.name
    shipped = shipped_cells(lab_dir / "student" / f"{lab}.ipynb")

    def sealed(text: str) -> str:
        config = json.loads(text)
        entry = plugin_config(config)
        if entry is None:
            raise ValueError(f"{lab}: its ASSIGNMENT CONFIG names no plugin {PLUGIN}")
        entry.update({"lab": lab, "shipped": shipped})
        entry.pop("secret", None)
        entry.pop("scale", None)
        entry.pop("shrink", None)
        if scale != 1.0:  # make test: fewer sequences, a failure shown as found (not shrunk)
            entry["scale"], entry["shrink"] = scale, False
        if secret is not None:
            entry["secret"] = secret
        return json.dumps(config, indent=2)

    path = lab_dir / "autograder" / "otter_config.json"
    path.write_text(sealed(path.read_text()))
    zip_path = autograder_zip(lab_dir)
    with zipfile.ZipFile(zip_path) as z:
        files = {info: z.read(info.filename) for info in z.infolist()}
    with zipfile.ZipFile(zip_path, "w", zipfile.ZIP_DEFLATED) as z:
        for info, data in files.items():
            if info.filename == "otter_config.json":
                data = sealed(data.decode()).encode()
            z.writestr(info, data)


def build(out: Path = DEFAULT_OUT, labs: list[Path] | None = None, secret: str | None = None,
          public: bool = False, said: list[str] | None = None,
          scale: float = 1.0) -> dict[str, Path]:
    """otter assign each lab into out/<lab>/ (student/ and autograder/), then seal it.
    Returns lab -> dir.

    secret: the instructor's secret (default $MINSERVE_LAB_SECRET; without either, the
    secret of the existing build in `out`, kept; `public`: the public placeholder on
    purpose). `said` collects what a teacher should read (a kept secret, no secret).
    `scale` < 1: fewer random sequences in the hidden checks (`make test` only)."""
    from otter.assign import main as assign

    said = said if said is not None else []
    given = secret if secret is not None else os.environ.get(SECRET_ENV) or None
    built = {}
    for src in labs or lab_sources():
        dest = out / src.stem
        use = None if public else given
        if use is None and not public:
            use = built_secret(dest)
            if use is not None:
                said.append(f"{src.stem}: kept the secret its existing build was sealed with "
                            "(--secret S to change it, --public to drop it)")
        if use is None:
            said.append(f"{src.stem}: no secret (--secret or ${SECRET_ENV}): the hidden tests "
                        "draw the public inputs; see docs/teaching.md, 'What is and is not "
                        "secret'")
        with contextlib.redirect_stdout(io.StringIO()):
            assign(str(src), str(dest), no_pdfs=True, no_run_tests=True)
        seal(dest, use, scale)
        built[src.stem] = dest
    return built


def autograder_zip(lab_dir: Path) -> Path:
    return next((lab_dir / "autograder").glob("*-autograder_*.zip"))


def lab_seed(lab_dir: Path) -> int:
    """The seed the plugin grades a lab's build with (from its sealed secret)."""
    from minserve.labs.differential import seed_of

    return seed_of(built_secret(lab_dir) or PUBLIC_SECRET, lab_dir.name)


def built_scale(lab_dir: Path) -> tuple[float, bool]:
    """The scale of the hidden checks a lab's build was sealed with (1: grading), and
    whether they shrink a failure."""
    config = json.loads((lab_dir / "autograder" / "otter_config.json").read_text())
    entry = plugin_config(config) or {}
    return float(entry.get("scale", 1.0)), bool(entry.get("shrink", True))


# ------------------------------------------------------------------ grading, direct
@dataclass
class Graded:
    """One notebook graded against one tests folder (the quick, in-process way)."""

    notebook: Path
    seconds: float
    results: dict[str, list[tuple[bool, str]]] = field(default_factory=dict)  # test file -> cases
    report: str = ""

    @property
    def cases(self) -> list[tuple[str, bool, str]]:
        return [(name, ok, msg) for name, rs in self.results.items() for ok, msg in rs]


def grade(notebook: Path, tests_dir: Path, seed: int | None = None, scale: float = 1.0) -> Graded:
    """Grade a notebook as the plugin does, without otter's kernel: its graded cell,
    checked, in a fresh process, every test of tests_dir (the hidden ones too)."""
    from minserve.labs import grading
    from minserve.labs.differential import seed_of
    from minserve.labs.otter_plugin import report

    t0 = time.perf_counter()
    lab = json.loads(Path(notebook).read_text())["metadata"]["otter"]["assignment_name"]
    g = grading.grade_notebook(Path(notebook), Path(tests_dir),
                               seed if seed is not None else seed_of(PUBLIC_SECRET, lab),
                               lab=lab, scale=scale)
    return Graded(Path(notebook), time.perf_counter() - t0,
                  {name: [(ok, msg) for _, ok, msg in cases] for name, cases in g.questions.items()},
                  report(g))


def check(out: Path = DEFAULT_OUT) -> int:
    """Build, then: every solution passes all its tests; every student version fails all."""
    t0 = time.perf_counter()
    built = build(out)
    print(f"built {len(built)} labs into {out} in {time.perf_counter() - t0:.1f} s")
    bad = 0
    for lab, d in built.items():
        seed = lab_seed(d)
        sol = grade(d / "autograder" / f"{lab}.ipynb", d / "autograder" / "tests", seed)
        stu = grade(d / "student" / f"{lab}.ipynb", d / "autograder" / "tests", seed)
        sol_ok = all(ok for _, ok, _ in sol.cases)
        stu_ok = stu.cases and not any(ok for _, ok, _ in stu.cases)
        bad += not (sol_ok and stu_ok)
        print(f"{lab}: solution {sum(ok for _, ok, _ in sol.cases)}/{len(sol.cases)} tests pass "
              f"({sol.seconds:.1f} s); student version {sum(not ok for _, ok, _ in stu.cases)}/"
              f"{len(stu.cases)} fail ({stu.seconds:.1f} s)" + ("" if sol_ok and stu_ok else "  <-- WRONG"))
        for _name, ok, msg in sol.cases if not sol_ok else stu.cases[:1]:
            if not sol_ok and ok:
                continue
            print("   " + msg.replace("\n", "\n   "))
    return 1 if bad else 0


# ------------------------------------------------------------------ the corpus
@dataclass
class Mistake:
    """One submission of tests/lab_corpus/<lab>/<name>.py: the graded cell as a student
    wrote it (and, after a `# --- another cell ---` line, cells of the notebook after it).
    A wrong one has `# mistake:` and `# expect:` lines (what the grader's messages must
    say); an attempt on the grader `# attempt:` and `# expect:` lines, and must score 0; a
    correct one written otherwise than the solution a `# correct:` line, and must score
    full marks (the corpus tests false failures too). `# flagged:` means the similarity
    report must flag it for a person (a copy of the engine's code)."""

    lab: str
    name: str
    code: str

    def _lines(self, tag: str) -> list[str]:
        return [line.split(":", 1)[1].strip() for line in self.code.splitlines()
                if line.startswith(f"# {tag}:")]

    @property
    def expect(self) -> list[str]:
        return self._lines("expect")

    @property
    def correct(self) -> bool:
        return bool(self._lines("correct"))

    @property
    def attempt(self) -> bool:
        return bool(self._lines("attempt"))

    @property
    def flagged(self) -> bool:
        return bool(self._lines("flagged"))

    @property
    def what(self) -> str:
        return next(iter(self._lines("mistake") + self._lines("attempt") + self._lines("correct")),
                    self.name)

    @property
    def cells(self) -> list[str]:
        """The graded cell, then any other cells."""
        return [part.strip("\n") + "\n" for part in self.code.split(EXTRA_CELL)]


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
    """The student version with its graded cell replaced by `code` (the first cell of a
    corpus file; its other cells go after the check cell): what a student hands in."""
    import nbformat

    nb = nbformat.read(student_nb, as_version=4)
    parts = [part.strip("\n") + "\n" for part in code.split(EXTRA_CELL)]
    i = graded_cell(nb)
    nb.cells[i].source = parts[0]
    for k, extra in enumerate(parts[1:]):
        nb.cells.insert(i + 2 + k, nbformat.v4.new_code_cell(extra))
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / student_nb.name
    nbformat.write(nb, path)
    return path


# ------------------------------------------------------------------ grading with `otter run`
def otter_run(zip_path: Path, submission: Path, output_dir: Path | None = None) -> dict:
    """`otter run -a ZIP SUBMISSION` (the CLI's own function, `otter.run.main`). Returns,
    per question, score, possible and the messages of its failed cases; the plugin's
    report (similarity to the engine's code); the seconds it took."""
    import resource

    from otter.run import main as run

    def cpu() -> float:  # this process and its reaped children (the kernel, the grader)
        return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                      resource.getrusage(resource.RUSAGE_CHILDREN)))

    t0, c0 = time.perf_counter(), cpu()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        results = run(str(submission), autograder=str(zip_path),
                      output_dir=str(output_dir) if output_dir else None, no_logo=True)
    out = {"seconds": round(time.perf_counter() - t0, 1), "cpu_seconds": round(cpu() - c0, 1),
           "questions": {}, "report": results.output or "",
           "plugin": results.get_plugin_data(PLUGIN) or {}}
    for name, tf in results.results.items():
        out["questions"][name] = {
            "score": tf.score, "possible": tf.possible,
            "failed": [r.message for r in tf.test_case_results if not r.passed]}
    return out


def grade_many(jobs: list[tuple[str, str, str]]) -> list[dict]:
    """jobs: (label, zip, submission). One `otter run` after another in this process (each
    in its own fresh kernel and grading process): otter's own imports are paid once."""
    return [{"label": label, **otter_run(Path(z), Path(sub))} for label, z, sub in jobs]


def grade_direct(jobs: list[tuple[str, str, str]]) -> list[dict]:
    """jobs: (label, lab folder, submission). The plugin's grading functions called
    directly (no otter kernel): each submission in a process forked from this one, which
    imported every lab's checks once (a fork costs hundredths of a second; the kernel and
    its imports about three of the four seconds an `otter run` of a wrong one costs).
    This process has run no torch operator, so the forks are safe (OpenMP's threads do
    not survive a fork)."""
    from minserve.labs import grading
    from minserve.labs.otter_plugin import report

    for lab in grading.LABS:
        grading.warm(lab)
    out = []
    for label, lab_dir, sub in jobs:
        d = Path(lab_dir)
        t0, c0 = time.perf_counter(), _children_cpu()
        scale, shrink = built_scale(d)
        g = grading.grade_notebook(Path(sub), d / "autograder" / "tests", lab_seed(d), lab=d.name,
                                   scale=scale, shrink=shrink, shipped=set(shipped_cells(
                                       d / "student" / f"{d.name}.ipynb")))
        files = grading.test_files_with_results(d / "autograder" / "tests", g)
        out.append({"label": label, "runner": "direct",
                    "seconds": round(time.perf_counter() - t0, 1),
                    "cpu_seconds": round(_children_cpu() - c0, 1), "report": report(g),
                    "plugin": {"similarity": g.similarity, "refused": g.refused},
                    "questions": {tf.name: {"score": tf.score, "possible": tf.possible,
                                            "failed": [r.message for r in tf.test_case_results
                                                       if not r.passed]} for tf in files}})
    return out


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def grade_corpus(built: dict[str, Path], work: Path, labs: list[str] | None = None,
                 workers: int = 2, otter_all: bool = True) -> dict[str, dict]:
    """Every lab's solution (the autograder's notebook) and every corpus submission, graded
    over `workers` processes. Returns label -> result, with labels "<lab>/solution" and
    "<lab>/<name>", and each result's "runner".

    otter_all: every one through `otter run` (`make lab-check`, `labs.py corpus`).
    Otherwise (`make test`) every submission through the grading functions directly, and
    the solutions and each lab's first wrong submission through `otter run` too; where
    both graded one, its result holds the direct one under "direct", for the test that the
    two agree. Both grade with what the build was sealed with (secret, scale)."""
    import subprocess

    jobs = []  # (kind, label, zip or lab folder, submission)
    for lab, d in built.items():
        if labs and lab not in labs:
            continue
        written = corpus(lab)
        subs = [(f"{lab}/solution", d / "autograder" / f"{lab}.ipynb")]
        for m in written:
            subs.append((f"{lab}/{m.name}",
                         write_submission(d / "student" / f"{lab}.ipynb", m.code, work / lab / m.name)))
        first_wrong = next(m.name for m in written if not m.correct and not m.attempt)
        for label, sub in subs:
            if otter_all or label.endswith(("/solution", f"/{first_wrong}")):
                jobs.append(("otter", label, str(autograder_zip(d)), str(sub)))
            if not otter_all:
                jobs.append(("direct", label, str(d), str(sub)))
    # the direct ones first in each process (before any kernel's threads), the longest first
    jobs.sort(key=lambda j: (j[0] == "otter", "capstone" not in j[1]))
    shards = [jobs[i::workers] for i in range(workers)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(SHIMS), os.environ.get("PYTHONPATH", "")) if p)}
    procs = []
    for i, shard in enumerate(shards):
        spec = work / f"jobs{i}.json"
        spec.write_text(json.dumps({"jobs": shard}))
        procs.append(subprocess.Popen([sys.executable, __file__, "grade-jobs", str(spec)],
                                      stdout=subprocess.PIPE, text=True, cwd=work, env=env))
    results: dict[str, dict] = {}
    direct: dict[str, dict] = {}
    for p in procs:
        out, _ = p.communicate(timeout=3600)
        if p.returncode:
            raise RuntimeError(f"a grading process failed ({p.returncode}): {out[-2000:]}")
        for r in json.loads(out.splitlines()[-1]):
            (direct if r["runner"] == "direct" else results)[r["label"]] = r
    for label, r in direct.items():
        if label in results:
            results[label]["direct"] = r
        else:
            results[label] = r
    return results


def grade_jobs(spec: dict) -> list[dict]:
    """One grading process of `grade_corpus`: its direct jobs, then its `otter run`s."""
    jobs = spec["jobs"]
    direct = grade_direct([(label, a, sub) for kind, label, a, sub in jobs if kind == "direct"])
    ran = [{"runner": "otter run", **r} for r in
           grade_many([(label, a, sub) for kind, label, a, sub in jobs if kind == "otter"])]
    return direct + ran


def first_message(result: dict) -> str:
    msgs = [m for q in result["questions"].values() for m in q["failed"]]
    if not msgs:
        return ""
    lines = msgs[0].strip().splitlines()
    return next((ln.strip() for ln in lines if "LabCheckFailed" in ln),
                lines[1] if len(lines) > 1 else lines[-1]).strip()[:110]


def corpus_report(results: dict[str, dict]) -> str:
    lines = ["| submission | score | graded by | seconds | CPU (s) | similarity | first message |",
             "|---|---|---|---|---|---|---|"]
    for label in sorted(results):
        r = results[label]
        score = sum(q["score"] for q in r["questions"].values())
        possible = sum(q["possible"] for q in r["questions"].values())
        sim = (r.get("plugin") or {}).get("similarity") or {}
        shown = "" if not sim else f"{sim['share']:.2f}" + (" FLAGGED" if sim.get("flagged") else "")
        lines.append(f"| {label} | {score:g} / {possible:g} | {r.get('runner', 'otter run')} | "
                     f"{r['seconds']} | {r.get('cpu_seconds', '')} | {shown} | "
                     f"{first_message(r).replace('|', '/')} |")
    return "\n".join(lines)


# ------------------------------------------------------------------ detection over secrets
def detection(n_secrets: int = 200, labs: list[str] | None = None, workers: int = 2,
              n_correct: int = 20) -> str:
    """Each corpus case's hidden checks under many secrets: how many secrets catch each
    wrong submission (all `n_secrets` of them must) and how many fail each correct one
    (none of `n_correct` may). The hidden checks are called directly on the graded cell,
    run as grading runs it, at full scale, without shrinking (a count needs no shortest
    sequence). Returns the rows (lab, submission, kind, secrets that caught it, secrets,
    seconds per secret), in the corpus's order (docs/lab_detection.md)."""
    import multiprocessing as mp

    cases = [("solution", lab, None) for lab in (labs or sorted(MODULES))]
    cases += [(m.name, m.lab, m.code) for m in corpus() if (not labs or m.lab in labs)
              and not m.attempt]
    jobs = [(name, lab, code, n_correct if code is None or "# correct:" in code else n_secrets)
            for name, lab, code in cases]
    # the correct ones run every check for every secret: the longest jobs, started first;
    # each row is printed to stderr as it comes, so a long run shows where it is
    order = sorted(range(len(jobs)), key=lambda i: jobs[i][2] is not None
                   and "# correct:" not in jobs[i][2])
    done = {}
    with mp.get_context("fork").Pool(workers) as pool:
        for i, row in pool.imap_unordered(_detect_job, [(i, jobs[i]) for i in order]):
            done[i] = row
            print(f"[{len(done)}/{len(jobs)}] " + " | ".join(map(str, row)), file=sys.stderr,
                  flush=True)
    return [done[i] for i in range(len(jobs))]


def detection_table(rows: list[tuple]) -> str:
    lines = ["| lab | submission | kind | secrets that catch it | seconds per secret |",
             "|---|---|---|---|---|"]
    for lab, name, kind, caught, n, seconds in rows:
        lines.append(f"| {lab} | {name} | {kind} | {caught} / {n} | {seconds:.2f} |")
    return "\n".join(lines)


def detection_summary(rows: list[tuple]) -> tuple[str, dict[str, int]]:
    """Per lab: the wrong submissions every secret caught, the fewest secrets that caught
    one, the secrets that failed a correct one. Returns the table and the totals
    (docs/figures.json's labs.detection_*)."""
    lines = ["| lab | wrong ones caught by every secret | fewest secrets catching one | "
             "correct ones (and solution) failed by a secret |", "|---|---|---|---|"]
    for lab in sorted({r[0] for r in rows}):
        wrong = [r for r in rows if r[0] == lab and r[2] != "correct"]
        right = [r for r in rows if r[0] == lab and r[2] == "correct"]
        lines.append(f"| {lab} | {sum(c == n for *_, c, n, _ in wrong)} of {len(wrong)} | "
                     f"{min(c for *_, c, n, _ in wrong)} of {wrong[0][4]} | "
                     f"{sum(c for *_, c, n, _ in right)} of {sum(n for *_, n, _ in right)} "
                     f"({len(right)} submissions) |")
    wrong = [r for r in rows if r[2] != "correct"]
    right = [r for r in rows if r[2] == "correct"]
    totals = {"wrong": len(wrong), "wrong_caught_always": sum(r[3] == r[4] for r in wrong),
              "correct": len(right), "correct_failed": sum(r[3] for r in right),
              "correct_secrets": min(r[4] for r in right)}
    return "\n".join(lines), totals


def conditions(load_start: float, load_end: float) -> dict:
    """A time's conditions as docs/figures.json records them: quiet when the 1-minute load
    was under 1 at the start (the run's own processes then raise it)."""
    return {"machine": "quiet" if load_start < 1.0 else "loaded", "cores": os.cpu_count() or 1,
            "load": f"{load_start:.1f}-{load_end:.1f}"}


# ------------------------------------------------------------------ grading time
TIMED = "PYTHONPATH=scripts/grading_shims .venv/bin/otter run -a {zip} -o {out} {sub}"


def timing(out: Path, secret: str = "timing-secret") -> dict:
    """docs/teaching.md's grading command, exactly, one fresh `otter run` after another
    from the repository root, on a sample: per lab its solution, its first correct
    submission written otherwise and its first two wrong ones. Returns the rows (label,
    kind, wall s, CPU s of the command and its children) and the medians."""
    import resource
    import statistics
    import subprocess
    import tempfile

    built = build(out, secret=secret)
    work = Path(tempfile.mkdtemp(prefix="lab-timing-"))
    rows = []
    for lab, d in built.items():
        written = corpus(lab)
        sample = [("solution", "correct", d / "autograder" / f"{lab}.ipynb")]
        sample += [(m.name, "correct", None) for m in written if m.correct and not m.flagged][:1]
        sample += [(m.name, "wrong", None) for m in written
                   if not m.correct and not m.attempt][:2]
        for name, kind, sub in sample:
            if sub is None:
                m = next(m for m in written if m.name == name)
                sub = write_submission(d / "student" / f"{lab}.ipynb", m.code, work / lab / name)
            res = work / "results" / lab / name
            res.mkdir(parents=True, exist_ok=True)
            cmd = TIMED.format(zip=autograder_zip(d), out=res, sub=sub)
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            subprocess.run(["bash", "-c", cmd], cwd=ROOT, check=True, capture_output=True)
            wall = time.perf_counter() - t0
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            rows.append((f"{lab}/{name}", kind, round(wall, 1), round(cpu, 1)))
    walls = [w for *_, w, _ in rows]
    return {"rows": rows, "median_s": round(statistics.median(walls), 1),
            "max_s": max(walls), "median_cpu_s": round(statistics.median(c for *_, c in rows), 1),
            "median_right_s": round(statistics.median(w for _, k, w, _ in rows if k == "correct"), 1),
            "median_wrong_s": round(statistics.median(w for _, k, w, _ in rows if k == "wrong"), 1)}


DETECTION_PAGE = """# The labs' hidden checks, under many secrets

Written by `make lab-detection` (`.venv/bin/python scripts/labs.py detection {n} --write`; with lab
names, only those labs' rows are measured again): every submission of
`tests/lab_corpus/` but the attempts on the grader (which the allow-list refuses before
anything runs), and each lab's solution, with the hidden checks of its lab (the
differential checks against the engine's code; lab 7's properties, its starvation check
and its unseen workload) drawn from {n} secrets for a wrong submission and 20 for a
correct one (`detection-0`, `detection-1`, ...). A wrong submission must be caught by
every secret (a grade must not depend on the draw); a correct one by none. The checks ran
at full scale (as grading runs them), without shrinking. `tests/test_labs.py` checks that
this table lists the corpus as it is and that every count is all or none.

The runs that measured the rows below, each on two processes on a 2-core machine that
other jobs shared (the seconds per secret are from the run that measured the row):

{runs}

Per lab:

{summary}

Per submission:

{table}
"""
DETECTION_ROW = re.compile(r"^\| (lab\w+) \| (\w+) \| ([\w -]+) \| (\d+) / (\d+) \| ([\d.]+) \|$",
                           re.M)
DETECTION_RUN = re.compile(r"^- (\d{4}-\d\d-\d\d): (.+?), (\d+) minutes?, load average "
                           r"([\d.]+) at the start, ([\d.]+) at the end$", re.M)


def write_detection(rows: list[tuple], n: int, labs: list[str] | None, minutes: float,
                    load: float, end: float, page: Path | None = None) -> dict[str, int]:
    """docs/lab_detection.md with `rows`; a run of some labs keeps the other labs' rows
    (and the runs that measured them) from the page. Returns the totals."""
    page = page or ROOT / "docs" / "lab_detection.md"
    runs: list[tuple] = []
    if labs and page.exists():
        old = page.read_text()
        kept = [(lab, name, kind, int(c), int(k), float(sec)) for lab, name, kind, c, k, sec
                in DETECTION_ROW.findall(old) if lab not in labs]
        runs = [r for r in DETECTION_RUN.findall(old)
                if set(r[1].split(" and ")) - set(labs) != set()]
        order = {(m.lab, m.name): i for i, m in enumerate(corpus())}
        rows = sorted(kept + rows, key=lambda r: (r[0], r[1] != "solution",
                                                  order.get((r[0], r[1]), 0)))
    runs.append((time.strftime("%Y-%m-%d"), " and ".join(labs) if labs else "every lab",
                 str(round(minutes)), f"{load:.1f}", f"{end:.1f}"))
    text = "\n".join(f"- {d}: {what}, {m} minutes, load average {a} at the start, {b} at the end"
                     for d, what, m, a, b in runs)
    summary, totals = detection_summary(rows)
    page.write_text(DETECTION_PAGE.format(n=n, runs=text, summary=summary,
                                          table=detection_table(rows)))
    totals["minutes"] = sum(int(r[2]) for r in runs)
    totals["load"] = (min(float(r[3]) for r in runs), max(float(r[4]) for r in runs))
    return totals


MODULES = {"lab1_fcfs": "fcfs", "lab2_gates": "gates", "lab3_vtc": "vtc", "lab4_padded": "padded",
           "lab5_blocks": "blocks", "lab6_chunked": "chunked", "lab7_capstone": "capstone"}


def hidden_checks(lab: str, env: dict, hidden) -> None:
    """What a lab's hidden tests run beyond the public ones, in the order they run it."""
    import importlib

    m = importlib.import_module(f"minserve.labs.{MODULES[lab]}")
    cell = m.CELL
    pieces = [env[n] for n in cell.names]
    if lab == "lab7_capstone":
        m.check_properties(*pieces, hidden)
        m.check_no_starvation(*pieces, hidden=hidden)
        m.check_serves(*pieces, seed=m.hidden_seed(hidden, "workload"),
                       sessions="dora=4,eli=1,fay=2", n=16)
    else:
        m.check_against_the_engine(*pieces, hidden)


def cell_env(lab: str, code: str | None) -> dict:
    """The graded cell (the source's solution, or a corpus file's first cell) run as
    grading runs it: its lab's provided names and safe builtins."""
    import importlib

    from minserve.labs.allowlist import ALLOWED_MODULES, check_cell, safe_builtins

    cell = importlib.import_module(f"minserve.labs.{MODULES[lab]}").CELL
    if code is None:
        code = solution_code(lab)
    code = code.split(EXTRA_CELL)[0]
    if check_cell(code, cell):
        raise ValueError("refused by the allow-list")
    env = {"__builtins__": safe_builtins(set(cell.imports) | set(cell.module_imports)
                                         | set(ALLOWED_MODULES)),
           "__name__": "submission", **cell.provided()}
    exec(compile(code, f"<{lab} graded cell>", "exec"), env)  # noqa: S102
    return env


def solution_code(lab: str) -> str:
    """The graded cell's solution as the source notebook holds it, without otter's markers
    and the stubs between `# BEGIN PROMPT` and `# END PROMPT`."""
    import nbformat

    nb = nbformat.read(SOURCES / f"{lab}.ipynb", as_version=4)
    src = next(c.source for c in nb.cells if c.cell_type == "code"
               and "BEGIN SOLUTION NO PROMPT" in c.source)
    out, prompt = [], False
    for line in src.splitlines():
        if "# BEGIN PROMPT" in line:
            prompt = True
        elif "# END PROMPT" in line:
            prompt = False
        elif not prompt and "# BEGIN SOLUTION" not in line and "# END SOLUTION" not in line:
            out.append(line)
    return "\n".join(out) + "\n"


def _detect_job(job):
    i, args = job
    return i, _detect(*args)


def _detect(name: str, lab: str, code: str | None, n: int):
    from minserve.labs.common import LabCheckFailed
    from minserve.labs.differential import Hidden, seed_of

    kind = "correct" if code is None or "# correct:" in code else "wrong"
    t0 = time.perf_counter()
    caught = 0
    try:
        env = cell_env(lab, code)
    except ValueError:
        return lab, name, "refused by the allow-list", n, n, 0.0
    for k in range(n):
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                hidden_checks(lab, env, Hidden(seed_of(f"detection-{k}", lab), shrink=False))
        except LabCheckFailed:
            caught += 1
    return lab, name, kind, caught, n, (time.perf_counter() - t0) / n


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else "build"
    if cmd == "grade-jobs":  # internal: one grading process of grade_corpus
        print(json.dumps(grade_jobs(json.loads(Path(sys.argv[2]).read_text()))))
        sys.exit(0)
    if cmd == "grade":
        zip_path = sys.argv[2]
        flagged = []
        for r in grade_many([(s, zip_path, s) for s in sys.argv[3:]]):
            print(json.dumps(r))
            sim = (r.get("plugin") or {}).get("similarity") or {}
            if sim.get("flagged"):
                flagged.append(f"{r['label']}: {sim['share']:.2f} of the engine's {sim['of']}")
        if flagged:
            print("flagged for a person (similar to the engine's own code):\n  "
                  + "\n  ".join(flagged), file=sys.stderr)
        sys.exit(0)
    if cmd == "detection":  # detection [N] [LAB ...] [--write]: docs/lab_detection.md
        args = [a for a in sys.argv[2:] if a != "--write"]
        n = int(args[0]) if args else 200
        t0, load = time.perf_counter(), os.getloadavg()
        rows = detection(n, labs=args[1:] or None)
        took, end = time.perf_counter() - t0, os.getloadavg()[0]
        table, (summary, totals) = detection_table(rows), detection_summary(rows)
        print(summary + "\n\n" + table)
        if "--write" in sys.argv:
            from minserve import figures

            totals = write_detection(rows, n, args[1:] or None, took / 60, load[0], end)
            minutes, (low, high) = totals.pop("minutes"), totals.pop("load")
            source = (f"python scripts/labs.py detection {n} --write (docs/lab_detection.md, "
                      f"{time.strftime('%Y-%m-%d')}; load average {low:.1f}-{high:.1f}, on "
                      f"{os.cpu_count()} cores)")
            data = figures.load()
            data["labs.detection_secrets"] = {"source": source, "value": n}
            for key, value in totals.items():
                data[f"labs.detection_{key}"] = {"source": source, "value": value}
            data["labs.detection_minutes"] = {"source": source, "value": minutes,
                                              "conditions": conditions(low, high)}
            figures.save(data)
            figures.sync()
        sys.exit(0)
    if cmd == "timing":  # timing [--write]: the grading figures of docs/teaching.md
        load = os.getloadavg()[0]
        import tempfile

        # its own build (a secret of its own) in a temporary folder unless given one:
        # never over a teacher's build/labs and the secret it was sealed with
        t = timing(Path(next((a for a in sys.argv[2:] if a != "--write"), None)
                        or tempfile.mkdtemp(prefix="lab-timing-build-")))
        end = os.getloadavg()[0]
        for row in t["rows"]:
            print("| " + " | ".join(str(x) for x in row) + " |")
        print(f"median {t['median_s']} s (right {t['median_right_s']} s, wrong "
              f"{t['median_wrong_s']} s), at most {t['max_s']} s; median CPU "
              f"{t['median_cpu_s']} s; load average {load:.1f} at the start, {end:.1f} at the end")
        if "--write" in sys.argv:
            from minserve import figures

            source = (f"python scripts/labs.py timing ({len(t['rows'])} submissions, "
                      f"{time.strftime('%Y-%m-%d')}; load average {load:.1f} at the start, "
                      f"{end:.1f} at the end, on 2 cores)")
            data = figures.load()
            for key in ("median_s", "max_s", "median_cpu_s", "median_right_s", "median_wrong_s"):
                data[f"labs.grading_{key}"] = {"source": source, "value": t[key],
                                               "conditions": conditions(load, end)}
            figures.save(data)
            figures.sync()
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
    rest, secret, public = sys.argv[2:], None, False
    if "--public" in rest:
        public, rest = True, [a for a in rest if a != "--public"]
    if "--secret" in rest:  # build --secret S [OUT]: the hidden tests' inputs from S
        i = rest.index("--secret")
        if i + 1 >= len(rest):
            sys.exit("--secret needs a value")
        secret, rest = rest[i + 1], rest[:i] + rest[i + 2:]
    out = Path(rest[0]) if rest else DEFAULT_OUT
    if cmd == "build":
        said: list[str] = []
        for lab, d in build(out, secret=secret, public=public, said=said).items():
            print(f"{lab}: {d / 'student'}  {d / 'autograder'}")
        for line in said:
            print(line)
    elif cmd == "check":
        sys.exit(check(out))
    else:
        sys.exit(f"usage: {sys.argv[0]} build|check|grade|corpus|detection [OUT]")
