"""Count the engine core's lines of code (comments, docstrings and blank lines not counted).

    python scripts/core_size.py           # print the count, module by module
    python scripts/core_size.py --write   # ... and record it in docs/figures.json

The project's aim (STYLE 1) is an engine core readable in an afternoon: around 2,000
lines of code. The core is what STYLE names, "scheduler, policies, gates, cache,
backends, sampling", with the state they pass between them (config, request,
records) and the scheduler's own parts (admission, execute, failures): every module
at the package top and in `backends/`, except the engine's front.

    core     the design a student reads: nothing in it imports the front or an outer
             layer (tests/test_layout.py checks it), so it reads on its own
    front    FRONT below: the public surface (`minserve/__init__.py`), `Engine` (the
             composition root that builds a model, a backend, a policy and a
             scheduler from a config, and the worker thread), the streaming handles,
             where the model comes from, `explain`, and the command line
    fast     minserve/fast/: the compact forward, the C decode attention and the
             padded cache grown in place, which the engine hands the backends (the
             same results, faster)

The tiers are derived from the folders, not listed by hand, so a new module at the
package top is counted as core unless it is named in FRONT. The README and
docs/architecture.md quote the counts through docs/figures.json (`core.code_lines`,
`core.all_lines`, `front.code_lines`, `fast.code_lines`; minserve/figures/), and
tests/test_docs_match_code.py fails when they disagree with a fresh count.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "minserve"
# The engine's front: package-top modules that are not the design itself (see above).
FRONT = ("__init__.py", "__main__.py", "engine.py", "explain.py", "models.py", "spans.py",
         "streaming.py")
FAST = "fast"  # the subpackage of opt-in faster paths


def tiers() -> dict[str, list[str]]:
    """Module paths relative to minserve/, per tier (alphabetical within a folder)."""
    top = sorted(p.name for p in ROOT.glob("*.py"))
    backends = sorted(f"backends/{p.name}" for p in (ROOT / "backends").glob("*.py")
                      if p.name != "__init__.py")
    fast = sorted(f"{FAST}/{p.name}" for p in (ROOT / FAST).glob("*.py") if p.name != "__init__.py")
    return {"core": [n for n in top if n not in FRONT] + backends,
            "front": [n for n in top if n in FRONT], "fast": fast}


def code_lines(path: Path) -> tuple[int, int]:
    src = path.read_text()
    doc_lines: set[int] = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                doc_lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                            tokenize.DEDENT, tokenize.ENDMARKER):
            code.update(range(tok.start[0], tok.end[0] + 1))
    return len(code - doc_lines), len(src.splitlines())


def tier_size(tier: str) -> tuple[int, int]:
    """(lines of code, all lines) of one tier."""
    sizes = [code_lines(ROOT / name) for name in tiers()[tier]]
    return sum(c for c, _ in sizes), sum(n for _, n in sizes)


def figures() -> dict[str, int]:
    """What docs/figures.json records of these counts."""
    (core_code, core_all), (front_code, _), (fast_code, _) = (
        tier_size(t) for t in ("core", "front", "fast"))
    return {"core.code_lines": core_code, "core.all_lines": core_all,
            "front.code_lines": front_code, "fast.code_lines": fast_code}


if __name__ == "__main__":
    import sys

    for tier, names in tiers().items():
        for name in names:
            c, n = code_lines(ROOT / name)
            print(f"{name:28s} {c:5d} code / {n:5d} lines")
        c, n = tier_size(tier)
        print(f"{'= ' + tier:28s} {c:5d} code / {n:5d} lines\n")
    if "--write" in sys.argv[1:]:
        from minserve.figures import record

        record(figures(), source="python scripts/core_size.py --write")
