"""The folder layout is the architecture (STYLE 1): arrows point inward, no cycles.

The core is the modules at the package top plus `backends/`; the outer layers
are subpackages. Every `import` in the package (module level and inside
functions alike: a lazy import is still an arrow) is read with `ast`, resolved
to a module, and checked:

* the core imports no outer layer;
* each outer layer imports only what its `__init__` docstring allows;
* the module graph has no cycle (a package's `__init__` counts as a module).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "minserve"
OUTER = ("server", "inspection", "chat", "bench", "labs")
# what each outer layer may import besides the core and itself (its __init__ says why)
ALLOWED = {"server": set(), "inspection": set(), "chat": {"inspection", "server"}, "bench": {"chat"},
           "labs": {"bench"}}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """minserve modules that `name` imports, resolved to the most specific known module."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[:len(base) - node.level + 1]
                mod = ".".join(anchor + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` imports the submodule `pkg.sub` when there is one
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t.startswith("minserve") and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def layer(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in OUTER else "core"


def test_the_core_imports_no_outer_layer():
    bad = {(m, t) for m, ts in graph().items() if layer(m) == "core" and m != "minserve.__main__"
           for t in ts if layer(t) != "core"}
    assert not bad, f"core modules import outer layers: {sorted(bad)}"


@pytest.mark.parametrize("outer", OUTER)
def test_each_outer_layer_imports_only_what_its_init_allows(outer):
    allowed = {"core", outer} | ALLOWED[outer]
    bad = {(m, t) for m, ts in graph().items() if layer(m) == outer for t in ts
           if layer(t) not in allowed}
    assert not bad, f"{outer} imports {sorted(bad)}; its __init__ allows {sorted(allowed)}"
    doc = ast.get_docstring(ast.parse((PKG / outer / "__init__.py").read_text())) or ""
    assert "May import" in doc and "outer layer" in doc.lower(), \
        f"minserve/{outer}/__init__.py should say what it is and what it may import"


def test_there_is_no_import_cycle():
    g = graph()
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(g[m]):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)


def test_the_import_reader_sees_a_cycle_and_a_lazy_import(tmp_path, monkeypatch):
    """The checks above can fail: a two-module cycle through a function-level import."""
    pkg = tmp_path / "minserve"
    (pkg / "server").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import x\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "server" / "__init__.py").write_text("")
    (pkg / "c.py").write_text("def g():\n    from .server import api\n")
    (pkg / "server" / "api.py").write_text("")
    monkeypatch.setattr(__import__(__name__, fromlist=["PKG"]), "PKG", pkg)
    g = graph()
    assert g["minserve.a"] == {"minserve.b"} and g["minserve.b"] == {"minserve.a"}
    assert g["minserve.c"] == {"minserve.server.api"}
    with pytest.raises(AssertionError, match="cycle"):
        test_there_is_no_import_cycle()
    with pytest.raises(AssertionError, match="core modules import outer layers"):
        test_the_core_imports_no_outer_layer()
