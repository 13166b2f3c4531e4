"""The docs say what the code has: lists and counts are checked against the code, and
measured figures quoted in prose come from one place (docs/figures.json).

Each of these once said the opposite of the code: "five hooks" while `policies.py` had
seven; lesson 07 missing from the lists of lessons; `docs/architecture.md`'s tree
without `explain.py` or `labs/` and its "~2,000 lines" beside 2,505 counted; the
6,000-token stall quoted as 23 s on one page and 25.5 s on another.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from minserve import figures
from minserve.policies import Policy

from .conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
PROSE = [ROOT / "README.md", ROOT / "notebooks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NUMBERS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten "
                                      "eleven twelve".split())}
LESSONS = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
LABS = sorted(p.name for p in (ROOT / "notebooks" / "labs").glob("*.ipynb"))


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def hooks() -> list[str]:
    """The hooks in the table of `minserve/policies.py`'s docstring (its first column)."""
    doc = ast.get_docstring(ast.parse(read(ROOT / "minserve" / "policies.py")))
    table = doc.split("\n\n")[2].splitlines()[1:]  # after the header line
    return [line.split()[0] for line in table if line.strip()]


def counted(word: str, files=PROSE + [ROOT / "minserve" / "policies.py"]) -> list[tuple[str, int]]:
    """(file, n) for every "<number word> <word>" in the prose, e.g. "five hooks"."""
    found = []
    for path in files:
        for m in re.finditer(rf"\b({'|'.join(NUMBERS)})\s+(?:\w+\s+)?{word}\b", read(path), re.I):
            found.append((path.relative_to(ROOT).as_posix(), NUMBERS[m.group(1).lower()]))
    return found


def test_every_count_of_policy_hooks_is_the_number_policies_py_has():
    names = hooks()
    assert len(names) == 7 and all(callable(getattr(Policy, n, None)) for n in names), names
    said = counted("hooks")
    assert len(said) >= 4, said  # README, policies.md, spec.md, architecture.md, policies.py
    assert all(n == len(names) for _, n in said), said
    table = read(ROOT / "docs" / "policies.md")
    spec = read(ROOT / "docs" / "spec.md").split("## 3. Policies")[1].split("**P1**")[0]
    for name in names:
        assert f"| `{name}` |" in table, f"docs/policies.md's table lacks {name}"
        assert f"`{name}`" in spec, f"docs/spec.md's policy section lacks {name}"


@pytest.mark.parametrize("page", ["docs/inspecting.md", "docs/spec.md"])
def test_every_lesson_is_in_the_docs_lists_of_lessons(page):
    text = read(ROOT / page)
    assert len(LESSONS) >= 7
    missing = [n for n in LESSONS if n not in text]
    assert not missing, f"{page} does not list {missing}"


def marked(name: str) -> list[int]:
    """Every number the prose marks as the figure `name` (`8<!-- fig:count.lessons -->`)."""
    return [int(m["num"]) for path in PROSE for m in figures.MARKED.finditer(read(path))
            if m["name"] == name]


def test_the_counts_of_lessons_and_labs_are_the_files_there():
    lessons = [n for f, n in counted("(?:short\\s+)?notebooks") + counted("lessons")]
    lessons += marked("count.lessons")
    labs = [n for f, n in counted("(?:classroom\\s+)?labs")] + marked("count.labs")
    assert lessons and all(n == len(LESSONS) for n in lessons), (lessons, LESSONS)
    assert labs and all(n == len(LABS) for n in labs), (labs, LABS)
    teaching = read(ROOT / "docs" / "teaching.md")
    assert not [n for n in LABS if n.removesuffix(".ipynb") not in teaching]


def test_the_architecture_tree_and_the_readme_name_every_module():
    """docs/architecture.md's tree has every module and subpackage of minserve/; the
    README's layout table has every core module (a file at the package top)."""
    tree = read(ROOT / "docs" / "architecture.md").split("```")[1]
    readme = read(ROOT / "README.md")
    pkg = ROOT / "minserve"
    tops = [p.name for p in pkg.glob("*.py") if p.name != "__init__.py"]
    subpackages = [p.name + "/" for p in pkg.iterdir() if (p / "__init__.py").exists()]
    missing = [n for n in tops + subpackages if n not in tree]
    assert not missing, f"docs/architecture.md's tree lacks {missing}"
    core = [n for n in tops if n != "__main__.py"]
    assert not [n for n in core if f"minserve/{n}" not in readme], "README's layout table"
    assert not [n for n in subpackages if f"minserve/{n}" not in readme], "README's layers"


def test_the_core_line_counts_in_the_docs_are_a_fresh_count_rounded():
    """Every marked line count (the core's, its front's, fast/'s) agrees with
    scripts/core_size.py run now, at the precision the prose chose (so "2,500" survives
    a small edit; "~2,000" does not survive 2,505)."""
    fresh = load_script("core_size").figures()
    quoted = [(p, m) for p in PROSE for m in figures.MARKED.finditer(read(p))
              if m["name"] in fresh]
    assert len(quoted) >= 3, quoted  # README (code, all), docs/architecture.md
    assert {"core.code_lines", "front.code_lines", "fast.code_lines"} <= {m["name"] for _, m in quoted}
    bad = [f"{p.name}: {m['num']} vs {fresh[m['name']]} counted" for p, m in quoted
           if figures.render(fresh[m["name"]], m["num"]) != m["num"]]
    assert not bad, bad + ["run `python scripts/core_size.py --write`"]


def test_every_marked_figure_in_the_prose_is_the_one_in_docs_figures_json():
    assert figures.disagreements() == [], "python -m minserve.figures sync"
    marked = {m["name"] for p in PROSE for m in figures.MARKED.finditer(read(p))}
    assert {"long_prompt.monolithic_gap_s", "make_test.minutes", "core.code_lines"} <= marked
    assert all("source" in f for f in figures.load().values())


def test_the_figure_check_catches_a_stale_number_and_sync_repairs_it(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "figures.json").write_text('{"stall": {"value": 25.52, "source": "x"},'
                                                    ' "lines": {"value": 2505, "source": "y"}}')
    page = tmp_path / "docs" / "a.md"
    page.write_text("froze for 23<!-- fig:stall --> s, then 25.5<!-- fig:stall --> s; "
                    "about 2,000<!-- fig:lines --> lines, ~3<!-- fig:nope --> x")
    bad = figures.disagreements(tmp_path, tmp_path / "docs" / "figures.json")
    assert len(bad) == 3 and "23 <- fig:stall" in bad[0] and "fig:nope" in bad[2], bad
    figures.sync(tmp_path, tmp_path / "docs" / "figures.json")
    assert page.read_text().startswith("froze for 26<!-- fig:stall --> s, then 25.5<!--")
    assert "about 2,500<!-- fig:lines -->" in page.read_text()
    assert figures.render(1.73, "2") == "2" and figures.render(8.25, "7.5") == "8.2"


# ------------------------------------------------------------------ one figure, one place
# Figures that several pages and programs quote: the words a sentence quoting one has,
# and the units its number comes in. The first conversion once read 26 s in the README,
# 20 s in docs/demo.md and 30 s in what app.py printed; `make peers-bench` 40 minutes in
# the README and an hour in the Makefile.
QUOTED_FIGURES = {
    "model.first_conversion_s": (r"\bconvert|\bconversion", r"s|seconds?"),
    "peers_bench.minutes": (r"peers-bench|peers_bench", r"min|minutes?|h|hours?"),
}
# Where a figure is measured and written down by the program that measured it (not
# quoted): docs/benchmarks.md's side-by-side section says how long its run took.
RECORDS = {"peers_bench.minutes": ("docs/benchmarks.md", r"took (\d+) min")}
WORDS_FOR_A_NUMBER = r"\b(?:an?|half an?|one|two|three)\s+"
SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z`*(])|\n\s*\n")  # a Makefile's unit: a paragraph


def quoting_files() -> list[Path]:
    """What may quote a figure: the prose, the lessons, the Makefile, the programs."""
    return [*PROSE, ROOT / "Makefile", ROOT / "app.py", *sorted((ROOT / "minserve").rglob("*.py")),
            *sorted((ROOT / "scripts").glob("*.py")), *sorted((ROOT / "notebooks").glob("*.ipynb"))]


def quotes(name: str, files=None) -> list[tuple[str, str, str | None]]:
    """(file, the number as written, the figure it is marked with or None) for every
    number in a sentence that quotes figure `name` (its words, then a number in its units)."""
    words, units = QUOTED_FIGURES[name]
    record = RECORDS.get(name)
    num = re.compile(rf"(?P<num>\d[\d,]*(?:\.\d+)?|{WORDS_FOR_A_NUMBER.strip()})"
                     rf"(?:<!-- fig:(?P<fig>[\w.-]+) -->)?\s*(?:{units})\b")
    found = []
    for path in files or quoting_files():
        text = read(path)
        if path.suffix == ".ipynb":  # the text a reader sees: markdown cells and code
            import json

            text = "\n\n".join("".join(c["source"]) for c in json.loads(text)["cells"])
        parts = text.split("\n\n") if path.name == "Makefile" else SENTENCE.split(text)
        for sentence in parts:
            if re.search(words, sentence, re.I):
                rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
                if record and rel == record[0] and re.search(record[1], sentence):
                    continue  # the measurement's own record (compared with the figure below)
                for m in num.finditer(sentence):
                    found.append((rel, m["num"], m["fig"]))
    return found


@pytest.mark.parametrize("name", sorted(QUOTED_FIGURES))
def test_a_figure_quoted_in_several_places_is_marked_wherever_it_is_quoted(name):
    """Each quote is the marked number (whose value the check above compares with
    docs/figures.json); a program or the Makefile, where no marker goes, quotes none:
    app.py reads the figure from docs/figures.json, the Makefile points to the README."""
    found = quotes(name)
    assert any(fig == name for _, _, fig in found), f"no page quotes {name}: {found}"
    bad = [q for q in found if q[2] != name]
    assert not bad, f"quoted without <!-- fig:{name} -->, or where no marker goes: {bad}"


def test_the_quote_check_finds_unmarked_numbers_and_numbers_in_words(tmp_path):
    page, make = tmp_path / "demo.md", tmp_path / "Makefile"
    page.write_text("The first run converts it to a folder (about 20 s; later starts take a few "
                    "seconds). Later loads take 2 s. It is converted once: about "
                    "26<!-- fig:model.first_conversion_s --> s.\n\nThe chat converses in 3 s.")
    make.write_text("# then starts the servers (about an hour on 2 cores).\npeers-bench: setup\n")
    assert quotes("model.first_conversion_s", [page]) == [
        ("demo.md", "20", None), ("demo.md", "26", "model.first_conversion_s")]
    assert quotes("peers_bench.minutes", [make]) == [("Makefile", "an ", None)]


def test_the_figure_for_make_peers_bench_is_the_run_docs_benchmarks_md_timed():
    """docs/benchmarks.md's side-by-side section records how long its run took
    (`side_by_side --write`); the figure the README quotes is that run's."""
    path, record = RECORDS["peers_bench.minutes"]
    timed = re.search(r"`make peers-bench[^`]*`.*?" + record, read(ROOT / path), re.S)
    assert timed, "docs/benchmarks.md no longer says how long `make peers-bench` took"
    assert figures.load()["peers_bench.minutes"]["value"] == int(timed.group(1))


def test_no_lesson_quotes_a_wall_time_in_its_prose():
    """A lesson's times are the reader's run's, printed by its cells; prose that quotes a
    stored run's times (lesson 06 once said 1.4 s against 0.95 s, beside a plot of another
    run) disagrees with what the reader sees."""
    import json

    said = []
    for name in LESSONS:
        for cell in json.loads(read(ROOT / "notebooks" / name))["cells"]:
            if cell["cell_type"] == "markdown":
                text = "".join(cell["source"])
                said += [(name, m.group(0)) for m in
                         re.finditer(r"\b\d[\d,]*(?:\.\d+)?\s*(?:ms|s|seconds|minutes)\b", text)]
    assert not said, said
