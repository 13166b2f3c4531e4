"""The numbers on the pages are today's, and a time says what machine it was taken on.

* **Counts** (lessons, labs, the labs' corpus, the tests of tests/test_labs.py) are marked
  figures of docs/figures.json (`count.*`), and each is counted again here from the
  repository: notebooks and corpus files on disk, and `pytest --collect-only` for a test
  file (taken from this session's own collection when it collected that file whole,
  so `make test` pays nothing for it). A page that says "109 tests" of a file that holds
  111 fails.
* **Times** (figures named `*_s`, `*_ms`, `*.minutes`) carry their conditions in
  docs/figures.json: quiet, loaded or unknown, the cores, the load average where it was
  recorded; and wherever a page quotes one, the same paragraph or table row says which
  ("quiet", "busy", "load not recorded", ...) beside it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from minserve import figures

from .conftest import COLLECTED, load_script

ROOT = Path(__file__).resolve().parents[1]
counts_script = load_script("repo_counts")
FIGURES = figures.load()
WORDS = {"quiet": ("quiet", "no other work running", "to itself"),
         "loaded": ("busy", "loaded", "load average", "shared", "(load "),
         "unknown": ("load not recorded",)}


def collected_here(config, test_files: tuple[str, ...]) -> int | None:
    """How many tests this session collected from `test_files`, if it collected them whole."""
    ids = config.stash.get(COLLECTED, None)
    args = [a for a in config.args if not a.startswith("-")]
    whole = all(not args or any(f == a or f.startswith(a.rstrip("/") + "/")
                                or a in (".", "tests", "tests/") for a in args)
                for f in test_files)
    if ids is None or not whole:
        return None
    n = sum(i.split("::")[0] in test_files for i in ids)
    return n or None


def repository_counts(config) -> dict[str, int]:
    found = counts_script.file_counts()
    for name, test_file in counts_script.TEST_FILES.items():
        found[name] = collected_here(config, test_file) or counts_script.collected(test_file)
    return found


def test_every_count_the_pages_quote_is_what_the_repository_holds(request):
    found = repository_counts(request.config)
    recorded = {n: f["value"] for n, f in FIGURES.items() if n.startswith("count.")}
    assert set(recorded) == set(found), set(recorded) ^ set(found)
    stale = {n: (recorded[n], found[n]) for n in found if recorded[n] != found[n]}
    assert not stale, (f"docs/figures.json (figure: page, repository) {stale}; run "
                       "`.venv/bin/python scripts/repo_counts.py --write`")
    quoted = {m["name"] for page in figures.pages() if page.exists()
              for m in figures.MARKED.finditer(page.read_text(encoding="utf-8"))}
    assert {"count.lessons", "count.labs", "count.corpus_submissions",
            "count.labs_tests"} <= quoted  # and the pages agree with the file (test_docs_match_code)


def test_no_page_writes_a_count_of_tests_that_no_marker_keeps():
    """"109 tests" of a file that now holds 111: a count of tests is a marked figure, or
    says when it held ("109 tests when it was timed"). (Lessons and labs written in words
    are held to the files by tests/test_docs_match_code.py.)"""
    tests = re.compile(r"\b(\d[\d,]*) tests\b(?! when)")
    bad = [f"{page.name}: {m[0]!r}" for page in figures.pages() if page.exists()
           for m in tests.finditer(page.read_text(encoding="utf-8"))]
    assert bad == [], "write it as a marked figure (scripts/repo_counts.py): " + "; ".join(bad)


def test_every_time_in_figures_json_carries_the_conditions_it_was_measured_under():
    times = {n: f for n, f in FIGURES.items() if figures.TIMING.search(n)}
    assert len(times) > 10
    for name, fig in times.items():
        c = fig.get("conditions")
        assert c and c["machine"] in figures.MACHINES and c["cores"] >= 1, (name, c)
        assert c["machine"] == "unknown" or c["load"] is None or re.fullmatch(
            r"\d+(\.\d+)?(-\d+(\.\d+)?)?", c["load"]), (name, c)


def beside(text: str, start: int) -> str:
    """The table row, or the paragraph, a marker stands in."""
    line_start = text.rfind("\n", 0, start) + 1
    line = text[line_start:text.find("\n", start)]
    if line.lstrip().startswith("|"):
        return line
    para_start = text.rfind("\n\n", 0, start) + 2
    para_end = text.find("\n\n", start)
    return text[max(para_start, start - 300):start + 300 if para_end < 0 else
                min(para_end, start + 300)]


def test_a_page_quoting_a_time_says_beside_it_what_machine_it_was_taken_on():
    seen, bad = 0, []
    for page in figures.pages():
        if not page.exists():
            continue
        text = page.read_text(encoding="utf-8")
        for m in figures.MARKED.finditer(text):
            if not figures.TIMING.search(m["name"]):
                continue
            seen += 1
            machine = FIGURES[m["name"]]["conditions"]["machine"]
            near = " ".join(beside(text, m.start()).split()).lower()
            if not any(w in near for w in WORDS[machine]):
                bad.append(f"{page.name}: {m['num']} ({m['name']}, {machine}) without "
                           f"{' / '.join(WORDS[machine])} beside it")
    assert seen >= 10 and bad == [], "\n".join(bad)


@pytest.mark.parametrize("machine,text,ok", [
    ("quiet", "| 01 | x | 28 s, quiet machine | 30 min |", True),
    ("quiet", "| 01 | x | 28 s | 30 min |", False),
    ("loaded", "took 12 s while other jobs ran (load average 7-9)", True),
    ("unknown", "about 34 s under FCFS", False)])
def test_the_machine_check_reads_the_row_or_the_paragraph(machine, text, ok):
    near = " ".join(beside(text, text.index(" s") - 1).split()).lower()
    assert any(w in near for w in WORDS[machine]) == ok
