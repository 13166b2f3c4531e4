"""What every lab check shares: the failure type, the tiny engine, running student code
safely (bounded in time, quiet, with a crash turned into one message). The guard that
keeps the engine's own implementation out of a submission is guard.py."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import random
import signal
import sys
import threading
import time
import traceback
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

    def _render_traceback_(self) -> list[str]:
        """What Jupyter shows for it (IPython's hook for exceptions that render themselves):
        the message alone, not a wall of frames through the checks, when a cell that runs a
        check (a demo cell after a failed one) raises it."""
        return [f"LabCheckFailed: {self}"]


def fail(what: str, where: str) -> NoReturn:
    raise LabCheckFailed(f"{what}\n    where to look: {where}")


# ------------------------------------------------------------------ the labs
LABS = {"lab1_fcfs": "fcfs", "lab2_gates": "gates", "lab3_vtc": "vtc", "lab4_padded": "padded",
        "lab5_blocks": "blocks", "lab6_chunked": "chunked", "lab7_capstone": "capstone"}


def lab_module(lab: str):
    """A lab's module of checks (its CELL, its reference, its hidden checks)."""
    import importlib

    return importlib.import_module(f"minserve.labs.{LABS[lab]}")


# ------------------------------------------------------------------ the instructor's secret
def secret_rng(secret: str | int, label: str) -> random.Random:
    """The random inputs of one hidden check, drawn from the instructor's secret (given
    when the autograder is built: `scripts/labs.py build --secret`, docs/teaching.md). The
    checks' code is public; which inputs a class is graded on is not. A correct piece
    passes for any secret: each hidden check draws its inputs inside the constraints that
    make it see its mistake, whatever the draw."""
    digest = hashlib.sha256(f"{secret}\x00{label}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


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
def alarm(seconds: float, expire: Callable[[], Any]) -> Iterator[None]:
    """Call `expire` (which raises) if the block runs longer than `seconds`. SIGALRM, so
    only on the main thread (where Jupyter, otter and pytest run tests); elsewhere the
    block is unbounded. An outer limit that was running gets back what is left of it."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return
    old = signal.signal(signal.SIGALRM, lambda signum, frame: expire())
    started = time.monotonic()
    previous = signal.setitimer(signal.ITIMER_REAL, seconds)[0]
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if previous:  # an outer limit was running: give it back what is left of it
            signal.setitimer(signal.ITIMER_REAL, max(1e-3, previous - (time.monotonic() - started)))


def time_limit(seconds: float, what: str, where: str) -> contextlib.AbstractContextManager:
    """Fail (instead of hanging a grading kernel) if the block runs longer than `seconds`:
    a queue that never empties, a loop that never ends."""
    return alarm(seconds, lambda: fail(
        f"{what} did not finish within {seconds:g} s: a loop that never ends (a queue that "
        "never empties, a pick that removes nothing, a block chain that cycles?)", where))


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


# ------------------------------------------------------------------ the tiny engine
@functools.lru_cache(maxsize=1)
def tiny_model():
    """The random 2-layer Llama of the tests (vocab 256, no EOS: every row runs to max_tokens)."""
    from ..models import tiny_llama

    return tiny_llama()


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run the block with one torch intra-op thread, then give the old count back. Every
    lab check wears it (guard.guarded_check): a model 64 wide gains nothing from threads,
    and their hand-offs cost more than its matmuls (a lab's engine checks took 5-7x the
    CPU with two threads on the 2-core machine, worse with one submission graded per core)."""
    import torch

    before = torch.get_num_threads()
    if before != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before != 1:
            torch.set_num_threads(before)


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
