"""Fair policy: the Virtual Token Counter (SPEC P2-P5).

Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024 (VTC).

The problem. Under FCFS (P1) a session that sends 20 requests makes everyone
who comes after it wait behind all 20. Rate limits fix that by refusing work
even when the server is idle. VTC instead keeps, per session, a counter of the
service it has received, and always admits from the session served least:

    counter[s] += w_in * prompt_tokens_computed + w_out * output_tokens    (P3)
    next request = oldest waiting request of the session with least counter (P2)

    counter    alice  ████████████ 120   waiting: a7 a8 a9 ...
               bob    ███          30    waiting: b2          <- bob goes next
               carol  ███          30    waiting: c1          (new: lifted to 30, P4)

Output tokens cost more (w_out = 2 by default, the paper's setting, after
OpenAI's prices): decoding is sequential and memory-bound, prefill runs
in parallel. Counters are charged *as tokens are produced* (each prefill
chunk, each decode step), not at admission, because nobody knows a
request's output length up front.

The counter is "virtual time", like the virtual finish times of weighted
fair queueing or the vruntime of Linux's CFS. Only differences between
counters matter, never their absolute value.

Priority (minserve's addition) is a stricter, outer layer: the key is
`(-priority, counter[session], arrival_seq)`, so counters only order requests
within one priority tier, and within one session requests go FIFO.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from .policies import Policy
from .request import Request


class FairPolicy(Policy):
    """P2: least-served session first, with the VTC counter lift (P4).

    **The queue's clock.** Call V the least counter among the sessions that
    have a request waiting. V is the queue's virtual clock: the amount of
    service "everyone still waiting has had at least". The algorithm keeps
    every waiting session's counter in [V, V + U] (U below), and V never goes
    backwards. Both halves are what the lift is for.

    **The lift (P4).** A session that was away has a low counter. It would be
    let in ahead of everyone until it "caught up", a burst that starves the
    others. A brand-new session at 0 would do the same. So when a request
    arrives for a session that has nothing waiting, its counter is raised to
    the clock:

        counter[s] = max(counter[s], V)

    `max`, not `=`, so the lift never lowers a counter, and a session that was
    just served a lot keeps its debt. The newcomer ties with the least-served
    waiting session, so it is neither starved nor given a burst.

    **What counts as "queued" (design choice).** Only requests that *wait* in
    this queue, not rows already running. The paper's reference code does the
    same (`VTCReqQueue.append` in Ying1123/VTC-artifact). The
    counters order only the requests that compete for admission, which are
    the waiting ones. A session whose requests all run can have a counter far
    behind the waiting sessions (it was admitted when it was lowest).
    Lifting a newcomer to that counter would give it exactly the burst the
    lift is there to prevent.

    **When nobody waits (the paper's rule).** The reference code then leaves
    the counter alone. But then the clock can jump back: a newcomer at 0 on
    an idle queue sets V = 0, and a session that returns later with its
    counter near the old V must wait while the newcomer catches up, however
    long ago the old V was reached. In the simulation in
    `tests/test_policies.py` two waiting sessions drifted up to 21*U apart
    this way. The paper's algorithm (VTC, Algorithm 2) lifts a newcomer on an
    empty queue to the counter of the client that last left the queue, the
    last one served, as that counter stands *now*. minserve does that: when
    the last waiting request of a tier leaves, its session is remembered, and
    a request arriving on an empty tier is lifted to that session's current
    counter. (An earlier minserve remembered the counter's value at the moment
    it left instead. Charges come after admission, so that value was the
    session's counter *before* it ran: alice admitted at 0 and then served
    1,000 tokens would lift a newcomer to 0, and the newcomer would then take
    1,000 tokens' worth of turns ahead of alice's next request.)

    **Priority tiers.** V is kept per priority tier: "nothing waiting", the
    least counter and the remembered clock all look only at requests of the
    arriving request's priority, because those are what it competes with.
    Lifting a high-priority newcomer to the counter of a low-priority session
    stuck behind the whole high tier would give it a burst inside the high
    tier. With one tier this is the plain rule above.

    **The fairness bound (P5).** Sheng et al. prove, for two clients f and g
    that both have requests waiting throughout [t1, t2), with W the service
    received in the window (the weighted tokens the counters add up):

        |W_f(t1, t2) - W_g(t1, t2)| <= 2 * U,   U = max(w_in * L_input, w_out * M)

    L_input is the longest prompt and M the most tokens a running batch can
    hold (the KV capacity). In minserve M is the G2 budget `kv_budget_tokens`,
    or max_batch_size rows of the largest request if that is smaller. The
    proof has two steps.

    (1) Each waiting session's counter lies in [V, V + U], so two waiting
    sessions differ by at most U. f's counter last got its value either when
    f was admitted (then it was the least, = V) or when it was lifted (= V).
    Since then it has grown only by f's rows in the batch: one prompt plus
    their remaining output. These rows fit in M tokens, so the growth is at
    most w_in*p + w_out*(M - p) <= w_out*M when w_in <= w_out.

    (2) A session with a request waiting is never lifted, so over the window
    its counter moves exactly with its service. The difference is at most U
    at each end, 2U in all.

    I did not read the theorem's own text: the form above comes from
    summaries that quote it. Working it through turned up one caveat: with
    w_in > w_out, step (1) only gives w_in*L_input + w_out*(M - L_input),
    which is more than U. `tests/test_policies.py` checks (1) and the bound
    on random traces in a small simulated server.

    **Bounded state.** A counter is kept per session, and sessions come and
    go (every browser tab, every `user` string of an HTTP client). Beyond
    `max_sessions` sessions, the ones with nothing waiting and nothing running
    are forgotten, least recently active first. Nothing is lost for the
    sessions that compete: a forgotten session that comes back is lifted to
    the clock like a newcomer (P4), so it only loses debt it carried above the
    clock, and sessions with requests waiting or running are never forgotten.

    Cost: `peek_next` scans the waiting list, O(n) in the queue length. That
    is fine for the queue sizes a teaching engine sees, and the head is always
    computed from the current counters, with no index to keep in sync.
    """

    name = "fair"

    def __init__(self, w_in: float = 1.0, w_out: float = 2.0, max_sessions: int = 10_000) -> None:
        for label, w in (("w_in", w_in), ("w_out", w_out)):
            if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
                raise ValueError(f"FairPolicy: {label}={w!r}; use a finite number >= 0")
        if w_in == 0 and w_out == 0:
            raise ValueError("FairPolicy: w_in and w_out are both 0, so no service is "
                             "ever counted; make at least one > 0 (the paper uses 1 and 2)")
        if not (isinstance(max_sessions, int) and max_sessions >= 1):
            raise ValueError(f"FairPolicy: max_sessions={max_sessions!r}; use an int >= 1")
        self.w_in = float(w_in)
        self.w_out = float(w_out)
        self.max_sessions = max_sessions
        self.forgotten_sessions = 0  # idle sessions dropped to keep the state bounded
        self._running: dict[str, int] = {}  # session -> admitted requests not finished
        self._last_active: dict[str, int] = {}  # session -> arrival_seq of its latest request
        self.counters: dict[str, float] = {}  # session -> weighted service so far (+ lifts)
        self.served: dict[str, dict[str, int]] = {}  # session -> real tokens, for stats
        self._waiting: list[Request] = []  # in arrival order; the key decides the head
        self._peeked: Request | None = None  # what the last peek_next returned
        self._last_left: dict[int, str] = {}  # tier -> session of the last request to leave it

    @staticmethod
    def unit(req: Request) -> str:
        """Who a counter belongs to: the request's tenant when the server names one
        (H5: a tenant cannot raise its share by inventing sessions, nor charge
        another's), else its session (notebooks, an open server)."""
        return req.session_id if req.tenant is None else req.tenant

    def key(self, req: Request) -> tuple[int, float, int]:
        """P2: higher priority first, then the least-served session, then FIFO."""
        return (-req.priority, self.counters.get(self.unit(req), 0.0), req.arrival_seq)

    # --- hooks ----------------------------------------------------------------------------
    def on_request_arrived(self, req: Request) -> None:
        """Enqueue `req`; lift its session's counter to the clock if it had nothing waiting (P4)."""
        s, tier = self.unit(req), req.priority
        if s not in self.counters and len(self.counters) >= self.max_sessions:
            self._forget_idle_sessions(len(self.counters) - self.max_sessions + 1)
        self._last_active[s] = req.arrival_seq
        self.counters.setdefault(s, 0.0)
        self.served.setdefault(s, {"prompt_tokens": 0, "output_tokens": 0})
        # the sessions `req` competes with: those waiting in its priority tier
        rivals = {self.unit(r) for r in self._waiting if r.priority == tier}
        if s not in rivals:
            last = self._last_left.get(tier)  # None: this tier has never had anyone waiting
            clock = min((self.counters[r] for r in rivals),
                        default=None if last is None else self.counters[last])
            if clock is not None:
                self.counters[s] = max(self.counters[s], clock)
        self._waiting.append(req)

    def peek_next(self) -> Request | None:
        # Counters change only inside hooks, so between two hooks this answer
        # is stable: a head that the gates soft-hold stays the head (G4).
        self._peeked = min(self._waiting, key=self.key) if self._waiting else None
        return self._peeked

    def pick_next(self) -> Request:
        # Exactly what peek returned, the request the gates just passed, even
        # if a hook ran in between (the scheduler's lock makes that not happen).
        req = self._peeked if self._peeked is not None else self.peek_next()
        if req is None:
            raise IndexError("pick_next on an empty queue")
        return self.pick(req)

    def pick(self, req: Request) -> Request:
        self.remove(req)
        self._running[self.unit(req)] = self._running.get(self.unit(req), 0) + 1
        return req

    def remove(self, req: Request) -> None:
        # By identity: dataclass `==` compares every field, which is both slow
        # and wrong for two requests that happen to look alike.
        i = next(i for i, r in enumerate(self._waiting) if r is req)
        del self._waiting[i]
        if self._peeked is req:
            self._peeked = None
        if not any(r.priority == req.priority for r in self._waiting):
            # The tier is empty now. Its last waiting session held the least
            # counter: its counter, as it grows while that session is served, is
            # the clock V for the next arrival (see "When nobody waits").
            self._last_left.pop(req.priority, None)
            self._last_left[req.priority] = self.unit(req)  # newest last
            while len(self._last_left) > self.max_sessions:  # bounded (docs/policies.md, "Bounded state")
                self._last_left.pop(next(iter(self._last_left)))

    def on_tokens_processed(self, req: Request, prompt_tokens: int, output_tokens: int) -> None:
        """P3: charge the session for the work just done on `req`."""
        s = self.unit(req)
        self.counters[s] = (self.counters.get(s, 0.0)
                            + self.w_in * prompt_tokens + self.w_out * output_tokens)
        served = self.served.setdefault(s, {"prompt_tokens": 0, "output_tokens": 0})
        served["prompt_tokens"] += prompt_tokens
        served["output_tokens"] += output_tokens

    def on_request_finished(self, req: Request) -> None:
        """Cleanup. The session's counter is deliberately *kept*.

        Keeping it is what makes the lift a `max`: a session that just took a
        lot of service and comes back keeps its debt. If the counter were
        dropped, a returning session would restart at the clock V, and that
        erases the debt. The cost is one float per session ever seen.
        """
        if any(r is req for r in self._waiting):  # finished while still waiting
            self.remove(req)
            return
        s = self.unit(req)
        if self._running.get(s, 0) > 1:
            self._running[s] -= 1
        else:
            self._running.pop(s, None)

    def on_request_preempted(self, req: Request) -> None:
        """A running row goes back to wait (P6). No lift: its session's counter is kept
        as it stands, charged for what it was served. Lifting it (it may be the only
        request of its session waiting) would charge the session a second time for
        being preempted, which the scheduler decided, not the session."""
        self.on_request_finished(req)  # it no longer runs
        self._last_active[self.unit(req)] = req.arrival_seq
        self._waiting.append(req)

    def _forget_idle_sessions(self, n: int) -> None:
        """Drop up to `n` sessions with nothing waiting and nothing running, least
        recently active first (see "Bounded state"). A session that is some tier's
        clock (it left that tier last) goes last, and takes that clock with it: the
        cap holds whatever mix of sessions and priorities arrives (once, one session
        per priority value was kept for ever)."""
        busy = {self.unit(r) for r in self._waiting} | set(self._running)
        clocks = set(self._last_left.values())
        idle = sorted((s for s in self.counters if s not in busy),
                      key=lambda s: (s in clocks, self._last_active.get(s, -1)))
        gone = set(idle[:n])
        for s in gone:
            del self.counters[s]
            self.served.pop(s, None)
            self._last_active.pop(s, None)
            self.forgotten_sessions += 1
        if gone & clocks:
            self._last_left = {t: s for t, s in self._last_left.items() if s not in gone}

    # --- views ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._waiting, key=self.key))

    def __len__(self) -> int:
        return len(self._waiting)

    def stats(self) -> dict[str, Any]:
        queued: dict[str, int] = {}
        for r in self._waiting:
            queued[self.unit(r)] = queued.get(self.unit(r), 0) + 1
        return {"name": self.name, "w_in": self.w_in, "w_out": self.w_out,
                "sessions": len(self.counters), "forgotten_sessions": self.forgotten_sessions,
                "counters": dict(self.counters),
                "served": {s: dict(v) for s, v in self.served.items()},
                "queued": queued}
