"""What every lab check shares: the failure type, the tiny engine, running student code."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from ..config import EngineConfig
from ..engine import Engine
from ..request import Request
from ..sampling import SamplingParams


class LabCheckFailed(AssertionError):
    """A lab check failed. The message says what is wrong and where to look."""


def fail(what: str, where: str) -> NoReturn:
    raise LabCheckFailed(f"{what}\n    where to look: {where}")


def student(fn: Callable, *args, name: str, where: str, **kwargs) -> Any:
    """Call the student's `fn`; a stub still raising NotImplementedError becomes a failed
    check that names it, not a bare traceback."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as e:
        fail(f"{name} is still the stub ({e or 'NotImplementedError'}): write it first", where)


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


def drain(engine: Engine, where: str, max_ticks: int = 2_000) -> list:
    """Tick until idle, checking the engine's invariants after every tick. A broken
    invariant or a row that failed becomes a LabCheckFailed naming the tick."""
    s = engine.scheduler
    for _ in range(max_ticks):
        if not s.has_work():
            return engine.trace
        try:
            rec = engine.step()
        except LabCheckFailed:
            raise
        except NotImplementedError as e:
            fail(f"tick {s.tick_count + 1}: the engine called a stub: {e}", where)
        except Exception as e:
            fail(f"tick {s.tick_count + 1} raised {type(e).__name__}: {e}", where)
        failed = rec.admit.failed + rec.prefill.failed + rec.decode.failed
        if failed:
            fail(f"tick {rec.tick}: a row failed inside the real engine: {failed[0]['error']}",
                 where)
        try:
            s.check_invariants()
        except AssertionError as e:
            fail(f"tick {rec.tick}: an engine invariant broke: {e or type(e).__name__}", where)
    fail(f"the engine did not drain in {max_ticks} ticks: something never gets admitted "
         "or never finishes", where)


def admission_order(trace) -> list[str]:
    """Request ids in the order T1 admitted them, across a recorded trace."""
    return [a["request_id"] for rec in trace for a in rec.admit.admitted]


def reference_tokens(plan: Sequence[tuple[list[int], int]], **cfg) -> list[list[int]]:
    """Greedy tokens of each (prompt, max_tokens) on a stock engine: the answer key."""
    engine = tiny_engine(**cfg)
    outs = engine.generate([p for p, _ in plan], [SamplingParams(max_tokens=n) for _, n in plan])
    return [o.token_ids for o in outs]
