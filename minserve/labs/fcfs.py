"""Lab 1: the FCFS policy (SPEC P1). The student's class replaces the engine's pending queue.

The checks, in the order a student meets them: the key, the five hooks a student writes
(of a policy's seven: the two preemption hooks keep `Policy`'s defaults) and `remove`,
`__iter__`, `__len__`, called directly; then the policy inside a real engine, whose
admissions must come in key order and whose tokens must equal a stock engine's.
"""

from __future__ import annotations

import random

from ..engine import Engine
from ..policies import FCFSPolicy, Policy
from ..sampling import SamplingParams
from .common import (
    admission_order,
    drain,
    fail,
    make_req,
    stock_tokens,
    student,
    tiny_engine,
)
from .guard import guarded_check

WHERE = "docs/policies.md (the hook table and P1) and notebook 01_one_tick.ipynb"
HOOKS = ("__init__", "key", "on_request_arrived", "peek_next", "pick_next", "remove", "__iter__",
         "__len__")


def reference():
    """What a submission may not lean on: the engine's own FCFS policy."""
    return [(FCFSPolicy, HOOKS, "FCFSPolicy")]


def use_policy(engine: Engine, policy: Policy) -> Engine:
    """Make `policy` the engine's pending queue (Q1). Only on an engine with nothing queued."""
    if engine.scheduler.has_work():
        raise ValueError("plug a policy in before submitting anything")
    engine.scheduler.policy = policy
    return engine


@guarded_check(20, reference, WHERE)
def check_key(cls) -> None:
    """Sorting ascending by `key(req)` puts a higher priority first, then the earlier arrival.
    Checked as an order (any key that orders the same way passes), over every pair of a
    few requests with priorities of both signs."""
    reqs = [make_req(i, priority=p) for i, p in ((3, 0), (1, 2), (7, -1), (4, 2), (0, 0), (9, 5))]
    keys = {r.request_id: student(cls.key, r, name="FCFSLab.key", where=WHERE) for r in reqs}
    for a in reqs:
        for b in reqs:
            a_first = (-a.priority, a.arrival_seq) < (-b.priority, b.arrival_seq)
            if a is not b and a_first and not keys[a.request_id] < keys[b.request_id]:
                why = ("higher priority first" if a.priority != b.priority
                       else "within a priority, the earlier arrival first")
                fail(f"key(priority={a.priority}, arrival_seq={a.arrival_seq}) = "
                     f"{keys[a.request_id]!r} does not sort before key(priority={b.priority}, "
                     f"arrival_seq={b.arrival_seq}) = {keys[b.request_id]!r}: {why}",
                     f"FCFSLab.key; {WHERE}")


@guarded_check(20, reference, WHERE)
def check_hooks(cls, seed: int = 0, n: int = 8) -> None:
    """Arrivals in a shuffled order: peek is stable, pick returns the peeked request and
    removes it, the queue drains in key order; `remove` takes out exactly one request;
    `__iter__` and `__len__` describe the waiting requests. Bounded: a pick that removes
    nothing is a message, not an endless loop."""
    check_key(cls)
    rng = random.Random(seed)
    reqs = [make_req(i, priority=rng.choice([0, 0, 1, 2])) for i in range(n)]
    policy = student(cls, name="FCFSLab()", where=WHERE)
    reqs_in = rng.sample(reqs, len(reqs))
    for r in reqs_in:
        student(policy.on_request_arrived, r, name="on_request_arrived", where=WHERE)
    expect = sorted(reqs, key=lambda r: (-r.priority, r.arrival_seq))
    if student(len, policy, name="__len__", where=WHERE) != n:
        fail(f"len(policy) is {len(policy)} after {n} arrivals", f"FCFSLab.__len__; {WHERE}")
    listed = [r.request_id for r in student(list, policy, name="__iter__", where=WHERE)]
    if listed != [r.request_id for r in expect]:
        fail(f"after arrivals in the order {[r.request_id for r in reqs_in]} the queue lists "
             f"{listed}, expected admission order {[r.request_id for r in expect]} (priorities "
             f"{ {r.request_id: r.priority for r in reqs} }): on_request_arrived must keep "
             "self.waiting in key order (the given __iter__ lists it as it is)",
             f"FCFSLab.on_request_arrived; {WHERE}")
    gone = expect[n // 2]
    student(policy.remove, gone, name="remove", where=WHERE)
    expect.remove(gone)
    left = [r.request_id for r in policy]
    if gone.request_id in left:
        fail(f"after remove({gone.request_id}) the queue still lists it: {left}",
             f"FCFSLab.remove; {WHERE}")
    if len(policy) != n - 1 or left != [r.request_id for r in expect]:
        lost = sorted({r.request_id for r in expect} - set(left))
        fail(f"after remove({gone.request_id}) len() is {len(policy)} (expected {n - 1}) and "
             f"the queue lists {left}: remove took out {', '.join(lost) or 'nothing else'} "
             "too; it must take out exactly the request it is given",
             f"FCFSLab.remove; {WHERE}")
    got = []
    for _ in range(n - 1):
        if not len(policy):
            break
        head = student(policy.peek_next, name="peek_next", where=WHERE)
        again = policy.peek_next()
        if head is not again:
            fail("two peek_next calls in a row returned different requests: peek must not "
                 "change the queue (a soft-held head keeps its place, G4)",
                 f"FCFSLab.peek_next; {WHERE}")
        before = len(policy)
        picked = student(policy.pick_next, name="pick_next", where=WHERE)
        if len(policy) != before - 1 or any(r is picked for r in policy):
            fail(f"pick_next returned {getattr(picked, 'request_id', picked)!r} but the queue "
                 f"still holds it (len {before} -> {len(policy)}): pick must remove the head "
                 "it returns, or the scheduler admits it again and again",
                 f"FCFSLab.pick_next; {WHERE}")
        if picked is not head:
            fail(f"pick_next returned {getattr(picked, 'request_id', picked)!r} but peek_next "
                 f"had returned {head.request_id!r}: the scheduler admits what it peeked",
                 f"FCFSLab.pick_next; {WHERE}")
        got.append(picked.request_id)
    if got != [r.request_id for r in expect] or len(policy):
        fail(f"the queue drained as {got}, expected {[r.request_id for r in expect]}",
             f"FCFSLab.peek_next / on_request_arrived; {WHERE}")
    if policy.peek_next() is not None:
        fail("peek_next on an empty queue should return None", f"FCFSLab.peek_next; {WHERE}")


# prompt, max_tokens, priority: a batch of 2 rows, so the order of admission shows
ENGINE_PLAN = [(list(range(1, 9)), 6, 0), (list(range(20, 25)), 4, 0), (list(range(30, 42)), 5, 2),
               (list(range(50, 53)), 3, 0), (list(range(60, 66)), 4, 1), (list(range(70, 80)), 3, 2)]


@guarded_check(60, reference, WHERE)
def check_in_engine(cls, plan=ENGINE_PLAN, max_batch_size: int = 2) -> list[str]:
    """The policy as the real engine's pending queue: admissions in key order, and every
    request's tokens equal to what a stock engine gives it. Returns the admission order.
    The hooks are checked first (a policy whose pick removes nothing never gets here)."""
    check_hooks(cls)
    engine = use_policy(tiny_engine(max_batch_size=max_batch_size),
                        student(cls, name="FCFSLab()", where=WHERE))
    handles = [student(engine.submit, p, SamplingParams(max_tokens=n), priority=prio,
                       name="on_request_arrived (called by submit)", where=WHERE)
               for p, n, prio in plan]
    drain(engine, WHERE)
    order = admission_order(engine.trace)
    ids = [h.request_id for h in handles]
    # all requests are queued before the first tick, so admission follows the key exactly
    expect = [ids[i] for i in sorted(range(len(plan)), key=lambda i: (-plan[i][2], i))]
    if order != expect:
        fail(f"the engine admitted {order}, expected {expect} (priorities "
             f"{dict(zip(ids, [p for _, _, p in plan]))})", WHERE)
    ref = stock_tokens([(p, n) for p, n, _ in plan], max_batch_size=max_batch_size)
    for h, want in zip(handles, ref):
        if h.output.token_ids != want:
            fail(f"{h.request_id} got tokens {h.output.token_ids}, a stock engine gives {want}: "
                 "the policy must only order requests, never change or drop them", WHERE)
    return order
