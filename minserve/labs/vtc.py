"""Lab 3: the fair policy, VTC (SPEC P2-P5). The student writes the charge (P3) and the
counter lift (P4) of a one-tier VTC; the checks call the hooks, then check the 2U bound
(P5) on random traces in a small simulated server, then put the policy in a real engine.

The simulator (`simulate`) is also the one `tests/test_policies.py` checks FairPolicy
with, kept small: each tick requests
arrive, admission takes the head while a batch row is free and its `prompt + max_tokens`
fits the KV budget (else the head waits, G2/G4), the whole prompt is charged at
admission, every running row decodes one token, finished rows leave. The service W is
metered by the simulator itself, independent of the policy's counters.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field

from ..fair import FairPolicy
from ..sampling import SamplingParams
from .allowlist import Cell
from .common import admission_order, drain, fail, make_req, secret_rng, student, tiny_engine
from .fcfs import use_policy
from .guard import guarded_check

WHERE = ("docs/policies.md (VTC: the charge P3, the lift P4, the 2U bound P5) and notebook "
         "04_policies_fcfs_vs_vtc.ipynb")


def reference():
    """What a submission may not lean on: the engine's own VTC."""
    names = [n for n, v in vars(FairPolicy).items() if callable(v) or isinstance(v, staticmethod)]
    return [(FairPolicy, names, "FairPolicy")]


@guarded_check(20, reference, WHERE)
def check_charge(cls) -> None:
    p = student(cls, 1.0, 2.0, name="VTCLab(w_in, w_out)", where=WHERE)
    a = make_req(0, "alice", prompt=5, out=3)
    student(p.on_request_arrived, a, name="on_request_arrived", where=WHERE)
    student(p.pick_next, name="VTCLab.key (via pick_next)", where=WHERE)
    student(p.on_tokens_processed, a, 5, 0, name="on_tokens_processed", where=WHERE)
    p.on_tokens_processed(a, 0, 1)
    p.on_tokens_processed(a, 0, 1)
    if p.counters.get("alice") != 5 * 1.0 + 2 * 2.0:
        fail(f"after 5 prompt tokens and 2 output tokens with w_in=1, w_out=2 alice's counter "
             f"is {p.counters.get('alice')!r}, expected 9.0 (P3: w_in*prompt + w_out*output)",
             f"VTCLab.on_tokens_processed; {WHERE}")


@guarded_check(20, reference, WHERE)
def check_lift(cls) -> None:
    """A newcomer starts at the least waiting counter, never 0 (no burst), and a session that
    was served a lot keeps its debt (max, not =)."""
    p = student(cls, 1.0, 2.0, name="VTCLab(w_in, w_out)", where=WHERE)
    a = [make_req(i, "alice", prompt=10, out=5) for i in range(3)]
    for r in a:
        student(p.on_request_arrived, r, name="on_request_arrived", where=WHERE)
    first = student(p.pick_next, name="VTCLab.key (via pick_next)", where=WHERE)
    student(p.on_tokens_processed, first, 10, 5, name="on_tokens_processed", where=WHERE)
    if p.counters["alice"] != 20.0:
        fail(f"alice's counter is {p.counters['alice']} after 10 prompt + 5 output tokens, "
             "expected 20 (w_in=1, w_out=2)", f"VTCLab.on_tokens_processed; {WHERE}")
    bob = make_req(10, "bob", prompt=4, out=2)
    p.on_request_arrived(bob)
    if p.counters.get("bob") != 20.0:
        fail(f"bob arrived while alice (counter 20) waits; his counter is "
             f"{p.counters.get('bob')!r}, expected 20: lift a newcomer to the least counter "
             "among sessions with requests *waiting* (at 0 he would take 20 tokens' worth of "
             "turns ahead of alice: a burst)", f"VTCLab.on_request_arrived; {WHERE}")
    carol = make_req(11, "carol")
    p.counters["carol"] = 55.0  # carol was served a lot earlier
    p.on_request_arrived(carol)
    if p.counters["carol"] != 55.0:
        fail(f"carol came back with counter 55 while the least waiting counter is 20; the lift "
             f"set it to {p.counters['carol']}: use max(own, clock), so debt is kept",
             f"VTCLab.on_request_arrived; {WHERE}")


@guarded_check(20, reference, WHERE)
def check_empty_queue_lift(cls) -> None:
    """Nobody waits: a newcomer is lifted to the current counter of the session that last
    left the queue (VTC's Algorithm 2), so the clock never jumps back to 0."""
    p = student(cls, 1.0, 2.0, name="VTCLab(w_in, w_out)", where=WHERE)
    a = make_req(0, "alice", prompt=10, out=5)
    student(p.on_request_arrived, a, name="on_request_arrived", where=WHERE)
    student(p.pick_next, name="VTCLab.key (via pick_next)", where=WHERE)  # alice was the last to leave the queue ...
    student(p.on_tokens_processed, a, 10, 5, name="on_tokens_processed", where=WHERE)
    dave = make_req(1, "dave")  # ... and is charged 20 afterwards, while dave arrives
    p.on_request_arrived(dave)
    if p.counters.get("dave") != 20.0:
        fail(f"dave arrived on an empty queue; his counter is {p.counters.get('dave')!r}, "
             "expected 20, alice's counter *now* (she left the queue last: self.last_left); "
             "at 0 he would get a catch-up burst over alice", f"VTCLab.on_request_arrived; {WHERE}")


@dataclass
class SimResult:
    """Snapshots after every charge: weighted service W, policy counters, who waits; and
    the requests in the order they were admitted (and what `pick_next` returned)."""

    service: list[dict[str, float]] = field(default_factory=list)
    counters: list[dict[str, float]] = field(default_factory=list)
    waiting: list[set[str]] = field(default_factory=list)
    admitted: list = field(default_factory=list)
    picked: list = field(default_factory=list)


def simulate(policy, arrivals, max_batch_size: int, kv_budget: int, w_in: float,
             w_out: float) -> SimResult:
    """A server in miniature, with the scheduler's phase order and its hooks (also the
    simulator of `tests/test_policies.py`).

    Each tick: requests arrive; admit while a slot is free and the head's
    `prompt_len + max_tokens` fits in what is left of `kv_budget` (else the head
    soft-holds, G2/G4), charging the whole prompt at admission (monolithic
    prefill); every running row decodes one token (charged 1 output token);
    rows that reached max_tokens leave (on_request_finished). W is the
    service measured here, independent of the policy.
    """
    res = SimResult()
    service, queued = defaultdict(float), defaultdict(int)
    running: list[list] = []  # [request, tokens decoded]
    reserved, tick, todo = 0, 0, sorted(arrivals, key=lambda a: (a[0], a[1].arrival_seq))

    def snapshot() -> None:
        res.service.append(dict(service))
        res.counters.append(dict(getattr(policy, "counters", {})))
        res.waiting.append({s for s, n in queued.items() if n})

    while todo or len(policy) or running:
        while todo and todo[0][0] <= tick:
            req = todo.pop(0)[1]
            policy.on_request_arrived(req)
            queued[req.session_id] += 1
        snapshot()
        while len(running) < max_batch_size and (head := policy.peek_next()) is not None:
            if reserved + head.kv_need > kv_budget:
                break  # soft hold: the head keeps its place
            res.picked.append(policy.pick_next())
            queued[head.session_id] -= 1
            reserved += head.kv_need
            running.append([head, 0])
            res.admitted.append(head)
            policy.on_tokens_processed(head, head.prompt_len, 0)
            service[head.session_id] += w_in * head.prompt_len
            snapshot()
        for row in running:
            row[1] += 1
            policy.on_tokens_processed(row[0], 0, 1)
            service[row[0].session_id] += w_out
            snapshot()
        for row in [r for r in running if r[1] == r[0].max_tokens]:
            running.remove(row)
            reserved -= row[0].kv_need
            policy.on_request_finished(row[0])
        tick += 1
        if tick > 50_000:
            fail("the simulated server never drained: some request is never admitted",
                 f"VTCLab.peek_next / pick_next; {WHERE}")
    return res


def backlogged_gaps(res: SimResult, a: str, b: str) -> tuple[float, float]:
    """Over the stretches of snapshots where both a and b have requests waiting:
    (largest |counter_a - counter_b|, largest service difference over a window).

    The window difference |W_a(t1,t2) - W_b(t1,t2)| = |D(t2) - D(t1)| with
    D = W_a - W_b, so in one stretch its maximum is max(D) - min(D). A session
    only stops waiting at an admission, and every admission is snapshotted, so
    a stretch of snapshots is a window in which both waited throughout.
    """
    counter_gap, service_gap, lo, hi = 0.0, 0.0, None, None
    for service, counters, waiting in zip(res.service, res.counters, res.waiting):
        if not {a, b} <= waiting:
            lo = hi = None  # the stretch ends
            continue
        d = service.get(a, 0.0) - service.get(b, 0.0)
        lo, hi = (d, d) if lo is None else (min(lo, d), max(hi, d))
        service_gap = max(service_gap, hi - lo)
        if counters:
            counter_gap = max(counter_gap, abs(counters[a] - counters[b]))
    return counter_gap, service_gap


def paper_U(arrivals, max_batch_size: int, kv_budget: int, w_in: float, w_out: float) -> float:
    """U = max(w_in * L_input, w_out * M) for this simulation.

    L_input = the longest prompt. M = the most tokens the running batch can hold:
    the KV budget, or max_batch_size rows of the largest request if that is less.
    """
    reqs = [r for _, r in arrivals]
    longest = max(r.prompt_len for r in reqs)
    m = min(kv_budget, max_batch_size * max(r.kv_need for r in reqs))
    return max(w_in * longest, w_out * m)


def random_trace(rng: random.Random):
    """Two heavy sessions backlogged from tick 0, one or two light ones in on/off bursts."""
    max_prompt, max_out = rng.randint(1, 12), rng.randint(1, 8)
    sessions = ["h0", "h1", "l0", "l1"][: rng.randint(2, 4)]
    plan = [(0, s) for s in sessions[:2] for _ in range(rng.randint(8, 25))]
    for s in sessions:
        for _ in range(rng.randint(0 if s.startswith("h") else 1, 4)):
            plan += [(rng.randint(0, 200), s)] * rng.randint(1, 6)
    plan.sort(key=lambda a: a[0])
    arrivals = [(t, make_req(i, s, prompt=rng.randint(1, max_prompt), out=rng.randint(1, max_out)))
                for i, (t, s) in enumerate(plan)]
    batch = rng.randint(1, 4)
    kv_budget = rng.randint(max_prompt + max_out, batch * (max_prompt + max_out))
    w_in, w_out = rng.choice([(1.0, 2.0), (1.0, 1.0), (0.5, 3.0), (0.0, 1.0)])
    return arrivals, batch, kv_budget, w_in, w_out


@guarded_check(60, reference, WHERE)
def check_bound(cls, seeds=range(40)) -> float:
    """P5 on random traces: |W_h0 - W_h1| <= 2U over every window where both wait, with
    U = max(w_in * longest prompt, w_out * M), M = min(kv_budget, batch * largest request).
    Returns the largest gap seen as a fraction of 2U."""
    worst = 0.0
    for seed in seeds:
        arrivals, batch, budget, w_in, w_out = random_trace(random.Random(seed))
        policy = student(cls, w_in, w_out, name="VTCLab(w_in, w_out)", where=WHERE)
        res = student(simulate, policy, arrivals, batch, budget, w_in, w_out,
                      name="a VTCLab hook", where=WHERE)
        u = paper_U(arrivals, batch, budget, w_in, w_out)
        gap = backlogged_gaps(res, "h0", "h1")[1]
        if gap > 2 * u + 1e-9:
            fail(f"random trace seed={seed} (batch {batch}, kv_budget {budget}, w_in={w_in}, "
                 f"w_out={w_out}): while h0 and h1 both waited their service differed by "
                 f"{gap:g} > 2U = {2 * u:g}. One of three things: the least-served session "
                 "must go next (key); every token must be charged (on_tokens_processed); a "
                 "session that (re)arrives with nothing waiting is lifted to the least counter "
                 "among the sessions waiting now, or, on an empty queue, to the counter of the "
                 "one that left it last (on_request_arrived)",
                 f"VTCLab.on_request_arrived / key / on_tokens_processed; {WHERE}")
        worst = max(worst, gap / (2 * u) if u else 0.0)
    return worst


@guarded_check(60, reference, WHERE)
def check_in_engine(cls, hidden=None) -> list[str]:
    """A heavy backlog (alice, 6 requests) then bob's one request, in a batch of 1 row: under
    VTC bob is admitted second, not seventh. With `hidden`, the names, the backlog's size
    and the lengths are drawn from the instructor's secret. Returns the admission order."""
    rng = secret_rng(hidden.seed, "lab3/engine") if hidden is not None else None
    heavy, light = rng.sample(["ana", "ben", "cho", "dev", "eli"], 2) if rng else ("alice", "bob")
    backlog = rng.randint(3, 8) if rng else 6
    engine = use_policy(tiny_engine(max_batch_size=1), student(cls, 1.0, 2.0,
                                                              name="VTCLab()", where=WHERE))
    for i in range(backlog):
        n = rng.randint(2, 8) if rng else 6
        student(engine.submit, list(range(3 * i + 1, 3 * i + 1 + n)),
                SamplingParams(max_tokens=rng.randint(1, 4) if rng else 3),
                session_id=heavy, name="on_request_arrived", where=WHERE)
    bob = engine.submit([9, 8, 7, 6], SamplingParams(max_tokens=3), session_id=light)
    drain(engine, WHERE)
    order = admission_order(engine.trace)
    if order.index(bob.request_id) != 1:
        fail(f"{light}'s one request was admitted at position {order.index(bob.request_id) + 1} "
             f"of {len(order)} behind {heavy}'s backlog ({order}); under VTC {light} is the least "
             f"served and goes right after {heavy}'s first", WHERE)
    return order


# ------------------------------------------------------------------ hidden: against the engine
class OneClockVTC:
    """The lab's VTC as the engine computes it: FairPolicy's counters, charge and lift,
    with one clock for every priority tier (the lab keeps one `last_left` and lifts to the
    least counter among *all* waiting sessions; FairPolicy keeps a clock per tier), and
    the lab's order: the key (-priority, counter, arrival_seq). FairPolicy is given
    copies of the requests at priority 0, so its one tier is the lab's one clock; a
    preempted request re-enters through on_request_arrived, as Policy's default hook does
    for VTCLab (FairPolicy's own hook re-enters without a lift)."""

    def __init__(self, w_in: float, w_out: float) -> None:
        self.fair = FairPolicy(w_in, w_out)
        self.priority: dict[str, int] = {}  # request id -> its real priority

    def key(self, req) -> tuple:
        return (-self.priority[req.request_id], self.fair.counters.get(req.session_id, 0.0),
                req.arrival_seq)

    def order(self) -> list:
        return sorted(self.fair._waiting, key=self.key)

    def on_request_arrived(self, req, priority: int) -> None:
        self.priority[req.request_id] = priority
        self.fair.on_request_arrived(req)

    def peek_next(self):
        order = self.order()
        return order[0] if order else None

    def pick_next(self):
        return self.fair.pick(self.peek_next())

    def remove(self, req) -> None:
        self.fair.remove(req)

    def on_tokens_processed(self, req, prompt_tokens: int, output_tokens: int) -> None:
        self.fair.on_tokens_processed(req, prompt_tokens, output_tokens)

    def on_request_finished(self, req) -> None:
        self.fair.on_request_finished(req)

    def __len__(self) -> int:
        return len(self.fair)


SESSIONS = ("amy", "bo", "cy", "dan")
LAB3_PRIORITIES = (0, 0, 0, 0, 1, 1, -1, 2, -3)
CONTRACT = {
    "init": "VTCLab(w_in, w_out) starts with no counters and nothing waiting.",
    "arrive": "on_request_arrived(req) enqueues req; if its session has nothing waiting "
              "(rows running do not count), its counter is lifted to the clock, "
              "max(own, clock): the least counter among the sessions with requests waiting, "
              "or, when nobody waits, the current counter of last_left (P4).",
    "again": "a preempted request comes back through on_request_preempted, which (Policy's "
             "default) is on_request_arrived again: the same lift, its own arrival_seq.",
    "charge": "on_tokens_processed(req, p, o) adds w_in * p + w_out * o to its session's "
              "counter (P3).",
    "finish": "on_request_finished(req) changes no counter: a session keeps its debt when "
              "it comes back (P4: max, not =).",
    "peek": "peek_next() returns the request the key puts first: (-priority, the counter of "
            "its session, arrival_seq), so equal counters go in arrival order.",
    "pick": "pick_next() removes and returns the head that peek_next() returned.",
    "remove": "remove(req) takes exactly that request out; when the queue empties, "
              "last_left is its session.",
    "len": "len(policy) is the number of requests waiting.",
    "iter": "iter(policy) lists the waiting requests by the key.",
    "counters": "counters[session] is the session's weighted service plus its lifts.",
    "same": "a policy orders and charges requests; it never changes them.",
}


def _where3(hook: str) -> str:
    return f"VTCLab.{hook}; {WHERE}"


def _machine():
    from .differential import Differential, Twins, choose

    class Machine(Differential):
        submission: type
        OPS = ((4, "arrive"), (2, "again"), (2, "peek"), (3, "pick"), (3, "decode"),
               (2, "finish"), (1, "remove"), (1, "drain"))

        def setup(self, arg) -> None:
            (self.w_in, self.w_out), _ = choose(((1.0, 2.0), (1.0, 1.0), (0.5, 3.0), (0.0, 1.0),
                                                 (2.0, 0.5)), arg)
            self.reqs = Twins()
            self.seq = 0
            self.running: list[str] = []
            self.sessions: set[str] = set()
            self.ref = self.sub = None
            w = (self.w_in, self.w_out)
            self.ref, self.sub = self.call(f"p = VTCLab(w_in={self.w_in:g}, w_out={self.w_out:g})",
                                           lambda: OneClockVTC(*w),
                                           lambda: self.submission(*w),
                                           sentence=CONTRACT["init"], where=_where3("__init__"))

        def observe(self):
            if self.sub is None:
                return []
            order = self.ref.order()

            def counters(p):
                return {s: p.counters.get(s, 0.0) for s in sorted(self.sessions)}

            return [
                ("len(p)", len(self.ref), self.read(lambda: len(self.sub)), CONTRACT["len"],
                 _where3("__len__")),
                ("p.counters (missing: 0)", {s: self.ref.fair.counters.get(s, 0.0)
                                             for s in sorted(self.sessions)},
                 self.read(lambda: counters(self.sub)), CONTRACT["counters"],
                 _where3("on_request_arrived / on_tokens_processed")),
                ("list(p) (request ids in order)", [r.request_id for r in order],
                 self.read(lambda: [self.reqs.sub_id(r) for r in self.sub]), CONTRACT["iter"],
                 _where3("key")),
                ("requests whose fields changed", [], self.reqs.changed(), CONTRACT["same"],
                 "VTCLab; " + WHERE),
            ]

        def _describe(self, rid) -> str:
            r = self.reqs.sub[rid]
            return (f"{rid} (session {r.session_id}, priority {r.priority}, prompt "
                    f"{r.prompt_len}, arrival_seq {r.arrival_seq})")

        def op_arrive(self, arg):
            # often a session already running or waiting: equal counters, ties to break
            busy = sorted({self.reqs.sub[r].session_id for r in self.running}
                          | {r.session_id for r in self.ref.order()})
            mine, arg = choose((True, False), arg)
            session, arg = choose(busy if mine and busy else SESSIONS, arg)
            priority, arg = choose(LAB3_PRIORITIES, arg)
            prompt, arg = choose((1, 2, 5, 8, 12), arg)
            gap, _ = choose((1, 1, 2, 7), arg)
            self.seq += gap
            rid = self.reqs.add(self.seq, session, prompt=prompt, out=3, priority=priority,
                                ref_priority=0)
            self.sessions.add(session)
            self._arrive(rid, f"p.on_request_arrived({self._describe(rid)})", CONTRACT["arrive"],
                         "on_request_arrived")

        def _arrive(self, rid, text, sentence, hook):
            ref, sub = self.reqs.ref[rid], self.reqs.sub[rid]
            priority = self.reqs.sub[rid].priority
            self.call(text, lambda: self.ref.on_request_arrived(ref, priority),
                      lambda: getattr(self.sub, hook)(sub), sentence=sentence,
                      where=_where3("on_request_arrived"))

        def op_again(self, arg):
            if not self.running:
                return self.op_arrive(arg)
            rid, _ = choose(self.running, arg)
            self.running.remove(rid)
            self._arrive(rid, f"p.on_request_preempted({rid})  # it was running: back to wait",
                         CONTRACT["again"], "on_request_preempted")

        def op_peek(self, arg):
            self.call("p.peek_next()", self.ref.peek_next, self.sub.peek_next,
                      ref_canon=self.reqs.ref_id, sub_canon=self.reqs.sub_id,
                      sentence=CONTRACT["peek"], where=_where3("key"))

        def op_pick(self, arg):
            if not len(self.ref):
                return self.op_arrive(arg)
            self.op_peek(arg)
            got, _ = self.call("p.pick_next()", self.ref.pick_next, self.sub.pick_next,
                               ref_canon=self.reqs.ref_id, sub_canon=self.reqs.sub_id,
                               sentence=CONTRACT["pick"], where=_where3("key"))
            rid = got.request_id
            self.running.append(rid)
            prompt = self.reqs.sub[rid].prompt_len  # its prefill is charged at once
            self._charge(rid, prompt, 0)

        def _charge(self, rid, p, o):
            ref, sub = self.reqs.ref[rid], self.reqs.sub[rid]
            self.call(f"p.on_tokens_processed({rid}, {p}, {o})",
                      lambda: self.ref.on_tokens_processed(ref, p, o),
                      lambda: self.sub.on_tokens_processed(sub, p, o), sentence=CONTRACT["charge"],
                      where=_where3("on_tokens_processed"))

        def op_decode(self, arg):
            if not self.running:
                return self.op_pick(arg)
            rid, arg = choose(self.running, arg)
            n, _ = choose((1, 1, 2, 5), arg)
            self._charge(rid, 0, n)

        def op_finish(self, arg):
            if not self.running:
                return self.op_pick(arg)
            rid, _ = choose(self.running, arg)
            self.running.remove(rid)
            ref, sub = self.reqs.ref[rid], self.reqs.sub[rid]
            self.call(f"p.on_request_finished({rid})", lambda: self.ref.on_request_finished(ref),
                      lambda: self.sub.on_request_finished(sub), sentence=CONTRACT["finish"],
                      where=_where3("on_request_finished"))

        def op_drain(self, arg):
            """Pick (and charge) until the queue is empty, then one request arrives: it
            meets an empty queue, whose clock is the counter of the session that left it
            last (not the one that arrived last, nor the least)."""
            while len(self.ref):
                self.op_pick(arg)
            self.op_arrive(arg)

        def op_remove(self, arg):
            waiting = [r.request_id for r in self.ref.order()]
            if not waiting:
                return self.op_arrive(arg)
            rid, _ = choose(waiting, arg)
            ref, sub = self.reqs.ref[rid], self.reqs.sub[rid]
            self.call(f"p.remove({rid})", lambda: self.ref.remove(ref),
                      lambda: self.sub.remove(sub), sentence=CONTRACT["remove"],
                      where=_where3("remove"))

    return Machine


@guarded_check(60, reference, WHERE)
def check_against_the_engine(cls, hidden) -> None:
    """Hidden: VTCLab beside the engine's VTC (FairPolicy, one clock for all tiers as the
    lab asks) on random sequences drawn from the instructor's secret: arrivals from a few
    sessions at several priorities, peeks, picks charged for their prompt, decode charges,
    finishes, removes, preempted rows coming back. After every step: what each call
    returned, len, the order, and every session's counter."""
    from .differential import run

    run(_machine(), hidden, "lab3/vtc", piece="your VTCLab",
        reference="the engine's VTC (FairPolicy, one clock)", where=WHERE,
        bind={"submission": cls}, examples=120, steps=30)


def _provided() -> dict:
    from ..policies import Policy
    from ..request import Request

    return {"Policy": Policy, "Request": Request}


# what the graded cell defines and may use (allowlist.py; grading runs it alone)
CELL = Cell(names=("VTCLab",), provided=_provided,
            imports={"minserve.policies": frozenset({"Policy"}),
                     "minserve.request": frozenset({"Request"})})


def hidden_seeds(hidden, n: int = 40) -> list[int]:
    """Seeds of the random traces the autograder checks the 2U bound on: from the secret."""
    from .common import secret_rng

    return secret_rng(hidden.seed, "lab3/traces").sample(range(10_000, 10_000_000), n)
