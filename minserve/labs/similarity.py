"""How much of a graded cell is the engine's own code, renamed (SPEC L3).

A student may copy the engine's implementation of the piece (the wheel they install holds
it) and rename its variables: it passes every check, since it is correct. Grading cannot
tell a copy from an honest answer by behaviour, so it measures and reports, for a person
to look at: the share of the cell's fingerprints that the engine's implementation of the
piece also has.

The method is copydetect's (Moss's winnowing, Schleimer, Wilkerson and Aiken, SIGMOD 2003)
over a normalised token stream: the code is parsed and printed again without its
annotations, docstrings, comments and layout (`ast.unparse`), then every name becomes
`V` and every string `S`; keywords and operators stay. Renaming, re-spacing,
re-commenting and adding or dropping type hints change nothing. k-grams of `K` tokens are hashed, and winnowing keeps the least hash of each
window of `WINDOW` k-grams: any shared run of at least K + WINDOW - 1 tokens is found.
(copydetect itself imports matplotlib for its HTML reports, seconds of every grading
process for a function of sixty lines.)

    share = |fingerprints(cell) & fingerprints(engine's piece)| / |fingerprints(cell)|

A share of `THRESHOLD` or more is flagged (a lab module may set its own
`SIMILARITY_THRESHOLD`; None: measured, never flagged). Short pieces written honestly can
be close to the engine's: lab 5's methods are a few lines each and there are few ways to
write them (honest answers measure up to about 0.65), and lab 2's gates are three `if`s
each, the same tokens whoever writes them (honest answers up to 0.98), so lab 2 is
measured but not flagged. A flag asks a person to look; it is not a verdict.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import io
import keyword
import textwrap
import tokenize

K = 12  # tokens per k-gram: a shared run shorter than this is noise (`for x in range(`)
WINDOW = 6  # k-grams per winnowing window: shared runs of K + WINDOW - 1 = 17 tokens are found
THRESHOLD = 0.8  # renamed copies measured 0.94; honest corpus answers at most 0.64 (lab 5)


class _Plain(ast.NodeTransformer):
    """Drops what does not change what code does: annotations and docstrings."""

    def visit_arg(self, node: ast.arg) -> ast.arg:
        node.annotation = None
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign):
        if node.value is None:
            return None
        return ast.copy_location(ast.Assign(targets=[node.target], value=node.value), node)

    def _body(self, node):
        self.generic_visit(node)
        if hasattr(node, "returns"):
            node.returns = None
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = visit_Module = _body


def plain(source: str) -> str:
    """The source printed again from its syntax tree, without annotations and docstrings
    (unchanged if it does not parse)."""
    try:
        tree = _Plain().visit(ast.parse(textwrap.dedent(source)))
        return ast.unparse(ast.fix_missing_locations(tree))
    except (SyntaxError, ValueError):
        return source


def tokens(source: str) -> list[str]:
    """The normalised token stream of `plain(source)`: names -> V, strings -> S, numbers,
    keywords and operators kept, comments and layout dropped."""
    out = []
    try:
        stream = list(tokenize.generate_tokens(io.StringIO(plain(source)).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return source.split()
    prev = None
    for tok in stream:
        if tok.type == tokenize.NAME:
            out.append(tok.string if keyword.iskeyword(tok.string) else "V")
        elif tok.type == tokenize.STRING:
            if prev in (None, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.NL):
                prev = tok.type
                continue  # a docstring or a bare string statement: not code
            out.append("S")
        elif tok.type in (tokenize.OP, tokenize.NUMBER):
            out.append(tok.string)
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            prev = tok.type
    return out


def fingerprints(source: str) -> set[int]:
    """Winnowed hashes of the normalised token stream's k-grams."""
    toks = tokens(source)
    grams = [int.from_bytes(hashlib.blake2b(" ".join(toks[i:i + K]).encode(),
                                            digest_size=8).digest(), "big")
             for i in range(len(toks) - K + 1)]
    if len(grams) <= WINDOW:
        return set(grams)
    return {min(grams[i:i + WINDOW]) for i in range(len(grams) - WINDOW + 1)}


def share(cell: str, engine: str) -> float:
    """The share of the cell's fingerprints that the engine's code also has (0..1)."""
    mine = fingerprints(cell)
    return len(mine & fingerprints(engine)) / len(mine) if mine else 0.0


def engine_source(lab: str) -> str:
    """The engine's implementation of the lab's piece, as source (what a copy copies)."""

    parts = []
    for owner, attrs, *_ in engine_pieces(lab):
        for attr in attrs:
            obj = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
            obj = getattr(obj, "__func__", obj)
            if obj is not None and (inspect.isfunction(obj) or inspect.isclass(obj)):
                parts.append(inspect.getsource(obj))
    return "\n\n".join(parts)


def engine_pieces(lab: str) -> list:
    """(owner, attribute names, ...) of the engine's code for the lab's piece: the lab
    module's ENGINE_CODE, else what its guard forbids (`reference`)."""
    from .common import lab_module

    module = lab_module(lab)
    return (module.ENGINE_CODE if hasattr(module, "ENGINE_CODE") else module.reference)()


def similarity_report(lab: str, cell: str) -> dict:
    """{"share": 0..1, "flagged": bool, "threshold", "of": what it was compared with}."""
    from .common import lab_module

    value = round(share(cell, engine_source(lab)), 2)
    threshold = getattr(lab_module(lab), "SIMILARITY_THRESHOLD", THRESHOLD)
    names = sorted({getattr(o, "__name__", str(o)) for o, *_ in engine_pieces(lab)})
    return {"share": value, "flagged": threshold is not None and value >= threshold,
            "threshold": threshold, "of": ", ".join(names)}
