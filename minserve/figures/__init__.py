"""Measured figures quoted in the docs' prose, from one generated place: docs/figures.json.

A number that a benchmark or a script measured is written in the prose with a marker
right after it, invisible once the Markdown is rendered:

    a 6,000-token prompt froze a concurrent stream for 25.5<!-- fig:long_prompt.monolithic_gap_s --> s

`docs/figures.json` holds each figure's value and where it comes from. Whoever measures
a figure writes it there (`minserve bench long-prompt`, `scripts/core_size.py
--write`, `scripts/refresh_notebooks.py`, or a person: `python -m minserve.figures set
make_test.minutes 8.5`), and `sync()` rewrites every marked number in the docs,
keeping the precision the prose chose ("2,500" stays rounded to hundreds, "25.5" to one
decimal). `tests/test_docs_match_code.py` fails when a marked number disagrees with the
file, so a figure cannot say 23 s in one page and 25.5 s in another.

    python -m minserve.figures                  # check: list disagreements
    python -m minserve.figures sync             # rewrite the marked numbers
    python -m minserve.figures set NAME VALUE   # record a measurement, then sync
                                                # (a time: then add its "conditions")

An outer layer: the docs' bookkeeping, not the engine's. May import: nothing of
minserve (the standard library only); imported by `minserve.bench` (experiments record
what they measure), by scripts/ and by the tests.
"""

from __future__ import annotations

import json
import re
import sys
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ROOT / "docs" / "figures.json"
MARKED = re.compile(r"(?P<num>\d[\d,]*(?:\.\d+)?)<!-- fig:(?P<name>[\w.-]+) -->")


def pages(root: Path = ROOT) -> list[Path]:
    """The prose that may quote figures: the READMEs and the docs."""
    return [root / "README.md", root / "notebooks" / "README.md",
            *sorted((root / "docs").glob("*.md"))]


def load(path: Path = FIGURES) -> dict[str, dict]:
    return json.loads(path.read_text(encoding="utf-8"))


def save(figures: dict[str, dict], path: Path = FIGURES) -> None:
    path.write_text(json.dumps(figures, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                    encoding="utf-8")


# A time is worth little without the machine it was taken on: each timing figure carries
# its conditions, {"machine": "quiet" | "loaded" | "unknown", "cores": N, "load": "0.6-0.9"
# or None}, and a page that quotes it says next to it which machine (tests/test_page_figures.py).
TIMING = re.compile(r"(_s|_ms|\.minutes)$")
MACHINES = ("quiet", "loaded", "unknown")


def conditions_of(load_start: float, load_end: float, cores: int) -> dict:
    """A run's conditions from its load averages: quiet when the machine was idle as it
    started (a 1-minute load under 1: the run's own threads then raise it)."""
    return {"machine": "quiet" if load_start < 1.0 else "loaded", "cores": cores,
            "load": f"{load_start:.1f}-{load_end:.1f}"}


def record(values: dict[str, float], source: str, path: Path = FIGURES,
           root: Path = ROOT, conditions: dict | None = None) -> None:
    """Store measured `values` (name -> number) with where they came from (and, for a
    time, the conditions it was measured under); sync the docs."""
    figures = load(path) if path.exists() else {}
    for name, value in values.items():
        figures.setdefault(name, {}).update(value=value, source=source)
        if conditions is not None:
            figures[name]["conditions"] = conditions
    save(figures, path)
    sync(root, path)


def _exponent(text: str) -> int:
    """The power of ten the prose rounded to: '25.5' -> -1, '2,500' -> 2, '26' -> 0; a
    round integer keeps two significant digits ('2,000' -> 2: hundreds, not thousands)."""
    digits = text.replace(",", "")
    if "." in digits:
        return -len(digits.split(".")[1])
    if not digits.strip("0"):
        return 0
    return min(len(digits) - len(digits.rstrip("0")), max(len(digits) - 2, 0))


def render(value: float, like: str) -> str:
    """`value` written with the precision and separators of `like`."""
    exp = _exponent(like)
    rounded = Decimal(str(value)).quantize(Decimal(1).scaleb(exp)) if exp <= 0 else \
        Decimal(round(value, -exp))
    text = f"{rounded:,f}" if "," in like or (exp > 0 and abs(value) >= 10_000) else f"{rounded:f}"
    return text if exp < 0 else text.split(".")[0]


def disagreements(root: Path = ROOT, path: Path = FIGURES) -> list[str]:
    """'file: 23 <- fig:NAME is 25.52' for every marked number that is not the figure."""
    figures, bad = load(path), []
    for page in pages(root):
        if not page.exists():
            continue
        for m in MARKED.finditer(page.read_text(encoding="utf-8")):
            fig = figures.get(m["name"])
            if fig is None:
                bad.append(f"{page.relative_to(root)}: fig:{m['name']} is not in {path.name}")
            elif render(fig["value"], m["num"]) != m["num"]:
                bad.append(f"{page.relative_to(root)}: {m['num']} <- fig:{m['name']} is "
                           f"{fig['value']} ({fig.get('source', '?')})")
    return bad


def sync(root: Path = ROOT, path: Path = FIGURES) -> list[Path]:
    """Rewrite every marked number from the figures file; return the pages changed."""
    figures, changed = load(path), []

    def repl(m: re.Match) -> str:
        fig = figures.get(m["name"])
        num = m["num"] if fig is None else render(fig["value"], m["num"])
        return f"{num}<!-- fig:{m['name']} -->"

    for page in pages(root):
        if not page.exists():
            continue
        text = page.read_text(encoding="utf-8")
        new = MARKED.sub(repl, text)
        if new != text:
            page.write_text(new, encoding="utf-8")
            changed.append(page)
    return changed


def main(argv: list[str]) -> int:
    if argv[:1] == ["set"] and len(argv) == 3:
        record({argv[1]: float(argv[2])}, source="set by hand: python -m minserve.figures")
        return 0
    if argv[:1] == ["sync"]:
        for page in sync():
            print("updated", page.relative_to(ROOT))
        return 0
    if argv:
        print(__doc__.split("\n\n")[-2], file=sys.stderr)  # the usage
        return 2
    bad = disagreements()
    print("\n".join(bad) or "every marked figure agrees with docs/figures.json")
    return 1 if bad else 0
