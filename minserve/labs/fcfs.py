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
from .allowlist import Cell
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
    try:
        last = policy.peek_next()
    except Exception as e:  # noqa: BLE001 - named with its input below
        fail(f"peek_next() on the empty queue (after all {n} requests were picked) raised "
             f"{type(e).__name__}: {e}; it should return None when nothing waits",
             f"FCFSLab.peek_next; {WHERE}")
    if last is not None:
        fail(f"peek_next() on the empty queue (after all {n} requests were picked) returned "
             f"{getattr(last, 'request_id', last)!r}; it should return None",
             f"FCFSLab.peek_next; {WHERE}")


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


# ------------------------------------------------------------------ hidden: against the engine
PRIORITIES = (-7, -2, -1, 0, 0, 0, 1, 1, 2, 3, 5, 40)  # any sign, ties and gaps
CONTRACT = {
    "init": "FCFSLab() makes an empty queue.",
    "arrive": "on_request_arrived(req) puts req in the queue by key: a higher priority "
              "first, then the earlier arrival_seq.",
    "again": "a preempted request comes back through on_request_preempted, which (Policy's "
             "default) is an arrival again, with its own arrival_seq: it goes back to its "
             "place by key, ahead of everything of its priority that arrived after it.",
    "peek": "peek_next() returns the head, the waiting request the key puts first (None "
            "when nothing waits), and changes nothing; every arrival counts at the next peek.",
    "pick": "pick_next() removes and returns the head that peek_next() just returned.",
    "remove": "remove(req) takes exactly that waiting request out.",
    "quiet": "on_tokens_processed and on_request_finished change nothing in FCFS's queue.",
    "len": "len(policy) is the number of requests waiting.",
    "iter": "iter(policy) lists the waiting requests in admission order: by priority, the "
            "highest first, then by arrival_seq.",
    "same": "a policy orders requests; it never changes them.",
}


def _where_hook(hook: str) -> str:
    return f"FCFSLab.{hook}; {WHERE}"


def _describe(req) -> str:
    return f"{req.request_id} (priority {req.priority}, arrival_seq {req.arrival_seq})"


def _machine():
    """The differential machine for FCFSLab against FCFSPolicy (built on first use, so
    that importing this module does not import Hypothesis)."""
    from .differential import Differential, Twins, choose

    class Machine(Differential):
        submission: type
        OPS = ((4, "arrive"), (2, "peek"), (3, "pick"), (1, "again"), (1, "remove"),
               (1, "finish"))

        def setup(self, arg) -> None:
            self.reqs = Twins()
            self.ref = self.sub = None
            self.seq = 0
            self.out: list[str] = []  # picked: they may come back (preempted) or finish
            self.ref, self.sub = self.call("p = FCFSLab()", FCFSPolicy, self.submission,
                                           sentence=CONTRACT["init"],
                                           where=_where_hook("__init__"))

        def observe(self):
            if self.sub is None:
                return []
            return [
                ("len(p)", len(self.ref), self.read(lambda: len(self.sub)), CONTRACT["len"],
                 _where_hook("__len__")),
                ("list(p) (request ids in order)", [r.request_id for r in self.ref],
                 self.read(lambda: [self.reqs.sub_id(r) for r in self.sub]), CONTRACT["iter"],
                 _where_hook("on_request_arrived / __iter__")),
                ("requests whose fields changed", [], self.reqs.changed(), CONTRACT["same"],
                 "FCFSLab; " + WHERE),
            ]

        def _hook(self, text, hook, rid, *args, sentence):
            ref, sub = self.reqs.ref[rid], self.reqs.sub[rid]
            self.call(text, lambda: getattr(self.ref, hook)(ref, *args),
                      lambda: getattr(self.sub, hook)(sub, *args), sentence=sentence,
                      where=_where_hook(hook))

        def op_arrive(self, arg):
            waiting = [r.priority for r in self.ref]
            tie, arg = choose((True, True, False, False, False), arg)
            priority, arg = choose(waiting if tie and waiting else PRIORITIES, arg)
            gap, _ = choose((1, 1, 1, 2, 9), arg)
            self.seq += gap
            rid = self.reqs.add(self.seq, priority=priority)
            self._hook(f"p.on_request_arrived({_describe(self.reqs.ref[rid])})",
                       "on_request_arrived", rid, sentence=CONTRACT["arrive"])

        def op_again(self, arg):
            if not self.out:
                return self.op_arrive(arg)
            rid, _ = choose(self.out, arg)
            self.out.remove(rid)
            self._hook(f"p.on_request_preempted({_describe(self.reqs.ref[rid])})  "
                       "# it was running: back to wait", "on_request_preempted", rid,
                       sentence=CONTRACT["again"])

        def op_peek(self, arg):
            self.call("p.peek_next()", self.ref.peek_next, self.sub.peek_next,
                      ref_canon=self.reqs.ref_id, sub_canon=self.reqs.sub_id,
                      sentence=CONTRACT["peek"], where=_where_hook("peek_next"))

        def op_pick(self, arg):
            if not len(self.ref):
                return self.op_peek(arg)
            self.op_peek(arg)  # the scheduler always peeks first (G4)
            got, _ = self.call("p.pick_next()", self.ref.pick_next, self.sub.pick_next,
                               ref_canon=self.reqs.ref_id, sub_canon=self.reqs.sub_id,
                               sentence=CONTRACT["pick"], where=_where_hook("pick_next"))
            self.out.append(got.request_id)

        def op_remove(self, arg):
            waiting = [r.request_id for r in self.ref]
            if not waiting:
                return self.op_arrive(arg)
            rid, _ = choose(waiting, arg)
            self._hook(f"p.remove({rid})", "remove", rid, sentence=CONTRACT["remove"])

        def op_finish(self, arg):
            if not self.out:
                return self.op_peek(arg)
            rid, arg = choose(self.out, arg)
            if arg % 2:
                self.out.remove(rid)
                self._hook(f"p.on_request_finished({rid})", "on_request_finished", rid,
                           sentence=CONTRACT["quiet"])
            else:
                self._hook(f"p.on_tokens_processed({rid}, 4, 1)", "on_tokens_processed", rid,
                           4, 1, sentence=CONTRACT["quiet"])

    return Machine


@guarded_check(60, reference, WHERE)
def check_against_the_engine(cls, hidden) -> None:
    """Hidden: FCFSLab beside the engine's FCFSPolicy on random sequences of arrivals
    (priorities of any sign, ties, gaps in arrival_seq), peeks between them, picks,
    removes, preempted requests coming back and finishes, drawn from the instructor's
    secret: every return and every observable (len, the order) the same after every step."""
    from .differential import run

    run(_machine(), hidden, "lab1/fcfs", piece="your FCFSLab",
        reference="the engine's FCFSPolicy", where=WHERE, bind={"submission": cls},
        examples=120, steps=30)


def _provided() -> dict:
    from ..request import Request

    return {"Policy": Policy, "Request": Request}


# what the graded cell defines and may use (allowlist.py; grading runs it alone)
CELL = Cell(names=("FCFSLab",), provided=_provided,
            imports={"minserve.policies": frozenset({"Policy"}),
                     "minserve.request": frozenset({"Request"})})


def hidden_plan(hidden, n: int = 7) -> list:
    """An engine plan (prompt, max_tokens, priority) drawn from the instructor's secret:
    priorities of both signs, ties and gaps, for check_in_engine's hidden run."""
    from .common import secret_rng

    rng = secret_rng(hidden.seed, "lab1/plan")
    return [(list(range(5 * i + 1, 5 * i + rng.randint(3, 9))), rng.randint(1, 4),
             rng.choice([-3, -1, 0, 0, 1, 2, 5])) for i in range(n)]
