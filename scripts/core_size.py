"""Count the engine core's lines of code (comments, docstrings and blank lines not counted).

    python scripts/core_size.py           # print the count, module by module
    python scripts/core_size.py --write   # ... and record it in docs/figures.json

The project's aim is an engine core (scheduler, policies, gates, cache, backends,
sampling) readable in an afternoon: around 2,000 lines of code. The README and
docs/architecture.md quote this script's count through docs/figures.json
(`core.code_lines`, `core.all_lines`; minserve/bench/figures.py), and
tests/test_docs_match_code.py fails when they disagree with a fresh count.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "minserve"
CORE = ["config.py", "request.py", "sampling.py", "policies.py", "fair.py", "gates.py",
        "kv_cache.py", "admission.py", "scheduler.py", "execute.py", "failures.py", "explain.py",
        "records.py", "streaming.py", "engine.py",
        "models.py",
        "backends/base.py", "backends/padded.py", "backends/paged.py", "backends/kv_storage.py",
        "backends/compact.py", "backends/decode_kernel.py"]


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


def core_size() -> tuple[int, int]:
    """(lines of code, all lines) of the engine core."""
    sizes = [code_lines(ROOT / name) for name in CORE]
    return sum(c for c, _ in sizes), sum(n for _, n in sizes)


if __name__ == "__main__":
    import sys

    for name in CORE:
        c, n = code_lines(ROOT / name)
        print(f"{name:28s} {c:5d} code / {n:5d} lines")
    total_code, total = core_size()
    print(f"{'engine core':28s} {total_code:5d} code / {total:5d} lines")
    if "--write" in sys.argv[1:]:
        from minserve.bench.figures import record

        record({"core.code_lines": total_code, "core.all_lines": total},
               source="python scripts/core_size.py --write")
