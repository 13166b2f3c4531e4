"""What a graded cell may use, checked before it runs (SPEC L2).

A submission's graded cell is the only code of a notebook that grading runs (grading.py),
in a process of its own, after the checks are loaded. This module decides, from the
cell's source alone (its syntax tree), whether it may run at all: an allow-list, not a
list of known tricks. A cell may

* import the standard library's data structures and a few pure helpers (`ALLOWED_MODULES`)
  and the names its lab provides (its base class, the request type: `Cell.provided`);
* use Python's plain builtins (`ALLOWED_BUILTINS`: no `getattr`, `exec`, `open`, `type`,
  `vars`, `globals`, `__import__` ...);
* define classes and functions, with the special methods a class needs
  (`ALLOWED_DUNDER_DEFS`: no `__new__`, `__getattribute__`, `__init_subclass__` ...).

It may not touch a dunder attribute (`__class__`, `__globals__`, `__code__`,
`__subclasses__` ...) but `super().__init__`, nor frames, tracebacks or code objects
(`f_back`, `tb_frame`, `gi_frame`, `co_code` ...), nor an attribute of a module outside
that module's allow-list, nor bind a module or one of the lab's classes to another name
or change it (`Request.priority = ...`), nor call `super(...)` with arguments, nor reach
the reference's implementation of the piece through its base (`super().free`,
`BlockManager._take_block`). `except:` and `except BaseException` are refused too: they
would swallow the checks' own time limit.

A second layer when it runs (`safe_builtins`): the cell's globals hold only these
builtins and an `__import__` that imports only the allowed modules.

Everything else in a notebook is not run by grading; `scan_other_cell` still refuses the
constructs that only make sense as an attempt on the grader (importing sys, inspect, gc,
importlib, ctypes, builtins, otter; `sys.modules`, frames, code objects), so that such an
attempt costs the submission its points with a message instead of doing nothing.
"""

from __future__ import annotations

import ast
import builtins
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# ------------------------------------------------------------------ what is allowed
ALLOWED_MODULES: dict[str, frozenset[str] | None] = {
    # module -> attributes a cell may use (None: every public name)
    "collections": frozenset({"deque", "defaultdict", "OrderedDict", "Counter", "namedtuple"}),
    "heapq": None, "bisect": None, "itertools": None, "math": None,
    "functools": frozenset({"cmp_to_key", "total_ordering", "lru_cache", "cache", "reduce",
                            "partial", "cached_property"}),
    "dataclasses": frozenset({"dataclass", "field", "replace"}),
    "typing": frozenset({"Any", "Optional", "Union", "List", "Dict", "Tuple", "Set",
                         "Iterator", "Iterable", "Callable", "NamedTuple", "Deque",
                         "DefaultDict", "Sequence", "Mapping", "FrozenSet"}),
    "collections.abc": frozenset({"Iterator", "Iterable", "Callable", "Sequence", "Mapping"}),
}
# lab 4's tensors: what its three functions need, no more (no torch.load, torch.ops ...)
TORCH = frozenset({
    "tensor", "as_tensor", "zeros", "ones", "zeros_like", "ones_like", "full", "full_like",
    "empty", "cat", "stack", "arange", "where", "cumsum", "sum", "nonzero", "argmax", "argmin",
    "max", "min", "flip", "clamp", "long", "int64", "int32", "int", "bool", "float",
    "float32", "eq", "ne", "gt", "ge", "lt", "le", "count_nonzero", "any", "all", "Tensor",
    "nn", "nn.functional", "nn.functional.pad", "logical_not", "diff"})
TORCH_F = frozenset({"pad"})

ALLOWED_BUILTINS = frozenset({
    "abs", "all", "any", "bool", "callable", "chr", "dict", "divmod", "enumerate", "filter",
    "float", "format", "frozenset", "hasattr", "hash", "id", "int", "isinstance",
    "issubclass", "iter", "len", "list", "map", "max", "min", "next", "object", "ord", "pow",
    "print", "property", "range", "repr", "reversed", "round", "set", "slice", "sorted",
    "staticmethod", "classmethod", "str", "sum", "super", "tuple", "zip", "NotImplemented",
    "Ellipsis", "Exception", "ArithmeticError", "AssertionError", "AttributeError",
    "IndexError", "KeyError", "LookupError", "NotImplementedError", "RuntimeError",
    "StopIteration", "TypeError", "ValueError", "ZeroDivisionError", "OverflowError",
    "getattr", "setattr", "delattr"})  # these three only with a constant, allowed name
ATTR_BUILTINS = frozenset({"getattr", "setattr", "delattr"})
ALLOWED_DUNDER_DEFS = frozenset({
    "__init__", "__repr__", "__str__", "__len__", "__iter__", "__next__", "__contains__",
    "__getitem__", "__setitem__", "__delitem__", "__lt__", "__le__", "__gt__", "__ge__",
    "__eq__", "__ne__", "__hash__", "__bool__", "__post_init__"})
# attribute names no cell needs and a grader-reaching trick does
FORBIDDEN_ATTRS = frozenset({"mro", "numpy", "tofile", "save", "load", "storage",
                             "untyped_storage", "data_ptr", "from_file", "register_hook",
                             "with_traceback", "modules", "_getframe"})
FORBIDDEN_ATTR_PREFIXES = ("f_", "co_", "gi_", "cr_", "ag_", "tb_", "func_")
# what no other cell of a lab notebook needs, and an attempt on the grader does
GRADER_MODULES = frozenset({"sys", "inspect", "gc", "types", "importlib", "ctypes", "builtins",
                            "otter", "pytest", "traceback", "marshal", "pickle", "dill",
                            "runpy", "code", "codeop", "os", "subprocess", "signal"})
GRADER_ATTRS = frozenset({"__code__", "__globals__", "__subclasses__", "__builtins__",
                          "__closure__", "__func__", "__self__", "__dict__", "__mro__",
                          "_getframe", "f_back", "f_globals", "f_locals", "tb_frame",
                          "gi_frame", "modules"})


@dataclass(frozen=True)
class Cell:
    """What a lab's graded cell defines and what it is given.

    names: what it must define (the piece: a class, or functions);
    provided: name -> object the lab's earlier cells give it (its base class, the request
        type, torch ...); these may be imported again from `imports`;
    imports: module -> names of the engine a cell may import (what `provided` holds);
    modules: the provided names that are modules, with the attributes a cell may use;
    reference: (base class name, methods) the cell must write itself, never reach through
        its base (`super().free`, `BlockManager._take_block`)."""

    names: tuple[str, ...]
    provided: Callable[[], dict[str, Any]]
    imports: Mapping[str, frozenset[str]] = field(default_factory=dict)
    modules: Mapping[str, frozenset[str]] = field(default_factory=dict)
    reference: tuple[str, frozenset[str]] | None = None
    module_imports: Mapping[str, tuple[str, frozenset[str]]] = field(default_factory=dict)
    # e.g. {"torch": ("torch", TORCH), "torch.nn.functional": ("F", TORCH_F)}


@dataclass(frozen=True)
class Violation:
    line: int
    what: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.what}"


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__") and len(name) > 4


def _bound_names(tree: ast.AST) -> set[str]:
    """Every name the cell binds anywhere (assignments, defs, parameters, imports, loop
    and comprehension targets, except-as, with-as, walrus): flow-insensitive on purpose."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            names.update(node.names)
    return names


class _Checker(ast.NodeVisitor):
    def __init__(self, cell: Cell, what: str) -> None:
        self.cell, self.what = cell, what
        self.found: list[Violation] = []
        self.modules: dict[str, frozenset[str] | None] = {}  # local name -> allowed attrs
        self.engine: set[str] = set()  # local names of the lab's provided classes/functions
        self.classes: set[str] = set()
        for name, obj in cell.provided().items():
            if isinstance(obj, types.ModuleType):
                self.modules[name] = cell.modules.get(name, frozenset())
            else:
                self.engine.add(name)
        self.parents: dict[int, ast.AST] = {}

    def bad(self, node: ast.AST, what: str) -> None:
        self.found.append(Violation(getattr(node, "lineno", 0), what))

    def run(self, tree: ast.AST) -> list[Violation]:
        for parent in ast.walk(tree):
            for child in ast.iter_child_nodes(parent):
                self.parents[id(child)] = parent
        self.bound = _bound_names(tree)
        self.classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        self.visit(tree)
        return self.found

    # --- imports
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            local = alias.asname or alias.name.split(".")[0]
            if alias.name in self.cell.module_imports:
                self.modules[local] = self.cell.module_imports[alias.name][1]
                if alias.asname is None and "." in alias.name:
                    self.bad(node, f"`import {alias.name}`: write `import {alias.name} as "
                                   f"{self.cell.module_imports[alias.name][0]}`")
            elif alias.name in ALLOWED_MODULES and (alias.asname or "." not in alias.name):
                self.modules[local] = ALLOWED_MODULES[alias.name]
            else:
                self.bad(node, f"`import {alias.name}` is not allowed in {self.what} (it may "
                               f"import {', '.join(sorted(ALLOWED_MODULES))})")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level:
            self.bad(node, "a relative import is not allowed")
            return
        for alias in node.names:
            name, local = alias.name, alias.asname or alias.name
            if name == "*":
                self.bad(node, f"`from {module} import *` is not allowed")
            elif module in self.cell.imports and name in self.cell.imports[module]:
                self.engine.add(local)
            elif module in ALLOWED_MODULES and not name.startswith("_") and (
                    ALLOWED_MODULES[module] is None or name in ALLOWED_MODULES[module]):
                pass
            elif module.split(".")[0] == "minserve" or module in self.cell.imports:
                self.bad(node, f"`from {module} import {name}`: the engine's own code is not "
                               f"allowed in {self.what}, only "
                               f"{self._engine_names() or 'the standard library'}; the graded "
                               "piece must be your implementation")
            else:
                self.bad(node, f"`from {module} import {name}` is not allowed in {self.what} "
                               f"(it may import {', '.join(sorted(ALLOWED_MODULES))})")

    def _engine_names(self) -> str:
        return ", ".join(f"{n} from {m}" for m, names in self.cell.imports.items()
                         for n in sorted(names))

    # --- names
    def visit_Name(self, node: ast.Name) -> None:
        name = node.id
        parent = self.parents.get(id(node))
        if _dunder(name) and not (name == "__slots__" and isinstance(node.ctx, ast.Store)):
            self.bad(node, f"`{name}` is not allowed in {self.what}")
        elif isinstance(node.ctx, ast.Load):
            if name in ATTR_BUILTINS and name not in self.bound and not (
                    isinstance(parent, ast.Call) and parent.func is node):
                self.bad(node, f"`{name}` may only be called, with a constant attribute name")
            elif name in self.modules and name not in self.bound - set(self.modules):
                if not isinstance(parent, ast.Attribute):
                    self.bad(node, f"the module `{name}` may only be used as `{name}.<name>`, "
                                   "not passed around or stored")
            elif name in self.engine and name not in (self.bound - self.engine):
                if not self._engine_use_ok(node, parent):
                    self.bad(node, f"`{name}` may only be called, subclassed, caught, raised "
                                   "or used in isinstance and annotations, not stored, passed "
                                   "around or changed")
            elif name not in self.bound and name not in ALLOWED_BUILTINS \
                    and name not in self.modules and name not in self.engine:
                if hasattr(builtins, name):
                    self.bad(node, f"the builtin `{name}` is not allowed in {self.what}")
                else:
                    self.bad(node, f"`{name}` is not defined in {self.what} (grading runs "
                                   "this cell alone: define what it uses in it)")
        self.generic_visit(node)

    def _engine_use_ok(self, node: ast.Name, parent: ast.AST | None) -> bool:
        if isinstance(parent, ast.Call) and parent.func is node:
            return True
        if isinstance(parent, ast.ClassDef) and node in parent.bases:
            return True
        if isinstance(parent, ast.ExceptHandler) or isinstance(parent, ast.Raise):
            return True
        if isinstance(parent, ast.Tuple):  # isinstance(x, (A, B)), except (A, B)
            return self._engine_use_ok(parent, self.parents.get(id(parent)))  # type: ignore[arg-type]
        if isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and \
                parent.func.id in ("isinstance", "issubclass") and node in parent.args[1:]:
            return True
        if isinstance(parent, ast.Attribute):  # Request.x: read below (visit_Attribute)
            return isinstance(parent.ctx, ast.Load)
        # annotations: arguments, returns, annotated assignments (and inside them)
        cur, up = node, parent
        while up is not None:
            if isinstance(up, ast.arg) and up.annotation is cur:
                return True
            if isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)) and up.returns is cur:
                return True
            if isinstance(up, ast.AnnAssign) and up.annotation is cur:
                return True
            if isinstance(up, (ast.Subscript, ast.BinOp, ast.Tuple, ast.Attribute)):
                cur, up = up, self.parents.get(id(up))
                continue
            return False
        return False

    # --- attributes
    def visit_Attribute(self, node: ast.Attribute) -> None:
        attr = node.attr
        if _dunder(attr):
            ok = attr == "__init__" and isinstance(node.value, ast.Call) and \
                isinstance(node.value.func, ast.Name) and node.value.func.id == "super"
            if not ok:
                self.bad(node, f"`.{attr}` is not allowed in {self.what}: a dunder attribute "
                               "(only `super().__init__` is)")
        elif attr in FORBIDDEN_ATTRS or attr.startswith(FORBIDDEN_ATTR_PREFIXES):
            self.bad(node, f"`.{attr}` is not allowed in {self.what}")
        chain = self._chain(node)
        if chain and chain[0] in self.modules and chain[0] not in (self.bound - set(self.modules)):
            allowed = self.modules[chain[0]]
            dotted = ".".join(chain[1:])
            parent = self.parents.get(id(node))
            inner = isinstance(parent, ast.Attribute) and parent.value is node
            if allowed is None:
                ok = not any(part.startswith("_") for part in chain[1:])
            else:
                ok = dotted in allowed or (inner and any(a.startswith(dotted + ".")
                                                         for a in allowed))
            if not ok:
                self.bad(node, f"`{chain[0]}.{dotted}` is not allowed in {self.what}"
                         + (f" (of {chain[0]} it may use {', '.join(sorted(allowed))})"
                            if allowed else ""))
            if not isinstance(node.ctx, ast.Load):
                self.bad(node, f"`{chain[0]}.{dotted}` may not be changed")
        elif chain and chain[0] in self.engine and chain[0] not in (self.bound - self.engine):
            self.bad(node, f"`{chain[0]}.{attr}`: an attribute of the engine's "
                           f"`{chain[0]}` is not allowed in {self.what} (use your own object: "
                           "`self.`...)")
        ref = self.cell.reference
        if ref and attr in ref[1] and isinstance(node.value, ast.Call) and \
                isinstance(node.value.func, ast.Name) and node.value.func.id == "super":
            self.bad(node, f"`super().{attr}` calls the engine's own {ref[0]}.{attr}: the graded "
                           "method must be your implementation")
        if not isinstance(node.ctx, ast.Load):
            root = self._root(node)
            if root is None:
                self.bad(node, "an attribute may only be set on a name (`self.x = ...`)")
        self.generic_visit(node)

    @staticmethod
    def _chain(node: ast.AST) -> list[str]:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name):
            return [node.id, *reversed(parts)]
        return []

    @staticmethod
    def _root(node: ast.AST) -> str | None:
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    # --- calls, definitions, handlers
    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id == "super" and (node.args or node.keywords):
            self.bad(node, "`super(...)` with arguments is not allowed: write `super()`")
        if isinstance(node.func, ast.Name) and node.func.id in ATTR_BUILTINS \
                and node.func.id not in self.bound:
            name = node.args[1] if len(node.args) > 1 else None
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                self.bad(node, f"`{node.func.id}` is allowed only with a constant attribute name "
                               f"(`{node.func.id}(self, \"name\", ...)`)")
            elif _dunder(name.value) or name.value in FORBIDDEN_ATTRS or \
                    name.value.startswith(FORBIDDEN_ATTR_PREFIXES):
                self.bad(node, f"`{node.func.id}(..., {name.value!r})` is not allowed in {self.what}")
            elif self._root(node.args[0]) in self.modules or self._root(node.args[0]) in self.engine:
                self.bad(node, f"`{node.func.id}` on a module or on the engine's classes is not "
                               "allowed")
        self.generic_visit(node)

    def _def(self, node) -> None:
        if _dunder(node.name) and node.name not in ALLOWED_DUNDER_DEFS:
            self.bad(node, f"defining `{node.name}` is not allowed in {self.what} (a class here "
                           f"needs at most {', '.join(sorted(ALLOWED_DUNDER_DEFS))})")
        self.generic_visit(node)

    visit_FunctionDef = visit_AsyncFunctionDef = _def

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        if node.keywords:
            self.bad(node, "a class with keywords (a metaclass) is not allowed")
        self._def(node)

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        names = []
        if node.type is None:
            self.bad(node, "a bare `except:` is not allowed (it would catch the checks' own "
                           "time limit): catch the exceptions you expect")
        else:
            names = [n.id for n in ast.walk(node.type) if isinstance(n, ast.Name)]
        if "BaseException" in names:
            self.bad(node, "`except BaseException` is not allowed: catch the exceptions you expect")
        self.generic_visit(node)


def check_cell(source: str, cell: Cell, what: str = "the graded cell") -> list[Violation]:
    """Why `source` may not run as a graded cell (empty: it may)."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        return [Violation(e.lineno or 0, f"a syntax error: {e.msg}")]
    found = _Checker(cell, what).run(tree)
    missing = [n for n in cell.names if n not in _top_level_names(tree)]
    if missing:
        found.append(Violation(0, f"{what} does not define {', '.join(missing)}"))
    return sorted(set(found), key=lambda v: v.line)


def _top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def scan_other_cell(source: str, lab_names: Iterable[str] = ()) -> list[Violation]:
    """What, in a cell grading does not run, can only be an attempt on the grader.
    `lab_names`: names other cells of the notebook imported from minserve (the checks'
    modules: changing one of their attributes is an attempt too)."""
    try:
        tree = ast.parse(_no_magics(source))
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in GRADER_MODULES:
                    found.append(Violation(node.lineno, f"`import {alias.name}`"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in GRADER_MODULES:
            found.append(Violation(node.lineno, f"`from {node.module} import ...`"))
        elif isinstance(node, ast.Attribute) and node.attr in GRADER_ATTRS:
            found.append(Violation(node.lineno, f"`.{node.attr}`"))
        elif isinstance(node, ast.Name) and node.id in ("__import__", "__builtins__", "exec",
                                                         "eval", "compile", "globals"):
            found.append(Violation(node.lineno, f"`{node.id}`"))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and \
                        t.value.id in _lab_module_names(tree) | set(lab_names):
                    found.append(Violation(node.lineno, f"changing `{t.value.id}.{t.attr}` (the "
                                                        "lab's checks)"))
    return found


def minserve_names(source: str) -> set[str]:
    """The names a cell imports from minserve (for scan_other_cell's other cells)."""
    try:
        return _lab_module_names(ast.parse(_no_magics(source)))
    except SyntaxError:
        return set()


def _lab_module_names(tree: ast.AST) -> set[str]:
    """Local names of modules imported from minserve (the checks, the engine)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minserve"):
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names
                         if a.name.startswith("minserve"))
    return names


def _no_magics(source: str) -> str:
    """IPython's `%magic` and `!shell` lines as comments (the rest is Python)."""
    return "\n".join("#" + line if line.lstrip().startswith(("%", "!")) else line
                     for line in source.splitlines())


# ------------------------------------------------------------------ the second layer
def safe_builtins(allowed_imports: Iterable[str]) -> dict[str, Any]:
    """The builtins a graded cell runs with: the allowed ones, what `class` needs, and an
    `__import__` that imports only `allowed_imports` (and their submodules' parents)."""
    allowed = set(allowed_imports)
    real_import = builtins.__import__

    def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level or (name not in allowed and not any(a.startswith(name + ".") for a in allowed)):
            raise ImportError(f"import of {name} is not allowed in a graded cell")
        return real_import(name, globals, locals, fromlist, level)

    safe = {name: getattr(builtins, name) for name in ALLOWED_BUILTINS}
    safe["__build_class__"] = builtins.__build_class__
    safe["__import__"] = guarded_import
    safe["__name__"] = "builtins"
    return safe
