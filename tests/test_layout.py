"""The folder layout is the architecture (STYLE 1): arrows point inward, no cycles.

Three tiers, as scripts/core_size.py counts them (its `FRONT` is the one list):

    core     the modules at the package top plus `backends/`, but the front
    front    `FRONT`: the package's __init__, engine.py (the composition root),
             streaming, models, explain, the command line
    outer    the subpackages: server, inspection, chat, bench, peers, labs, figures, and fast
             (the faster parts the engine hands the backends) and disagg (the prefill
             worker the engine hands the scheduler)

Every `import` in the package (module level and inside functions alike: a lazy
import is still an arrow) is read with `ast`, resolved to a module, and checked:

* the core imports only the core: it reads on its own, without the front;
* the front imports the core, itself, `fast` and `disagg` (the engine builds its parts);
* each outer layer imports the core, the front and what its `__init__` allows (and a
  command, bench/cli.py, the experiments of the layer above that it lists);
* the module graph has no cycle (a package's `__init__` counts as a module).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from .conftest import load_script

PKG = Path(__file__).resolve().parents[1] / "minserve"
OUTER = ("server", "inspection", "chat", "bench", "peers", "labs", "figures", "fast", "disagg")
# what each outer layer may import besides the core, the front and itself (its __init__ says why)
ALLOWED = {"server": set(), "inspection": set(), "chat": {"inspection", "server"},
           "bench": {"chat", "fast", "figures"}, "peers": {"bench"}, "labs": {"bench"},
           "figures": set(), "fast": set(), "disagg": {"fast"}}
# A command lists what the layers declare. `minserve bench` (bench/cli.py) also lists the
# experiments peers/ declares (`serving`, minserve beside its peers; `served-token`,
# minserve serve timed with the peers' client): that one module may import those two
# modules of peers/, and nothing else of bench/ may.
COMMAND_EXTRA = {"minserve.bench.cli": {"minserve.peers.serving", "minserve.peers.served"}}


FRONT = {"minserve" if name == "__init__.py" else "minserve." + name.removesuffix(".py")
         for name in load_script("core_size").FRONT}


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
    if len(parts) > 1 and parts[1] in OUTER:
        return parts[1]
    return "front" if mod in FRONT else "core"


def test_the_core_imports_no_outer_layer():
    bad = {(m, t) for m, ts in graph().items() if layer(m) == "core"
           for t in ts if layer(t) != "core"}
    assert not bad, f"core modules import outer layers or the front: {sorted(bad)}"


def test_the_front_imports_the_core_the_fast_paths_and_the_prefill_worker_only():
    # (but the command line: `minserve serve` and `minserve bench` are the outer layers')
    bad = {(m, t) for m, ts in graph().items() if layer(m) == "front" and m != "minserve.__main__"
           for t in ts if layer(t) not in ("core", "front", "fast", "disagg")}
    assert not bad, f"the front imports {sorted(bad)}"
    assert {"minserve.engine", "minserve.streaming"} <= FRONT <= set(modules())


@pytest.mark.parametrize("outer", OUTER)
def test_each_outer_layer_imports_only_what_its_init_allows(outer):
    allowed = {"core", "front", outer} | ALLOWED[outer]
    bad = {(m, t) for m, ts in graph().items() if layer(m) == outer for t in ts
           if layer(t) not in allowed and t not in COMMAND_EXTRA.get(m, ())}
    assert not bad, f"{outer} imports {sorted(bad)}; its __init__ allows {sorted(allowed)}"
    doc = ast.get_docstring(ast.parse((PKG / outer / "__init__.py").read_text())) or ""
    assert "May import" in doc and "outer layer" in doc.lower(), \
        f"minserve/{outer}/__init__.py should say what it is and what it may import"


def test_a_command_allowance_is_still_used():
    """COMMAND_EXTRA names only imports that are there: no exemption outlives its reason."""
    g = graph()
    for command, extra in COMMAND_EXTRA.items():
        assert extra <= g.get(command, set()), f"{command} no longer imports {sorted(extra)}"


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
    """The checks above can fail: a two-module cycle through a function-level import, a
    core module that imports an outer layer, then one that imports the front."""
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
    # a core module that reaches for the front (the engine) fails as well
    (pkg / "c.py").write_text("from .engine import Engine\n")
    (pkg / "engine.py").write_text("from .server import api\n")
    assert graph()["minserve.c"] == {"minserve.engine"}
    with pytest.raises(AssertionError, match="or the front"):
        test_the_core_imports_no_outer_layer()
