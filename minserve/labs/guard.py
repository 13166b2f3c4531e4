"""No shortcut through the reference: a submission earns points only for its own code.

A student writes one piece the engine already has (a policy, the gates, a block manager's
methods, the chunk schedule). Subclassing the engine's class, wrapping it, delegating to it
or calling `super()` for the graded piece would pass every check while teaching nothing.
Two guards, both applied by `guarded_check`, which every lab check wears:

* `own_code`, before the check: the student's class or function must not be, subclass,
  copy or name the reference (its code's names are resolved in its globals and closure);
* `forbid_reference`, while the check runs: the reference's methods are swapped for
  guards that fail when called from anywhere but minserve itself, so a delegation found
  at run time (`self.inner.pick_next()`, `super()._take_block()`) fails too. The engine
  and the checks' stock engines keep using them freely.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Callable, Iterator, Sequence

from .common import (
    _is_engine_code,
    _is_library_code,
    fail,
    one_torch_thread,
    quiet_engine,
    time_limit,
)


@contextlib.contextmanager
def forbid_reference(pieces: Sequence[tuple], where: str) -> Iterator[None]:
    """While the block runs, the engine's own implementation of the graded piece refuses to
    be called from the student's code: each (owner, attribute names, label[, owner
    forbidden]) attribute is replaced by a guard that fails the check when its caller is
    not minserve itself. The engine and the checks' stock engines still use them freely; a
    wrapper, a delegation or a `super()` call from the submission earns a message instead
    of points. (References captured before the check are caught by `own_code`.)"""
    saved = []
    for owner, names, label, *_ in pieces:
        for attr in names:
            if attr not in owner.__dict__:
                continue
            original = owner.__dict__[attr]
            saved.append((owner, attr, original))
            setattr(owner, attr, _guarded(original, f"{label}.{attr}", where))
    try:
        yield
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)


def _unwrap(value):
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value


def _guarded(original, label: str, where: str):
    kind = type(original) if isinstance(original, (staticmethod, classmethod)) else None
    func = _unwrap(original)

    @functools.wraps(func)
    def guard(*args, **kwargs):
        caller = sys._getframe(1).f_code.co_filename
        if not _is_engine_code(caller) and not _is_library_code(caller):
            fail(f"your code calls minserve's own {label}: the graded piece must be your "
                 "implementation, not a subclass, wrapper or delegation to the engine's "
                 "(no points for it)", where)
        return func(*args, **kwargs)

    return kind(guard) if kind else guard


def _names_used(fn) -> list:
    """The objects a function's code (nested code included) names, resolved in its globals
    and closure."""
    code, stack, names = getattr(fn, "__code__", None), [], set()
    if code is None:
        return []
    stack.append(code)
    while stack:
        c = stack.pop()
        names |= set(c.co_names)
        stack += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    found = [fn.__globals__[n] for n in names if n in fn.__globals__]
    for cell in fn.__closure__ or ():
        with contextlib.suppress(ValueError):
            found.append(cell.cell_contents)
    return found


def own_code(piece, pieces: Sequence[tuple], name: str, where: str) -> None:
    """Fail if the student's class or function is the engine's reference in disguise: a
    subclass of it, a method copied from it, or code that names it."""
    forbidden = []
    for owner, attrs, label, *rest in pieces:
        if not rest or rest[0]:
            forbidden.append((owner, label))
        forbidden += [(_unwrap(owner.__dict__[a]), f"{label}.{a}") for a in attrs
                      if a in owner.__dict__]
    ids = {id(obj): label for obj, label in forbidden}

    def check(fn, what):
        fn = _unwrap(fn)
        if id(fn) in ids:
            fail(f"{what} is minserve's own {ids[id(fn)]}: write your own (no points for it)",
                 where)
        for obj in _names_used(fn) if isinstance(fn, types.FunctionType) else ():
            if id(obj) in ids:
                fail(f"{what} uses minserve's own {ids[id(obj)]}: the graded piece must be your "
                     "implementation, not a wrapper or delegation (no points for it)", where)

    if isinstance(piece, type):
        for owner, label in forbidden:
            if isinstance(owner, type) and piece is not owner and issubclass(piece, owner):
                fail(f"{name} subclasses minserve's own {label}: the graded piece must be your "
                     "implementation (subclass what the skeleton subclasses)", where)
        for attr, value in vars(piece).items():
            check(value, f"{name}.{attr}")
    elif callable(piece):
        check(piece, name)


def guarded_check(seconds: float, forbid: Callable[[], Sequence] = tuple, where: str = ""):
    """Decorate a lab check: bounded by `seconds`, engine logs quiet, one torch thread
    (common.one_torch_thread), the student's pieces (the check's class or function
    arguments) checked to be their own code, and the reference pieces `forbid()` names
    guarded while it runs (see forbid_reference)."""

    def wrap(check):
        @functools.wraps(check)
        def run(*args, **kwargs):
            pieces = forbid()
            for arg in args:
                if isinstance(arg, (type, types.FunctionType)):
                    own_code(arg, pieces, getattr(arg, "__name__", "your code"), where)
            with time_limit(seconds, check.__name__, where), quiet_engine(), \
                    forbid_reference(pieces, where), one_torch_thread():
                return check(*args, **kwargs)

        return run

    return wrap
