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
from .allowlist import Cell
from .common import admission_order, drain, fail, make_req, secret_rng, student, tiny_engine
from .fcfs import use_policy
from .guard import guarded_check

WHERE = ("docs/policies.md (the hook table: the contract every policy honours) and "
         "docs/benchmarks.md (what `minserve bench` measures)")

# the lab states it: the most later requests of a request's own session and priority that
# may be admitted ahead of it, and the admissions a long request may wait (no starvation)
WAIT_BOUND = 40

def reference():
    """What a submission may not lean on: the engine's own policies (it may compare with
    them, as `score` does, but its own policy must be its own)."""
    return [(cls, [n for n, v in vars(cls).items() if callable(v) or isinstance(v, staticmethod)],
             cls.__name__) for cls in (FCFSPolicy, FairPolicy)]


def workload(seed: int = 0, n: int = 32, sessions: str = "alice=3,bob=1,carol=1") -> Workload:
    """Everyone at once (rate inf), mixed lengths, a heavy session (its weight is its share
    of the requests, several in a row): the policy decides, and FCFS's order is nobody's
    goal."""
    return make_workload(n, rate=math.inf, prompt_len="uniform:4:40", output_len="uniform:2:24",
                         sessions=sessions, seed=seed, vocab=(1, 255))


def _where(method: str) -> str:
    return f"MyPolicy.{method}; {WHERE}"


def _ids(reqs) -> list[str]:
    return [getattr(r, "request_id", r) for r in reqs]


def _look(p, waiting: list, when: str):
    """What the scheduler and the queue figures read, checked against who really waits:
    len, iter (the same requests, the head first: admission order, docs/policies.md),
    peek (only looks, stable, the highest priority tier first)."""
    size = student(len, p, name="__len__", where=WHERE)
    if size != len(waiting):
        fail(f"{when}: {len(waiting)} requests wait but len() is {size}", _where("__len__"))
    listed = student(list, p, name="__iter__", where=WHERE)
    if sorted(_ids(listed)) != sorted(_ids(waiting)):
        fail(f"{when}: iter() lists {sorted(_ids(listed))}, but the requests waiting are "
             f"{sorted(_ids(waiting))}", _where("__iter__"))
    head = student(p.peek_next, name="peek_next", where=WHERE)
    if head is None:
        fail(f"{when}: peek_next returned None while {len(waiting)} requests wait",
             _where("peek_next"))
    if len(p) != size:
        fail(f"{when}: peek_next changed the queue (len {size} -> {len(p)}): peek only looks; "
             "the scheduler peeks, may hold the head where it is (G4), and picks later",
             _where("peek_next"))
    if p.peek_next() is not head:
        fail(f"{when}: two peek_next calls in a row returned different requests "
             f"({head.request_id}, then another): peek must be stable", _where("peek_next"))
    if not any(r is head for r in waiting):
        fail(f"{when}: peek_next returned {head.request_id}, which no longer waits (it was "
             "picked or removed): a head remembered from an earlier peek goes stale; let "
             "every arrival, pick and remove count at the next peek", _where("peek_next"))
    top = max(r.priority for r in waiting)
    if head.priority != top:
        fail(f"{when}: peek_next chose {head.request_id} (priority {head.priority}) while a "
             f"request of priority {top} waits: a higher priority tier always goes first (P1), "
             "however long the others have waited; make -priority the first element of your "
             "key (aging only within a tier), and let every arrival count at the next peek",
             _where("key"))
    if listed[0] is not head:
        fail(f"{when}: iter() lists {_ids(listed)[:4]}... but peek_next returns "
             f"{head.request_id}: __iter__ must yield the waiting requests in admission order "
             "(docs/policies.md), the head first; the queue figures and TickRecord.queues "
             "read it", _where("__iter__"))
    return head


def _pick(p, waiting: list, when: str):
    before = len(p)
    head = student(p.peek_next, name="peek_next", where=WHERE)
    picked = student(p.pick_next, name="pick_next", where=WHERE)
    if picked is not head:
        fail(f"{when}: pick_next returned {_ids([picked])[0]} but peek_next had returned "
             f"{head.request_id}: the scheduler admits what it peeked", _where("pick_next"))
    after = len(p)
    if after == before:
        fail(f"{when}: pick_next returned {picked.request_id} but did not remove it (len stays "
             f"{before}): pick must remove what it returns, or it is admitted again and again",
             _where("pick_next"))
    if after != before - 1:
        fail(f"{when}: pick_next returned {picked.request_id} and len went {before} -> {after}: "
             "it must remove exactly the one it returns (if it calls remove, remove takes out "
             "exactly that request)", f"MyPolicy.pick_next / remove; {WHERE}")
    if any(r is picked for r in p):
        fail(f"{when}: pick_next returned {picked.request_id}, len dropped by one, but iter() "
             "still lists it (and lost another one)", _where("pick_next"))
    waiting.remove(picked)
    return picked


def _remove(p, waiting: list, victim, when: str) -> None:
    before = len(p)
    student(p.remove, victim, name="remove", where=WHERE)
    if len(p) != before - 1:
        fail(f"{when}: after remove({victim.request_id}) len went {before} -> {len(p)}, expected "
             f"{before - 1}: remove takes out exactly that request", _where("remove"))
    if any(r is victim for r in p):
        fail(f"{when}: after remove({victim.request_id}) len is {before - 1} as expected, but "
             f"iter() still lists {victim.request_id} (another request went instead)",
             _where("remove"))
    waiting.remove(victim)


@guarded_check(30, reference, WHERE)
def check_contract(cls, seed: int = 0, n: int = 20) -> None:
    """The hooks any policy must honour, with arrivals interleaved with peeks and picks (as
    the engine calls them): every arrival comes out exactly once; peek only looks, is
    stable, and counts every arrival so far; pick returns and removes it; remove takes out
    exactly one; len and iter describe the waiting requests, iter in admission order (the
    head first); a higher priority tier always goes first (P1). Then a high-priority
    request arrives after low ones waited through many admissions: it goes first all the
    same. Bounded: a queue that never empties is a message, not a hang."""
    rng = random.Random(seed)
    reqs = [make_req(i, rng.choice("abc"), prompt=rng.randint(1, 30), out=rng.randint(1, 20),
                     priority=rng.choice([0, 0, 0, 1])) for i in range(n)]
    p = student(cls, name="MyPolicy()", where=WHERE)
    _peek_sees_arrivals(cls, n)
    waiting, out = [], []
    gone = None
    for i, r in enumerate(reqs):
        student(p.on_request_arrived, r, name="on_request_arrived", where=WHERE)
        waiting.append(r)
        _look(p, waiting, f"after {i + 1} arrivals and {len(out)} picks")
        if gone is None and len(waiting) >= 3 and i >= n // 3:
            gone = rng.choice(waiting[1:])
            _remove(p, waiting, gone, f"after {i + 1} arrivals")
            if waiting:
                _look(p, waiting, f"after remove({gone.request_id})")
        if rng.random() < 0.4 and waiting:
            picked = _pick(p, waiting, f"after {i + 1} arrivals and {len(out)} picks")
            p.on_tokens_processed(picked, picked.prompt_len, 1)
            out.append(picked.request_id)
            if rng.random() < 0.5:
                p.on_request_finished(picked)
    while waiting:
        _look(p, waiting, f"after every arrival, {len(out)} picks")
        picked = _pick(p, waiting, f"after every arrival, {len(out)} picks")
        p.on_tokens_processed(picked, picked.prompt_len, 1)
        out.append(picked.request_id)
    want = sorted(r.request_id for r in reqs if r is not gone)
    if sorted(out) != want or len(p):
        fail(f"the queue gave out {len(out)} requests, expected each of the {len(want)} left after "
             "one remove exactly once", _where("pick_next"))
    _late_high_priority(cls, rng)


def _peek_sees_arrivals(cls, n: int) -> None:
    """Peek, then a higher-priority request arrives: the next peek returns it (any policy
    must: P1), not the answer of the peek before."""
    p = student(cls, name="MyPolicy()", where=WHERE)
    low, high = make_req(n + 1, "a", prompt=5, out=5), make_req(n + 2, "b", prompt=30, out=20,
                                                                priority=1)
    student(p.on_request_arrived, low, name="on_request_arrived", where=WHERE)
    first = student(p.peek_next, name="peek_next", where=WHERE)
    student(p.on_request_arrived, high, name="on_request_arrived", where=WHERE)
    second = student(p.peek_next, name="peek_next", where=WHERE)
    if second is not high:
        listed = student(list, p, name="__iter__", where=WHERE)
        # iter already puts the newcomer first: peek kept an answer from before it arrived
        stale = second is first and listed[:1] == [high]
        fail(f"{low.request_id} (priority 0) arrived and peek_next returned "
             f"{_ids([first])[0]}; then {high.request_id} (priority 1) arrived and peek_next "
             f"returned {_ids([second])[0]}" + (
                 ", its answer before that arrival, although iter() lists "
                 f"{high.request_id} first. A head remembered from an earlier peek goes "
                 "stale; let every arrival count at the next peek" if stale else
                 ": a higher priority tier always goes first (P1); make -priority the first "
                 "element of your key"), _where("peek_next" if stale else "key"))


def _late_high_priority(cls, rng: random.Random, rounds: int = 40) -> None:
    """A backlog of priority-0 requests waits through `rounds` admissions, then a long
    priority-1 request arrives: it is the next head (P1), however long the others aged."""
    p = student(cls, name="MyPolicy()", where=WHERE)
    seq = iter(range(rng.randint(0, 100), 100_000))
    waiting = [make_req(next(seq), rng.choice(["ann", "ben", "cat"]), prompt=rng.randint(2, 30),
                        out=rng.randint(2, 16)) for _ in range(rounds + 10)]
    for r in waiting:
        student(p.on_request_arrived, r, name="on_request_arrived", where=WHERE)
    for k in range(rounds):
        picked = _pick(p, waiting, f"a backlog of {rounds + 10} priority-0 requests, after {k} "
                                   "admissions")
        p.on_tokens_processed(picked, picked.prompt_len, picked.max_tokens)
        p.on_request_finished(picked)
    high = make_req(next(seq), "vip", prompt=40, out=24, priority=1)
    student(p.on_request_arrived, high, name="on_request_arrived", where=WHERE)
    waiting.append(high)
    _look(p, waiting, f"a priority-1 request ({high.request_id}, 40 + 24 tokens) arrived after "
                      f"{len(waiting) - 1} priority-0 ones waited through {rounds} admissions")


@guarded_check(30, reference, WHERE)
def check_no_starvation(cls, bound: int = WAIT_BOUND, hidden=None) -> None:
    """A long request waits while short ones of another session keep arriving (one new
    arrival per admission; the long request's session sends nothing else): it must still be
    admitted within `bound` admissions. Shortest-job-first without aging never admits it.
    With `hidden`, the sizes, the sessions and the backlog are drawn from the instructor's
    secret; without, the public case (40 + 24 tokens against 3 + 3)."""
    rng = secret_rng(hidden.seed, "lab7/starvation") if hidden is not None else None
    size = (rng.randint(24, 40), rng.randint(12, 24)) if rng else (40, 24)
    short = (rng.randint(1, 6), rng.randint(1, 4)) if rng else (3, 3)
    slow, quick = rng.sample(["ida", "jon", "kim", "lev", "max"], 2) if rng else ("slow", "quick")
    backlog = rng.randint(2, 6) if rng else 4
    p = student(cls, name="MyPolicy()", where=WHERE)
    long = make_req(0, slow, prompt=size[0], out=size[1])
    seq = iter(range(1, 10_000))

    def short_one():
        return make_req(next(seq), quick, prompt=short[0], out=short[1])

    for r in [long] + [short_one() for _ in range(backlog)]:
        student(p.on_request_arrived, r, name="on_request_arrived", where=WHERE)
    for _ in range(bound):
        student(p.peek_next, name="peek_next", where=WHERE)
        picked = student(p.pick_next, name="pick_next", where=WHERE)
        if picked is long:
            return
        student(p.on_tokens_processed, picked, picked.prompt_len, picked.max_tokens,
                name="on_tokens_processed", where=WHERE)
        student(p.on_request_finished, picked, name="on_request_finished", where=WHERE)
        student(p.on_request_arrived, short_one(), name="on_request_arrived", where=WHERE)
    fail(f"a {size[0]} + {size[1]}-token request of session {slow} waited through {bound} "
         f"admissions of {short[0]} + {short[1]}-token requests of session {quick} that kept "
         "arriving after it, and was never admitted: it starves. Bound its wait (aging: let "
         "the key improve with the time spent waiting)", f"MyPolicy.key; {WHERE}")


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
    if order == fcfs_order(load):
        names = ", ".join(f"{k} x{w:g}" for k, w in load.settings["sessions"].items())
        fail(f"on the workload (seed {seed}: {len(order)} requests at once, prompts of "
             f"{min(r.prompt_len for r in load.requests)}-{max(r.prompt_len for r in load.requests)}"
             f" tokens, sessions {names}, the heavy one sending several in a row) your policy "
             "admitted them in exactly FCFS's order. Here any goal changes that order: shorter "
             "jobs first would move the short ones up, a fair share would let the light "
             "sessions in between the heavy one's requests, a deadline would move the urgent "
             "ones up. Your key changes nothing (a constant key, or arrival order alone): make "
             "it order by what your stated goal needs", f"MyPolicy.key; {WHERE}")
    return order


def fcfs_order(load: Workload, max_batch_size: int = 4) -> list[int]:
    """The admission order FCFS gives the workload in step mode (positions in it): every
    request is queued before the first tick, all of priority 0, so FCFS admits them in
    arrival order. A policy with any goal of its own admits these requests otherwise."""
    return sorted(range(len(load.requests)), key=lambda i: (0, i))


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


# ------------------------------------------------------------------ hidden: properties
CAPSTONE_PRIORITIES = (0, 0, 0, 0, 1, 1, 2, -1, -2, 3, 7)
CAPSTONE_SESSIONS = ("ann", "ben", "cat", "dov")
CONTRACT7 = {
    "init": "MyPolicy() makes an empty queue.",
    "len": "len(policy) is the number of requests waiting.",
    "iter_set": "iter(policy) lists every waiting request once, and nothing else.",
    "peek_waiting": "peek_next() returns a request that waits now (None only when nothing "
                    "waits): every arrival, pick and remove counts at the next peek.",
    "peek_stable": "peek_next() only looks: two peeks in a row return the same request and "
                   "change nothing.",
    "tiers": "a higher priority always goes first (P1), for any two priorities, however long "
             "the others have waited: peek_next() returns a request of the highest priority "
             "waiting.",
    "iter_head": "iter(policy) yields the waiting requests in admission order, the head "
                 "(what peek_next() returns) first: when they disagree, one of them is stale.",
    "pick": "pick_next() removes and returns the request peek_next() just returned.",
    "remove": "remove(req) takes exactly that request out.",
    "iter_order": "iter(policy) lists the waiting requests in the order pick_next() would "
                  "take them if nothing else happened (no arrival, no other hook).",
    "wait": f"bounded wait: no request waits while more than {WAIT_BOUND} requests of its "
            "own session and priority that arrived after it are admitted ahead of it (a long "
            "request in a busy session included).",
}


def _where7(hook: str) -> str:
    return f"MyPolicy.{hook}; {WHERE}"


def _property_machine():
    import contextlib

    from .differential import Differential, Hang, Twins, call_limit, choose

    class Machine(Differential):
        submission: type
        OPS = ((5, "arrive"), (2, "peek"), (4, "pick"), (2, "remove"), (2, "busy"),
               (1, "drain"), (3, "picks"))

        def setup(self, arg) -> None:
            self.reqs = Twins()
            self.fast = False  # inside a busy period: its reads share one time limit
            self.seq = 0
            self.waiting: list[str] = []  # ids, in arrival order
            self.overtaken: dict[str, int] = {}  # id -> later same-priority arrivals admitted
            self.sub = None
            _, self.sub = self.call("p = MyPolicy()", lambda: None, self.submission,
                                    sentence=CONTRACT7["init"], where=_where7("__init__"))

        def rid(self, value) -> str | None:
            return self.reqs.sub_id(value)

        def observe(self):
            """The contract after every step, read off the policy itself."""
            if self.sub is None:
                return []
            p, want = self.sub, sorted(self.waiting)
            size = self.read(lambda: len(p))
            listed = self.read(lambda: [self.rid(r) for r in p])
            head = self.read(lambda: self.rid(p.peek_next()))
            again = self.read(lambda: self.rid(p.peek_next()))
            top = max((self.reqs.sub[r].priority for r in self.waiting), default=None)
            self.expect(size == len(self.waiting), "len(p)", str(len(self.waiting)), str(size),
                        CONTRACT7["len"], _where7("__len__"))
            self.expect(isinstance(listed, list) and sorted(listed) == want, "list(p)",
                        f"the waiting requests {want}", str(listed), CONTRACT7["iter_set"],
                        _where7("__iter__"))
            self.expect(head in self.waiting if self.waiting else head is None,
                        "p.peek_next()", f"one of the waiting requests {want}" if want
                        else "None", str(head), CONTRACT7["peek_waiting"],
                        _where7("peek_next"))
            self.expect(again == head and self.read(lambda: len(p)) == size,
                        "a second p.peek_next()", f"{head} again, len {size}",
                        f"{again}, len {self.read(lambda: len(p))}", CONTRACT7["peek_stable"],
                        _where7("peek_next"))
            if want:
                prio = self.reqs.sub[head].priority
                self.expect(prio == top, "p.peek_next()", f"a request of priority {top}",
                            f"{head} (priority {prio})", CONTRACT7["tiers"], _where7("key"))
                self.expect(listed[0] == head, "list(p)[0]", f"{head}, what peek_next returns",
                            f"{listed[:4]}...", CONTRACT7["iter_head"],
                            _where7("peek_next / __iter__"))
            return []

        def _describe(self, rid) -> str:
            r = self.reqs.sub[rid]
            return (f"{rid} (session {r.session_id}, priority {r.priority}, "
                    f"{r.prompt_len} + {r.max_tokens} tokens, arrival_seq {r.arrival_seq})")

        def _new(self, arg, priority=None, session=None, size=None) -> tuple[str, int]:
            if priority is None:
                tie, arg = choose((True, False), arg)
                pool = [self.reqs.sub[r].priority for r in self.waiting] if tie else []
                priority, arg = choose(pool or CAPSTONE_PRIORITIES, arg)
            if session is None:
                session, arg = choose(CAPSTONE_SESSIONS, arg)
            if size is None:
                size, arg = choose(((3, 3), (6, 2), (12, 8), (30, 10), (40, 24), (2, 1)), arg)
            self.seq += 1
            rid = self.reqs.add(self.seq, session, prompt=size[0], out=size[1],
                                priority=priority)
            return rid, arg

        def _arrive(self, rid, quiet=False):
            sub = self.reqs.sub[rid]
            text = f"p.on_request_arrived({self._describe(rid)})"
            self.waiting.append(rid)
            self.overtaken[rid] = 0
            if quiet:
                outcome_ok = self.read(lambda: self.sub.on_request_arrived(sub) or "ok",
                                       None if self.fast else 2.0)
                self.expect(outcome_ok == "ok", text, "it returns", outcome_ok,
                            CONTRACT7["peek_waiting"], _where7("on_request_arrived"))
            else:
                self.call(text, lambda: None, lambda: self.sub.on_request_arrived(sub),
                          sentence=CONTRACT7["peek_waiting"], where=_where7("on_request_arrived"))

        def op_arrive(self, arg):
            rid, _ = self._new(arg)
            self._arrive(rid)

        def op_peek(self, arg):
            self.steps.append("p.peek_next()")
            self.check_observables()

        def _pick(self, quiet=False) -> str | None:
            if not self.waiting:
                return None
            limit = None if self.fast else 2.0
            head = self.read(lambda: self.rid(self.sub.peek_next()), limit)
            got = self.read(lambda: self.rid(self.sub.pick_next()), limit)
            if not quiet:
                self.steps.append("p.peek_next(); p.pick_next()")
            self.expect(got == head and got in self.waiting, "p.pick_next()",
                        f"{head}, what peek_next() returned", str(got), CONTRACT7["pick"],
                        _where7("pick_next"))
            # whoever was overtaken by this later request of their own session and priority
            picked = self.reqs.sub[got]
            self.waiting.remove(got)
            for r in self.waiting:
                req = self.reqs.sub[r]
                if (req.priority, req.session_id) == (picked.priority, picked.session_id) \
                        and req.arrival_seq < picked.arrival_seq:
                    self.overtaken[r] += 1
                    self.expect(self.overtaken[r] <= WAIT_BOUND, f"{r} still waits",
                                f"admitted before {WAIT_BOUND + 1} later requests of session "
                                f"{req.session_id}, priority {req.priority} are",
                                f"{self.overtaken[r]} of them admitted ahead of it "
                                f"({self._describe(r)})", CONTRACT7["wait"], _where7("key"))
            sub = self.reqs.sub[got]
            self.read(lambda: self.sub.on_tokens_processed(sub, sub.prompt_len, 0), limit)
            self.read(lambda: self.sub.on_tokens_processed(sub, 0, sub.max_tokens), limit)
            self.read(lambda: self.sub.on_request_finished(sub), limit)
            return got

        def op_pick(self, arg):
            if not self.waiting:
                return self.op_arrive(arg)
            self._pick()
            self.check_observables()

        def op_remove(self, arg):
            if not self.waiting:
                return self.op_arrive(arg)
            head, arg = choose((True, False), arg)
            target = self.read(lambda: self.rid(self.sub.peek_next())) if head else None
            rid = target if target in self.waiting else choose(self.waiting, arg)[0]
            sub = self.reqs.sub[rid]
            self.waiting.remove(rid)
            self.call(f"p.remove({rid})", lambda: None, lambda: self.sub.remove(sub),
                      sentence=CONTRACT7["remove"], where=_where7("remove"))

        def op_busy(self, arg):
            """A busy period: k rounds of one arrival (one priority, session and size for
            the whole period; often the priority of a request that waits), then one
            admission. Each round checks the tiers (and each admission the wait bound);
            the whole contract is checked at the end."""
            k, arg = choose((10, 45, 120, 300, 600), arg)
            mode, arg = choose(("its own", "tie", "above", "any"), arg)
            waiting = [self.reqs.sub[r] for r in self.waiting]
            priority, arg = choose(CAPSTONE_PRIORITIES, arg)
            session, arg = choose(CAPSTONE_SESSIONS, arg)
            if waiting and mode in ("its own", "tie"):  # a waiting request's tier (and session)
                # half the time the longest one waiting: the one a short-first order starves
                longest, arg = choose((True, False), arg)
                w, arg = choose(waiting, arg)
                w = max(waiting, key=lambda r: r.prompt_len + r.max_tokens) if longest else w
                priority = w.priority
                session = w.session_id if mode == "its own" else session
            elif waiting and mode == "above":  # everyone waiting is below: tiers are tested
                priority = max(w.priority for w in waiting) + 1
            size, _ = choose(((3, 3), (6, 2), (2, 1)), arg)
            self.steps.append(f"{k} rounds of: a {size[0]} + {size[1]}-token request of "
                              f"session {session}, priority {priority} arrives; then "
                              "p.peek_next(), p.pick_next(), its tokens and its finish")
            text = self.steps[-1]
            with contextlib.suppress(Hang), call_limit(20.0):  # the whole period, not per call
                self.fast = True
                for i in range(k):
                    self.steps[-1] = f"{text}  [round {i + 1} of {k}]"
                    rid, _ = self._new(0, priority=priority, session=session, size=size)
                    self._arrive(rid, quiet=True)
                    head = self.read(lambda: self.rid(self.sub.peek_next()), None)
                    top = max(self.reqs.sub[r].priority for r in self.waiting)
                    prio = self.reqs.sub[head].priority if head in self.waiting else None
                    self.expect(prio == top, "p.peek_next()", f"a request of priority {top}",
                                f"{head}" + ("" if prio is None else f" (priority {prio})"),
                                CONTRACT7["tiers"] if prio is not None
                                else CONTRACT7["peek_waiting"],
                                _where7("key" if prio is not None else "peek_next"))
                    self._pick(quiet=True)
                self.fast = False
            self.expect(not self.fast, "the busy period", "it ends", "it did not end within "
                        "20 s: a hook that never returns?", CONTRACT7["pick"], WHERE)
            self.steps[-1] = text
            self.check_observables()

        def op_drain(self, arg, some: int | None = None):
            """iter(p) now, then picks with nothing else in between (all of them, or the
            first `some`): the same order."""
            if not self.waiting:
                return self.op_arrive(arg)
            listed = self.read(lambda: [self.rid(r) for r in self.sub])
            n = len(listed) if isinstance(listed, list) else len(self.waiting)
            n = n if some is None else min(n, some)
            self.steps.append(f"list(p) gives {listed}; then p.peek_next(), p.pick_next() "
                              + ("until it is empty" if some is None else f"{n} times")
                              + ", nothing else in between")
            picks = []
            while self.waiting and len(picks) <= n - (some is not None):
                picks.append(self._pick(quiet=True))
            want = listed if some is None or not isinstance(listed, list) else listed[:n]
            self.expect(picks == want, "the picks that followed", f"the order list(p) gave: "
                        f"{want}", f"{picks}", CONTRACT7["iter_order"], _where7("__iter__"))
            self.check_observables()

        def op_picks(self, arg):
            """iter(p), then its first two to four picks: the queue goes on filling, so the
            order beyond the head is checked on longer queues than a drain leaves."""
            if len(self.waiting) < 3:
                return self.op_arrive(arg)
            some, arg = choose((2, 3, 4), arg)
            self.op_drain(arg, some)

    return Machine


@guarded_check(60, reference, WHERE)
def check_properties(cls, hidden) -> None:
    """Hidden: the policy contract and P1 as properties of random workloads drawn from the
    instructor's secret (there is no one reference policy to compare with): arrivals of
    any priority, ties, sessions and sizes, peeks between them, picks, removes (the head
    too), busy periods of up to 300 admissions, drains. After every step: len, iter,
    peek (waiting, stable, the highest priority, iter's head); each pick the peeked one;
    iter in the order of the picks that follow; no request overtaken by more than
    WAIT_BOUND later arrivals of its own priority."""
    from .differential import run

    run(_property_machine(), hidden, "lab7/properties", piece="your MyPolicy",
        reference="the contract", where=WHERE, bind={"submission": cls}, examples=80, steps=24,
        lead="breaks the policy contract", least=40)  # make test's quarter: too few for lab 7
    rng = secret_rng(hidden.seed, "lab7/shapes")
    _remove_before_the_head(cls, rng)
    _tiers_through_a_long_wait(cls, rng)


def _remove_before_the_head(cls, rng: random.Random, trials: int = 6) -> None:
    """Two shapes the random sequences reach only by luck, in every grading, their sizes,
    priorities and sessions drawn from the secret. This one: a request that arrived before
    the head is removed between two peeks; the head is still the head (a peek that kept
    the head's *position* in a list now points at its neighbour)."""
    for trial in range(trials):
        p = student(cls, name="MyPolicy()", where=WHERE)
        n = rng.randint(4, 8)
        sizes = rng.sample(range(2, 60), n)
        sizes.sort(reverse=True)
        small = sizes.pop()  # the smallest job, placed after at least one other
        sizes.insert(rng.randint(1, n - 2), small)
        priority = rng.choice((-3, -1, 0, 1, 2, 7))
        first = rng.randint(0, 100)
        waiting = [make_req(first + i, rng.choice(["ann", "ben", "cat"]),
                            prompt=max(1, s // 2), out=max(1, s - s // 2), priority=priority)
                   for i, s in enumerate(sizes)]
        for r in waiting:
            student(p.on_request_arrived, r, name="on_request_arrived", where=WHERE)
        when = f"{n} requests of priority {priority} arrived (trial {trial + 1})"
        head = _look(p, waiting, when)
        at = next(i for i, r in enumerate(waiting) if r is head)
        before = waiting[:at] or [r for r in waiting if r is not head]
        victim = rng.choice(before)
        _remove(p, waiting, victim, f"{when}, peek_next returned {head.request_id}")
        again = student(p.peek_next, name="peek_next", where=WHERE)
        listed = student(list, p, name="__iter__", where=WHERE)
        if again is not (listed[0] if listed else None) or not any(r is again for r in waiting):
            fail(f"{when}; peek_next returned {head.request_id}; then remove("
                 f"{victim.request_id}), a request that is not the head; now peek_next "
                 f"returns {_ids([again])[0] if again is not None else None} and iter() lists "
                 f"{_ids(listed)[:4]}...: a head remembered as a position in a list moves "
                 "when an earlier entry is removed; let every remove count at the next peek",
                 _where("peek_next / __iter__"))
        _look(p, waiting, f"{when}, after remove({victim.request_id})")


def _tiers_through_a_long_wait(cls, rng: random.Random) -> None:
    """The other: a backlog of one priority waits while a long busy period of
    higher-priority requests is served, one arrival and one admission at a time; at every
    peek the higher tier goes first (P1), however long the backlog has aged (a priority
    that is only a large weight in one score is overtaken by aging after W / rate
    admissions; the period is longer than a thousand)."""
    p = student(cls, name="MyPolicy()", where=WHERE)
    low = rng.choice((-2, -1, 0, 1))
    high = low + rng.randint(1, 3)
    seq = iter(range(rng.randint(0, 100), 100_000))
    waiting = [make_req(next(seq), rng.choice(["ann", "ben"]), prompt=rng.randint(2, 40),
                        out=rng.randint(1, 24), priority=low) for _ in range(rng.randint(2, 5))]
    for r in waiting:
        student(p.on_request_arrived, r, name="on_request_arrived", where=WHERE)
    rounds = rng.randint(1100, 1400)
    for k in range(rounds):
        r = make_req(next(seq), rng.choice(["cat", "dan"]), prompt=rng.randint(1, 6),
                     out=rng.randint(1, 3), priority=high)
        student(p.on_request_arrived, r, name="on_request_arrived", where=WHERE)
        waiting.append(r)
        head = student(p.peek_next, name="peek_next", where=WHERE)
        if head is None or head.priority != high or not any(w is head for w in waiting):
            got = "None" if head is None else f"{head.request_id} (priority {head.priority})"
            backlog = sum(w.priority == low for w in waiting)
            fail(f"{backlog} requests of priority {low} waited while {k} "
                 f"requests of priority {high} were admitted one by one; then one more of "
                 f"priority {high} arrived and peek_next returned {got}: a higher priority "
                 "always goes first (P1), however long the others have waited; make "
                 "-priority the first element of your key (aging only within a tier)",
                 _where("key"))
        picked = _pick(p, waiting, f"admission {k + 1} of a busy period of priority {high}")
        p.on_tokens_processed(picked, picked.prompt_len, picked.max_tokens)
        p.on_request_finished(picked)


def _provided() -> dict:
    from ..request import Request

    return {"Policy": Policy, "Request": Request}


# what the graded cell defines and may use (allowlist.py; grading runs it alone)
CELL = Cell(names=("MyPolicy",), provided=_provided,
            imports={"minserve.policies": frozenset({"Policy"}),
                     "minserve.request": frozenset({"Request"})})


def hidden_seed(hidden, label: str) -> int:
    """A seed for the autograder's unseen workload: from the instructor's secret."""
    return secret_rng(hidden.seed, f"lab7/{label}").randrange(1, 1 << 30)
