"""The counts the pages quote (lessons, labs, the labs' corpus, tests), taken from the
repository as it is now: `python scripts/repo_counts.py [--write]`.

    .venv/bin/python scripts/repo_counts.py           # print them
    .venv/bin/python scripts/repo_counts.py --write   # record them in docs/figures.json

A page quotes one as a marked figure (`111<!-- fig:count.corpus_submissions --> submissions`,
minserve/figures), so `--write` rewrites every page that quotes it, and
tests/test_page_figures.py fails when a page's count and the repository's differ
(a lab added, a corpus file removed, a test added to tests/test_labs.py).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "lab_corpus"
# the test files whose size a page quotes: "the labs' tests (216 tests, ...)"; the corpus's
# split by kind (wrong, attempts, correct) is read from each file's header and held to
# the page by tests/test_labs.py
TEST_FILES = {"count.labs_tests": ("tests/test_labs.py", "tests/test_lab_grading.py")}


def corpus() -> dict[str, list[Path]]:
    """lab -> its corpus submissions (a mistake each, or a `correct_*.py`)."""
    return {d.name: sorted(d.glob("*.py")) for d in sorted(CORPUS.glob("lab*")) if d.is_dir()}


def collected(test_files: tuple[str, ...]) -> int:
    """How many tests pytest collects from `test_files` (`pytest --collect-only`)."""
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                        "no:cacheprovider", *test_files], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    m = re.search(r"^(\d+) tests? collected", r.stdout, re.M)
    if m is None:
        raise RuntimeError(f"pytest --collect-only {test_files}: {r.stdout[-500:]}{r.stderr[-500:]}")
    return int(m[1])


def file_counts() -> dict[str, int]:
    """Every count but the test files' (cheap: files on disk)."""
    return {
        "count.lessons": len(list((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))),
        "count.labs": len(list((ROOT / "notebooks" / "labs").glob("lab*.ipynb"))),
        "count.corpus_submissions": sum(len(files) for files in corpus().values()),
    }


def counts() -> dict[str, int]:
    return {**file_counts(), **{name: collected(f) for name, f in TEST_FILES.items()}}


SOURCES = {
    "count.lessons": "notebooks/NN_*.ipynb",
    "count.labs": "notebooks/labs/lab*.ipynb",
    "count.corpus_submissions": "tests/lab_corpus/<lab>/*.py",
    **{name: f"pytest --collect-only {' '.join(f)}" for name, f in TEST_FILES.items()},
}


def main(argv: list[str]) -> int:
    found = counts()
    for name, n in found.items():
        print(f"{name:28s} {n:5d}  ({SOURCES[name]})")
    if "--write" in argv:
        sys.path.insert(0, str(ROOT))
        from minserve import figures

        for name, n in found.items():
            figures.record({name: n}, source=f"scripts/repo_counts.py: {SOURCES[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
