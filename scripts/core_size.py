"""Count the engine core's lines of code (comments, docstrings and blank lines not counted).

    python scripts/core_size.py

STYLE.md asks for an engine core (scheduler, policies, gates, cache, backends,
sampling) readable in an afternoon: about 2,000 lines of code. The README quotes
this script's figure.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "minserve"
CORE = ["config.py", "request.py", "sampling.py", "policies.py", "fair.py", "gates.py",
        "kv_cache.py", "scheduler.py", "explain.py", "records.py", "streaming.py", "engine.py",
        "models.py",
        "backends/base.py", "backends/padded.py", "backends/paged.py", "backends/kv_storage.py",
        "backends/compact.py"]


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


if __name__ == "__main__":
    total_code = total = 0
    for name in CORE:
        c, n = code_lines(ROOT / name)
        total_code, total = total_code + c, total + n
        print(f"{name:28s} {c:5d} code / {n:5d} lines")
    print(f"{'engine core':28s} {total_code:5d} code / {total:5d} lines")
