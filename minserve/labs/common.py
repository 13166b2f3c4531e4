"""What every lab check shares: the failure type, the tiny engine, running student code
safely (bounded in time, quiet, with a crash turned into one message), and the guard
that keeps the engine's own implementation of the graded piece out of a submission."""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from ..config import EngineConfig
from ..engine import Engine
from ..request import Request
from ..sampling import SamplingParams

PACKAGE = Path(__file__).resolve().parents[1]  # .../minserve: the engine's own code


class LabCheckFailed(AssertionError):
    """A lab check failed. The message says what is wrong and where to look."""


def fail(what: str, where: str) -> NoReturn:
    raise LabCheckFailed(f"{what}\n    where to look: {where}")


# ------------------------------------------------------------------ describing student inputs
def show(value: Any, limit: int = 90) -> str:
    """A short, readable form of an input: a tensor's shape and (small) values, a request's
    numbers, anything else as a clipped repr."""
    if isinstance(value, Request):
        return (f"Request({value.request_id!r}, session={value.session_id!r}, priority="
                f"{value.priority}, prompt_len={value.prompt_len}, max_tokens={value.max_tokens}, "
                f"num_computed_prompt_tokens={value.num_computed_prompt_tokens})")
    if hasattr(value, "shape") and hasattr(value, "tolist"):  # a tensor
        text = f"tensor of shape {tuple(value.shape)}"
        return text + (f" {value.tolist()}" if value.numel() <= 40 else "")
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_engine_code(filename: str) -> bool:
    return Path(filename).resolve().is_relative_to(PACKAGE) if filename[:1] not in "<" else False


def _is_library_code(filename: str) -> bool:
    return filename.startswith((sys.prefix, sys.base_prefix)) or "site-packages" in filename


def student_frame(exc: BaseException):
    """The innermost traceback frame of the student's own code (neither minserve nor an
    installed library): the function that broke, or None."""
    found = None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        name = frame.f_code.co_filename
        if not _is_engine_code(name) and not _is_library_code(name):
            found = frame
    return found


def describe_crash(exc: BaseException, name: str) -> str:
    """One line: which of the student's functions raised what, on which input."""
    frame = student_frame(exc)
    head = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if frame is None:
        return f"{name} raised {head}"
    code = frame.f_code
    args = [a for a in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount] if a != "self"]
    inputs = ", ".join(f"{a}={show(frame.f_locals.get(a))}" for a in args)
    return f"your {code.co_name}({inputs}) raised {head} (line {frame.f_lineno} of your code)"


def student(fn: Callable, *args, name: str, where: str, **kwargs) -> Any:
    """Call the student's `fn`. A stub still raising NotImplementedError becomes a failed
    check that names it; any other exception becomes one message naming the student's
    function and the input that broke it (no traceback wall)."""
    try:
        return fn(*args, **kwargs)
    except LabCheckFailed:
        raise
    except NotImplementedError as e:
        stub = str(e).split(":")[0].strip() or name  # the stub's message starts with its name
        fail(f"{stub} is still the stub ({e or 'NotImplementedError'}): write it first", where)
    except RecursionError as e:
        fail(f"{name} recursed without end ({e})", where)
    except Exception as e:  # noqa: BLE001 - the student's crash, as one message
        fail(describe_crash(e, name), where)


# ------------------------------------------------------------------ bounded, quiet checks
@contextlib.contextmanager
def time_limit(seconds: float, what: str, where: str) -> Iterator[None]:
    """Fail (instead of hanging a grading kernel) if the block runs longer than `seconds`:
    a queue that never empties, a loop that never ends. SIGALRM, so only on the main
    thread (where Jupyter, otter and pytest run tests); elsewhere the block is unbounded."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum, frame):
        fail(f"{what} did not finish within {seconds:g} s: a loop that never ends (a queue "
             "that never empties, a pick that removes nothing, a block chain that cycles?)",
             where)

    old = signal.signal(signal.SIGALRM, expire)
    started = time.monotonic()
    previous = signal.setitimer(signal.ITIMER_REAL, seconds)[0]
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if previous:  # an outer limit was running: give it back what is left of it
            signal.setitimer(signal.ITIMER_REAL, max(1e-3, previous - (time.monotonic() - started)))


class CrashRecorder(logging.Handler):
    """Keeps the exceptions of the rows the engine failed (it logs each with exc_info)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.crashes: list[BaseException] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            self.crashes.append(record.exc_info[1])


@contextlib.contextmanager
def quiet_engine() -> Iterator[CrashRecorder]:
    """The engine logs each failed row with its traceback (useful when serving); inside a
    check the log goes to a recorder instead (no wall of tracebacks above the results),
    and `drain` turns the recorded crash into one message."""
    log = logging.getLogger("minserve")
    saved = log.handlers, log.propagate, log.level
    recorder = CrashRecorder()
    log.handlers, log.propagate = [recorder], False
    log.setLevel(logging.ERROR)
    try:
        yield recorder
    finally:
        log.handlers, log.propagate = saved[0], saved[1]
        log.setLevel(saved[2])


def last_crash() -> BaseException | None:
    """The last row crash recorded by an enclosing quiet_engine(), if any."""
    for h in logging.getLogger("minserve").handlers:
        if isinstance(h, CrashRecorder) and h.crashes:
            return h.crashes[-1]
    return None


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
    """Decorate a lab check: bounded by `seconds`, engine logs quiet, the student's pieces
    (the check's class or function arguments) checked to be their own code, and the
    reference pieces `forbid()` names guarded while it runs (see forbid_reference)."""

    def wrap(check):
        @functools.wraps(check)
        def run(*args, **kwargs):
            pieces = forbid()
            for arg in args:
                if isinstance(arg, (type, types.FunctionType)):
                    own_code(arg, pieces, getattr(arg, "__name__", "your code"), where)
            with time_limit(seconds, check.__name__, where), quiet_engine(), \
                    forbid_reference(pieces, where):
                return check(*args, **kwargs)

        return run

    return wrap


# ------------------------------------------------------------------ the tiny engine
@functools.lru_cache(maxsize=1)
def tiny_model():
    """The random 2-layer Llama of the tests (vocab 256, no EOS: every row runs to max_tokens)."""
    from ..models import tiny_llama

    return tiny_llama()


def tiny_engine(**cfg) -> Engine:
    """A step-mode engine on the tiny model, on the CPU, recording every tick in `trace`."""
    cfg.setdefault("device", "cpu")
    engine = Engine(EngineConfig(**cfg), model=tiny_model())
    engine.trace = []
    return engine


def make_req(i: int, session: str = "default", prompt: int = 4, out: int = 4,
             priority: int = 0, tokens: Sequence[int] | None = None) -> Request:
    """A request built by hand, for checks that call a policy's hooks directly."""
    ids = list(tokens) if tokens is not None else [1 + (i + k) % 200 for k in range(prompt)]
    return Request(request_id=f"{session}-{i}", prompt_token_ids=ids,
                   sampling=SamplingParams(max_tokens=out), arrival_seq=i,
                   session_id=session, priority=priority)


def drain(engine: Engine, where: str, max_ticks: int = 2_000, ticks: int | None = None) -> list:
    """Tick until idle (or `ticks` ticks), checking the engine's invariants after every
    tick. A broken invariant, a crash or a row that failed becomes one LabCheckFailed
    naming the tick and, when the student's code raised, their function and its input."""
    s = engine.scheduler
    for n in range(max_ticks):
        if not s.has_work() or n == ticks:
            return engine.trace
        try:
            rec = engine.step()
        except LabCheckFailed:
            raise
        except NotImplementedError as e:
            fail(f"tick {s.tick_count + 1}: the engine called a stub: {e}", where)
        except Exception as e:  # noqa: BLE001 - one message, not a traceback
            fail(f"tick {s.tick_count + 1}: {describe_crash(e, 'the engine')}", where)
        failed = rec.admit.failed + rec.prefill.failed + rec.decode.failed
        if failed:
            crash = last_crash()
            if isinstance(crash, LabCheckFailed):  # a check inside the engine already said it
                raise LabCheckFailed(f"tick {rec.tick}: {crash}") from None
            why = failed[0]["error"]
            if crash is not None and student_frame(crash) is not None:
                why = describe_crash(crash, "your code")
            fail(f"tick {rec.tick}: {failed[0]['request_id']} failed inside the real engine: "
                 f"{why}", where)
        try:
            s.check_invariants()
        except AssertionError as e:
            fail(f"tick {rec.tick}: an engine invariant broke: {e or type(e).__name__}", where)
    fail(f"the engine did not drain in {max_ticks} ticks: something never gets admitted "
         "or never finishes", where)


def admission_order(trace) -> list[str]:
    """Request ids in the order T1 admitted them, across a recorded trace."""
    return [a["request_id"] for rec in trace for a in rec.admit.admitted]


def stock_tokens(plan: Sequence[tuple[list[int], int]], **cfg) -> list[list[int]]:
    """Greedy tokens of each (prompt, max_tokens) on a stock engine (whose tokens equal HF
    generate on each prompt alone): what a correct piece must reproduce."""
    engine = tiny_engine(**cfg)
    outs = engine.generate([p for p, _ in plan], [SamplingParams(max_tokens=n) for _, n in plan])
    return [o.token_ids for o in outs]
