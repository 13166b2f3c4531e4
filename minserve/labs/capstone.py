"""Lab 7, the capstone: the student's own policy (shortest job first, deadline-aware, ...)
scored with `minserve bench`'s workload generator, engine target and metrics, against
FCFS and VTC, on a workload the student has not seen (the autograder's hidden test draws
another one)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from ..bench.report import markdown_table
from ..bench.targets import EngineTarget, RunResult
from ..bench.workload import Workload, make_workload
from ..fair import FairPolicy
from ..policies import FCFSPolicy, Policy
from ..sampling import SamplingParams
from .common import admission_order, drain, fail, make_req, student, tiny_engine
from .fcfs import use_policy
from .guard import guarded_check

WHERE = ("docs/policies.md (the hook table: the contract every policy honours) and "
         "docs/benchmarks.md (what `minserve bench` measures)")


def reference():
    """What a submission may not lean on: the engine's own policies (it may compare with
    them, as `score` does, but its own policy must be its own)."""
    return [(cls, [n for n, v in vars(cls).items() if callable(v) or isinstance(v, staticmethod)],
             cls.__name__) for cls in (FCFSPolicy, FairPolicy)]


def workload(seed: int = 0, n: int = 32, sessions: str = "alice=3,bob=1,carol=1") -> Workload:
    """Everyone at once (rate inf), mixed lengths, a heavy session: the policy decides."""
    return make_workload(n, rate=math.inf, prompt_len="uniform:4:40", output_len="uniform:2:24",
                         sessions=sessions, seed=seed, vocab=(1, 255))


@guarded_check(30, reference, WHERE)
def check_contract(cls, seed: int = 0, n: int = 20) -> None:
    """The hooks any policy must honour: every arrival comes out exactly once; peek is
    stable and pick returns and removes it; remove takes out exactly one; len and iter
    agree; a higher priority tier always goes first (P1). Bounded: a queue that never
    empties is a message, not a hang."""
    rng = random.Random(seed)
    reqs = [make_req(i, rng.choice("abc"), prompt=rng.randint(1, 30), out=rng.randint(1, 20),
                     priority=rng.choice([0, 0, 0, 1])) for i in range(n)]
    p = student(cls, name="MyPolicy()", where=WHERE)
    for r in reqs:
        student(p.on_request_arrived, r, name="on_request_arrived", where=WHERE)
    listed = student(list, p, name="__iter__ (in the order of your key)", where=WHERE)
    if len(p) != n or sorted(r.request_id for r in listed) != sorted(r.request_id for r in reqs):
        fail(f"after {n} arrivals len() is {len(p)} and iter() lists "
             f"{len(listed)} requests: both must describe exactly the waiting requests",
             f"MyPolicy.__len__ / __iter__; {WHERE}")
    student(p.remove, reqs[3], name="remove", where=WHERE)
    if len(p) != n - 1 or any(r is reqs[3] for r in p):
        fail(f"after remove({reqs[3].request_id}) len() is {len(p)} (expected {n - 1}) or the "
             "queue still lists it", f"MyPolicy.remove; {WHERE}")
    out = []
    for _ in range(n - 1):
        if not len(p):
            break
        head = student(p.peek_next, name="peek_next", where=WHERE)
        if head is None or head is not p.peek_next():
            fail("peek_next returned None with requests waiting, or changed between two calls",
                 f"MyPolicy.peek_next; {WHERE}")
        top = max(r.priority for r in p)
        if head.priority != top:
            fail(f"peek_next chose {head.request_id} (priority {head.priority}) while a request "
                 f"of priority {top} waits: a higher priority tier always goes first (P1); "
                 "make -priority the first element of your key", f"MyPolicy.key; {WHERE}")
        before = len(p)
        picked = student(p.pick_next, name="pick_next", where=WHERE)
        if picked is not head:
            fail("pick_next did not return what peek_next returned", f"MyPolicy.pick_next; {WHERE}")
        if len(p) != before - 1 or any(r is picked for r in p):
            fail(f"pick_next returned {picked.request_id} but the queue still holds it (len "
                 f"{before} -> {len(p)}): pick must remove what it returns",
                 f"MyPolicy.pick_next; {WHERE}")
        p.on_tokens_processed(picked, picked.prompt_len, 1)
        out.append(picked.request_id)
        if rng.random() < 0.5:
            p.on_request_finished(picked)
    want = sorted(r.request_id for r in reqs if r is not reqs[3])
    if sorted(out) != want or len(p):
        fail(f"the queue gave out {len(out)} requests, expected each of the {len(want)} left after "
             "one remove exactly once", f"MyPolicy; {WHERE}")


@guarded_check(30, reference, WHERE)
def check_no_starvation(cls, bound: int = 40) -> None:
    """A long request waits while short ones keep arriving (one new arrival per admission):
    it must still be admitted within `bound` admissions. Shortest-job-first without aging
    never admits it."""
    p = student(cls, name="MyPolicy()", where=WHERE)
    long = make_req(0, "slow", prompt=40, out=24)
    seq = iter(range(1, 10_000))
    for r in [long] + [make_req(next(seq), "quick", prompt=3, out=3) for _ in range(4)]:
        student(p.on_request_arrived, r, name="on_request_arrived", where=WHERE)
    for _ in range(bound):
        picked = student(p.pick_next, name="pick_next", where=WHERE)
        if picked is long:
            return
        student(p.on_tokens_processed, picked, picked.prompt_len, picked.max_tokens,
                name="on_tokens_processed", where=WHERE)
        student(p.on_request_finished, picked, name="on_request_finished", where=WHERE)
        student(p.on_request_arrived, make_req(next(seq), "quick", prompt=3, out=3),
                name="on_request_arrived", where=WHERE)
    fail(f"a 40 + 24-token request waited through {bound} admissions of 3 + 3-token requests "
         "that kept arriving after it, and was never admitted: it starves. Bound its wait "
         "(aging: let the key improve with the time spent waiting)", f"MyPolicy.key; {WHERE}")


def serve_step_mode(cls, load: Workload, max_batch_size: int = 4) -> list[str]:
    """The workload in step mode, invariants checked every tick: every request must finish
    with all its tokens within a bounded number of ticks. Returns the admission order, as
    positions in the workload."""
    engine = use_policy(tiny_engine(max_batch_size=max_batch_size),
                        student(cls, name="MyPolicy()", where=WHERE))
    handles = [engine.submit(list(r.prompt_ids), SamplingParams(max_tokens=r.max_tokens,
                                                                ignore_eos=True),
                             session_id=r.session) for r in load.requests]
    drain(engine, WHERE)
    short = [h.request_id for h, r in zip(handles, load.requests)
             if len(h.output.token_ids) != r.max_tokens]
    if short:
        fail(f"requests {short} did not get all their tokens under your policy", WHERE)
    index = {h.request_id: i for i, h in enumerate(handles)}
    return [index[rid] for rid in admission_order(engine.trace)]


def bench(policies: dict[str, Callable[[], Policy]], load: Workload,
          max_batch_size: int = 4) -> list[RunResult]:
    """`minserve bench`'s engine target, once per policy, each on a fresh tiny engine."""
    runs = []
    for name, make in policies.items():
        engine = use_policy(tiny_engine(max_batch_size=max_batch_size), make())
        engine.trace = None
        run = EngineTarget(engine).run(load, progress=False)
        run.target = name
        runs.append(run)
    return runs


@guarded_check(120, reference, WHERE)
def check_serves(cls, seed: int = 0, sessions: str = "alice=3,bob=1,carol=1",
                 n: int = 32) -> list[int]:
    """The contract, then the workload in step mode: every request completes with all its
    tokens, and the policy orders them otherwise than FCFS (a key that changes nothing is
    FCFS under another name). Returns the admission order (positions in the workload)."""
    load = workload(seed, n=n, sessions=sessions)
    check_contract(cls, seed)
    # a broken policy fails here, tick by tick, never hangs
    order = serve_step_mode(cls, load)
    # every request is queued before the first tick, all of priority 0: FCFS admits them
    # in arrival order
    if order == list(range(len(load.requests))):
        fail(f"on the workload (seed {seed}) your policy admitted the {len(order)} requests in "
             "exactly FCFS's order: the key changes nothing (a constant key, or arrival order "
             "alone). Order by what your goal needs (length, session, deadline, ...)",
             f"MyPolicy.key; {WHERE}")
    return order


@guarded_check(120, reference, WHERE)
def compare(cls, seed: int = 0, sessions: str = "alice=3,bob=1,carol=1",
            n: int = 32) -> list[RunResult]:
    """The student's policy against FCFS and VTC with `minserve bench`'s engine target
    (serving mode: the engine's worker thread ticks while an event loop submits and
    streams; it works inside Jupyter's running loop too). Every request must complete with
    all its tokens. Returns the three runs (fcfs, vtc, mine)."""
    load = workload(seed, n=n, sessions=sessions)
    runs = bench({"fcfs": FCFSPolicy, "vtc": FairPolicy,
                  "mine": lambda: student(cls, name="MyPolicy()", where=WHERE)}, load)
    mine = runs[-1]
    bad = [r for r in mine.results if not r.ok or r.output_len != r.max_tokens]
    if bad:
        fail(f"on the workload (seed {seed}) {len(bad)} of {len(mine.results)} requests did not "
             f"complete with all their tokens under your policy (first: {bad[0].to_dict()}); "
             f"the engine's last error: {mine.info['engine_stats'].get('last_error')}", WHERE)
    return runs


def score(cls, seed: int = 0, sessions: str = "alice=3,bob=1,carol=1",
          n: int = 32) -> list[RunResult]:
    """`check_serves` (step mode, the graded properties), then `compare` (the bench's
    numbers against FCFS and VTC). Returns the three runs (fcfs, vtc, mine)."""
    check_serves(cls, seed, sessions, n)
    return compare(cls, seed, sessions, n)


def table(runs: list[RunResult]) -> str:
    return markdown_table(runs, baseline="fcfs")
