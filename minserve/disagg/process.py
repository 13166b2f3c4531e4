"""The prefill worker's life as a process: start, ready, restart, stop (SPEC H8).

A disaggregated worker is part of the server: starting it never hangs, it exits with its
parent, a terminal's hangup or Ctrl-C does not kill it, and when it dies too often the
engine says so (`/health`) instead of failing every prompt in silence.

    start                                    the new process (worker.py)
    ─────                                    ───────────────────────────
    Process(args: a queue, two pipes' ends)  spawn: a fresh interpreter; its arguments
      (a few hundred bytes: never blocks)      are small, so nothing waits for it to read
    a thread writes the payload down the ──► load: the model, the staging pool and the
      pipe: the model, the staging pool,      logits buffer, as handles to the memory
      the logits buffer (pickled handles      this process shares (no weights copied)
      to shared memory)
    `wait_first`: the results pipe, the  ◄── ("ready", pid)
      process's death and a deadline, whichever comes first

Why the payload goes after the start. `Process.start()` writes its pickled arguments
into a pipe and keeps that pipe's reading end open until the write is done; a child that
dies before it has read them (see `refuse_spawn_reimport`) leaves the write blocked for
ever once the arguments outgrow the pipe (64 KiB: a 30-layer model's module tree does).
A pipe whose reading end only the child holds fails instead (EPIPE), and a thread writes
it, so the caller waits on `wait_ready`, which watches the child.

Why not the parent-death signal. Linux's `prctl(PR_SET_PDEATHSIG)` fires when the
*thread* that started the child ends, not the process: a worker restarted from the
engine's tick thread would be killed by `Engine.stop()`. The worker watches its parent
instead: multiprocessing hands every spawned child a "sentinel" (the end of a pipe whose
other end only the parent holds), readable once the parent is gone, even by `kill -9`.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field

log = logging.getLogger("minserve.disagg")

# sysexits.h's EX_CONFIG: the worker process found itself re-running the main script
SPAWN_REIMPORT_EXIT = 78
SAFE_MAIN_PAGE = ("https://docs.python.org/3/library/multiprocessing.html"
                  "#the-spawn-and-forkserver-start-methods")
IDIOM = ('put the code that builds and uses the Engine under `if __name__ == "__main__":` '
         f'(Python\'s "Safe importing of main module", {SAFE_MAIN_PAGE})')


def refuse_spawn_reimport() -> None:
    """Called first thing when an engine with a prefill worker is built, before any model
    is loaded. multiprocessing's "spawn" starts the worker as a fresh interpreter that
    runs the main script again (as `__mp_main__`) before anything else; a script that
    builds its Engine at the top level, without `if __name__ == "__main__":`, would build
    another one in the worker being started, which would start another... (CPython stops
    that with an error in the child; the parent used to wait for ever for it).

    In the script's own process: if the main script's top-level code is running outside
    such a guard (`unguarded_main_line`), the worker would run it again: raise now, naming
    the line and the idiom. In the worker being started (the check above could not read
    the script): exit with a line that says why and a code the parent recognises
    (`start_failure`)."""
    import multiprocessing.process

    if getattr(multiprocessing.process.current_process(), "_inheriting", False):
        print(f"minserve: this process is a prefill worker being started, and it is running "
              f"your main script again (multiprocessing's \"spawn\" does that): {IDIOM}",
              file=sys.stderr, flush=True)
        raise SystemExit(SPAWN_REIMPORT_EXIT)
    if (where := unguarded_main_line()) is not None:
        raise RuntimeError(f"{where[0]}, line {where[1]}, builds an Engine with a prefill "
                           "worker at the top level of the main script: the worker is "
                           "started with multiprocessing's \"spawn\", a fresh Python that runs "
                           f"the main script again and would build another one: {IDIOM}")


def unguarded_main_line() -> tuple[str, int] | None:
    """(path, line) where the main script's top-level code is now, if it is running and
    that line is not inside an `if __name__ == "__main__":` block; else None (no main
    script: Jupyter, `python -c`; not running its top level now; its source unreadable)."""
    import ast
    import inspect

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    frame = inspect.currentframe()
    while frame is not None and not (frame.f_globals is getattr(main, "__dict__", None)
                                     and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None or not path:
        return None
    line = frame.f_lineno
    try:
        tree = ast.parse(open(path, encoding="utf-8").read())
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and node.lineno <= line <= node.end_lineno:
            names = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
            texts = {n.value for n in ast.walk(node.test) if isinstance(n, ast.Constant)}
            if "__name__" in names and "__main__" in texts:
                return None
    return path, line


@contextmanager
def terminal_signals_blocked():
    """SIGHUP and SIGINT blocked in this thread while children start. A terminal sends
    them to its whole process group (a hangup when it closes, Ctrl-C); a child inherits
    the blocked mask, so the worker cannot die of one before it has set them to be
    ignored (worker.py), and multiprocessing's resource tracker, started here too
    (`resource_tracker.ensure_running`), keeps SIGHUP blocked for life: it ignores only
    SIGINT and SIGTERM itself, and without it the semaphores of the queues leak."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP, signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@dataclass
class RestartBudget:
    """At most `max_restarts` restarts in any `window_s` seconds. A worker that dies once
    a day is restarted every time; one that dies at every prompt is not restarted past
    the budget until the oldest restart has left the window (the engine refuses new
    prompts meanwhile, and `/health` says until when)."""

    max_restarts: int = 3
    window_s: float = 600.0
    times: deque = field(default_factory=deque)  # time.monotonic() of each restart in the window

    def _trim(self, now: float) -> None:
        while self.times and now - self.times[0] >= self.window_s:
            self.times.popleft()

    def left(self, now: float) -> int:
        """Restarts left now (reads only: `/health` asks from another thread)."""
        return max(0, self.max_restarts - sum(now - t < self.window_s for t in list(self.times)))

    def take(self, now: float) -> bool:
        """Spend one restart if the window has one left."""
        self._trim(now)
        if len(self.times) >= self.max_restarts:
            return False
        self.times.append(now)
        return True

    def next_at(self, now: float) -> float:
        """When a restart is allowed again (now, if one is left)."""
        self._trim(now)
        if len(self.times) < self.max_restarts:
            return now
        return (self.times[0] if self.times else now) + self.window_s


class WorkerProcess:
    """One prefill worker process: its two channels, its start and its end.

    `jobs`, a multiprocessing queue, carries this side's messages: `put` never blocks
    (a feeder thread writes them), so a tick is never held by a worker that does not read.
    `results`, a pipe's reading end, carries the worker's: it writes each at once, so
    "start" is here before the forward it announces can kill the worker.

    `payload()` builds what the worker loads (pickled with multiprocessing's pickler, so
    tensors travel as handles to shared memory); it is called for every start, since the
    handles can be taken only once."""

    BOOT_S = 120.0  # how long a worker may take to start (spawn, import torch, load): a
    # loaded 2-core machine needs tens of seconds

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.proc = None
        self.jobs = self.results = None
        self.started_at = 0.0
        self.alive_seen = False  # it said "alive": it got past multiprocessing's bootstrap
        self.load_error: str | None = None  # what the worker said when it could not load

    def start(self, payload: bytes) -> None:
        """Start the process (it loads in the background)."""
        import multiprocessing.resource_tracker as resource_tracker

        import torch.multiprocessing as mp

        from .worker import serve_prefills

        ctx = mp.get_context("spawn")  # a fresh interpreter: no fork of this process's threads
        with terminal_signals_blocked():
            resource_tracker.ensure_running()
            self.jobs = ctx.Queue()
            # Exit never waits for a queue's feeder thread: one writing to a worker that
            # died would wait for ever (the "Finished server process" that never ended).
            self.jobs.cancel_join_thread()
            load_r, load_w = ctx.Pipe(duplex=False)
            self.results, results_w = ctx.Pipe(duplex=False)
            self.proc = ctx.Process(target=serve_prefills, name="minserve-prefill", daemon=True,
                                    args=(load_r, self.jobs, results_w, self.threads))
            # The worker's OpenMP threads wait passively (sleep, not spin) between parallel
            # regions, so that they give a core the decode side needs back at once: with them
            # spinning, a stream beside a 3,500-token prompt had gaps of 2.3x its TPOT, with
            # them asleep 1.6x (`minserve bench disaggregated`). Read by OpenMP when the child
            # loads torch, so it is in the environment the child starts with, and only there.
            saved = os.environ.get("OMP_WAIT_POLICY")
            os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
            try:
                self.proc.start()
            finally:
                if saved is None:
                    os.environ.pop("OMP_WAIT_POLICY", None)
        load_r.close()  # the child's end now: if it dies, the write below fails, never blocks
        results_w.close()  # the child's alone: its death reads as the end of the pipe
        threading.Thread(target=_send_payload, args=(load_w, payload), daemon=True,
                         name="minserve-prefill-payload").start()
        self.started_at, self.alive_seen, self.load_error = time.monotonic(), False, None

    @property
    def pid(self) -> int | None:
        proc = self.proc  # read once: `/health` asks from another thread
        return None if proc is None else proc.pid

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def wait_first(self, timeout_s: float) -> None:
        """Block until the worker says it is ready, or raise RuntimeError at once when it
        dies first (naming why), or when `timeout_s` has passed. Messages other than
        "alive", "ready" and "failed" cannot come before "ready"."""
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self.receive(0.1)
            if msg is not None:
                if msg[0] == "ready":
                    return
                self.note(msg)
            if not self.is_alive():
                raise RuntimeError(self.start_failure())
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"the prefill worker did not start within {timeout_s:g} s "
                                   "(it was stopped); on a busy machine raise prefill_timeout_s")

    def receive(self, wait_s: float = 0.0) -> tuple | None:
        """The worker's next message, waiting at most `wait_s`; None if there is none (or
        the worker is gone: its death is the health check's to see)."""
        try:
            if self.results is not None and self.results.poll(wait_s):
                return self.results.recv()
        except (EOFError, OSError):
            pass
        return None

    def note(self, msg: tuple) -> None:
        """The start-up messages: "alive" (bootstrap done) and "failed" (load raised)."""
        if msg[0] == "alive":
            self.alive_seen = True
        elif msg[0] == "failed":
            self.load_error = msg[1]

    def start_failure(self) -> str:
        """Why a worker died before it was ready, in words a first script's author can act on."""
        code = None if self.proc is None else self.proc.exitcode
        if code == SPAWN_REIMPORT_EXIT:
            main = getattr(sys.modules.get("__main__"), "__file__", None) or "your main script"
            return (f"the prefill worker could not start: multiprocessing's \"spawn\" starts it as "
                    f"a fresh Python that imports {main} again, and that script builds an Engine "
                    f"at its top level, so the new process started building another one: {IDIOM}")
        if self.load_error:
            return f"the prefill worker could not load the model: {self.load_error}"
        if not self.alive_seen:
            main = getattr(sys.modules.get("__main__"), "__file__", None)
            return (f"the prefill worker exited (code {code}) while multiprocessing started it, "
                    "before it ran any of minserve (its own error is printed above)"
                    + (f"; if {main} runs code at its top level, {IDIOM}" if main else ""))
        return f"the prefill worker exited (code {code}) while it loaded the model"

    def kill(self) -> None:
        """SIGKILL and reap (a stopped process dies of it too); idempotent."""
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.join(5)

    def stop(self, graceful: bool) -> None:
        """End the process and let go of its channels. `graceful`: ask it to exit first
        (it holds no work), for up to 1 s; then, or else, SIGKILL."""
        if self.proc is None:
            return
        if graceful and self.proc.is_alive():
            try:
                self.jobs.put(None)
                self.proc.join(1)
            except (OSError, ValueError):
                pass
        self.kill()
        self.jobs.cancel_join_thread()
        self.jobs.close()
        self.results.close()
        self.proc = self.results = None


def _send_payload(conn, payload: bytes) -> None:
    """The payload, down a pipe only the worker reads: a dead worker makes it fail at once."""
    try:
        conn.send_bytes(payload)
    except OSError:
        pass  # the worker died before it read it: `wait_first` or the health check says so
    finally:
        conn.close()


def make_payload(*objects) -> bytes:
    """The objects pickled as multiprocessing sends them: each tensor moved to shared memory
    (if it is not there already) and sent as a handle. Raises ValueError, naming the cause,
    for what cannot be sent (a model with a local function patched in, say)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers the tensor reductions)

    try:
        return bytes(ForkingPickler.dumps(objects))
    except (AttributeError, TypeError, pickle.PicklingError) as e:
        raise ValueError(f"the model cannot be sent to the prefill worker process "
                         f"({type(e).__name__}: {e}); prefill_mode='disaggregated' needs "
                         "a model that pickles (no local functions patched into it)") from e
