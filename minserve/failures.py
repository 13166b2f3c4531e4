"""Failure isolation: a fault ends only the rows it touched, and the worker lives (SPEC H5).

A tick runs a policy's hooks, a backend's forwards and a sampler over many rows at once.
One of them raising must not take every stream down with it (SPEC H5), so each place
that can raise is caught where the rows it touched are known:

    where it raised                        what ends                how
    a row's admission, prefill piece        that row                 fail_row: _release, ERROR
    a forward (prefill or decode)           every row in it          fail_row for each
    a row's sampling or charge in T4        that row, at next T3     note_row_error + ERROR reason
    a policy hook (peek, pick, victim ...)  nothing running          policy_call / note_hook_error
    the tick, outside any one row           every running row        fail_all (Engine.recover)
    the server shutting down                every request            abort_all

Each failure is counted (`failed_rows`, `hook_errors`; stats, G5), kept as one line for
the client and the stats (`row_error`, `last_error`: no traceback, no paths) and logged
with its traceback. Whatever a failed row held goes back through the scheduler's
`_release`, the one subtractor of R1, so R1 and R2 hold after any failure.

Functions of the scheduler `s` they are given, as admission.py's are.
"""

from __future__ import annotations

import logging

from .request import FinishReason, Request

log = logging.getLogger("minserve")


def row_error(where: str, exc: BaseException) -> str:
    """What a client is told when its row failed: the phase and the exception, one
    line, no traceback (the worker's log keeps that)."""
    msg = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    return f"engine error in {where}: {type(exc).__name__}" + (f": {msg}" if msg else "")


def note_row_error(s, req: Request, where: str, exc: BaseException) -> None:
    """Count it, keep one line for stats and the client, the traceback for the log."""
    s.failed_rows += 1
    req.error = s.last_error = row_error(where, exc)
    log.error("request %s failed in %s", req.request_id, where, exc_info=exc)


def note_hook_error(s, hook: str, exc: BaseException) -> None:
    """A policy hook raised: count it and log it; the caller decides what ends."""
    s.hook_errors += 1
    s.last_error = row_error(f"the policy's {hook}", exc)
    log.error("policy hook %s raised", hook, exc_info=exc)


def policy_call(s, method: str):
    """A policy hook whose failure touches no running row (peek): note it and answer
    None, so this tick admits nothing and every running row goes on."""
    try:
        return getattr(s.policy, method)()
    except Exception as e:
        note_hook_error(s, method, e)
        return None


def fail_row(s, req: Request, where: str, exc: BaseException, failed: list | None = None) -> None:
    """One running row failed (its admission, prefill piece, sampling, charge): end it
    alone and give back what it held (noted in a record's `failed`, if given). The
    other rows keep going."""
    for queue in (s.prefilling, s.active):
        if any(r is req for r in queue):
            s._release(req)
            queue.remove(req)
    note_row_error(s, req, where, exc)
    s._finish(req, FinishReason.ERROR, error=req.error)
    if failed is not None:
        failed.append({"request_id": req.request_id, "error": req.error})


def fail_all(s, error: str) -> int:
    """A tick raised outside any one row: end every running request with an error and
    give back what it held, so the engine keeps serving (R1/R2 hold after).

    It must not raise itself: it runs in the worker's error path, and a second exception
    there would kill the worker. So each row is taken out of its queue first, released
    without asking the backend to drop it (that check may be exactly what failed), and
    then `backend.reset()` forgets every row at once."""
    n = 0
    with s.lock:
        for queue in (s.prefilling, s.active):
            for req in list(queue):
                queue.remove(req)
                try:  # `_release` does the accounting before anything that could raise
                    s._release(req, drop_row=False)
                    s._finish(req, FinishReason.ERROR, error=error)
                except Exception as e:
                    log.error("while failing request %s", req.request_id, exc_info=e)
                n += 1
        s._planned = []
        s.backend.reset()
    return n


def abort_all(s, error: str) -> int:
    """Shutting down: end every request, running or waiting, with `error`, giving back
    everything held (R2 afterwards). Returns how many ended."""
    with s.lock:
        n = fail_all(s, error)
        with s.queue_lock:
            for req in list(s.policy):
                s.policy.remove(req)
                s._finish(req, FinishReason.ERROR, error=error)
                n += 1
    return n
