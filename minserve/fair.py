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

    **The lift (P4).** A session that was away has a low counter, and would
    otherwise be let in ahead of everyone until it "caught up" (a burst that
    starves the others). A brand-new session at 0 would do the same. So when
    a request arrives for a session that has nothing waiting, its counter is
    raised to the least counter among the sessions that do have requests
    waiting:

        counter[s] = max(counter[s], min(counter[r] for r waiting))

    `max`, not `=`, so the lift never lowers a counter. A session that was
    just served a lot keeps its debt. The newcomer ties with the least-served
    waiting session, so it is neither starved nor given a burst.

    **What counts as "queued" for the lift (design choice).** Only requests
    that *wait* in this queue, not rows already running. This is the paper's
    Algorithm, and what its reference code does (`VTCReqQueue.append`
    looks at clients whose waiting list is non-empty). The reason: the
    counters order only the requests that compete for admission, which are
    the waiting ones. A session whose requests all run has a counter that can
    lag far behind the waiting sessions (it was admitted when it was lowest).
    Lifting a newcomer to that counter would give the newcomer exactly the
    burst the lift is there to prevent. The same reasoning leads to one
    refinement that matters only when priorities are mixed. Both "has nothing
    waiting" and the minimum look only at waiting requests of the *arriving
    request's priority tier*, because those are the requests it competes
    with. Lifting a high-priority newcomer to the counter of a low-priority
    session that waits behind the whole high tier would give it a burst
    inside the high tier. With a single tier this is exactly the paper's rule.
    If nothing else waits in the tier, the counter is left as it is: there is
    nobody to be unfair to.

    **The fairness bound (P5).** The paper proves (its Theorem on backlogged
    clients): if sessions f and g both have requests waiting throughout
    [t1, t2), the service each receives in that window, W = the same weighted
    token count the counters add up, differs by at most

        |W_f(t1, t2) - W_g(t1, t2)| <= 2 * U,   U = max(w_in * L_input, w_out * M)

    where L_input is the longest prompt and M the most tokens a running batch
    can hold (the KV capacity). The proof works in two steps. (1) At any moment
    when both wait, |counter_f - counter_g| <= U. f was last admitted when
    counter_f <= counter_g. Since then f has grown only by that request's
    prompt plus the remaining output of f's rows in the batch, all of which
    fit in M tokens, so the growth is at most w_in*p + w_out*(M - p) <= w_out*M
    when w_in <= w_out. (2) No lift happens to a session that is waiting, so
    counters move exactly with service, and the window difference is at most
    U at each end, 2U in all. (2) holds because a session with requests
    waiting in a tier is never lifted in that tier. The 2x is tight. Note from working this out:
    with w_in > w_out, step (1) only gives w_in*L_input + w_out*(M - L_input),
    which is more than U. `tests/test_policies.py` checks both steps on random
    traces (w_in <= w_out) in a small simulated server. The paper's text was
    read only second-hand, through summaries quoting this form.

    Cost: `peek_next` scans the waiting list, O(n) in the queue length. That is
    fine for the queue sizes a teaching engine sees, and it means the head is
    always computed from the current counters, with no index to keep in sync.
    """

    name = "fair"

    def __init__(self, w_in: float = 1.0, w_out: float = 2.0) -> None:
        for label, w in (("w_in", w_in), ("w_out", w_out)):
            if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
                raise ValueError(f"FairPolicy: {label}={w!r}; use a finite number >= 0")
        if w_in == 0 and w_out == 0:
            raise ValueError("FairPolicy: w_in and w_out are both 0, so no service is "
                             "ever counted; make at least one > 0 (the paper uses 1 and 2)")
        self.w_in = float(w_in)
        self.w_out = float(w_out)
        self.counters: dict[str, float] = {}  # session -> weighted service so far (+ lifts)
        self.served: dict[str, dict[str, int]] = {}  # session -> real tokens, for stats
        self._waiting: list[Request] = []  # in arrival order; the key decides the head
        self._peeked: Request | None = None  # what the last peek_next returned

    def key(self, req: Request) -> tuple[int, float, int]:
        """P2: higher priority first, then the least-served session, then FIFO."""
        return (-req.priority, self.counters.get(req.session_id, 0.0), req.arrival_seq)

    # --- hooks ----------------------------------------------------------------------------
    def on_request_arrived(self, req: Request) -> None:
        """Enqueue `req`; lift its session's counter if it had nothing waiting (P4)."""
        s = req.session_id
        self.counters.setdefault(s, 0.0)
        self.served.setdefault(s, {"prompt_tokens": 0, "output_tokens": 0})
        # The sessions `req` competes with: those waiting in its priority tier.
        rivals = {r.session_id for r in self._waiting if r.priority == req.priority}
        if rivals and s not in rivals:
            self.counters[s] = max(self.counters[s], min(self.counters[r] for r in rivals))
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
        self.remove(req)
        return req

    def remove(self, req: Request) -> None:
        # By identity: dataclass `==` compares every field, which is both slow
        # and wrong for two requests that happen to look alike.
        i = next(i for i, r in enumerate(self._waiting) if r is req)
        del self._waiting[i]
        if self._peeked is req:
            self._peeked = None

    def on_tokens_processed(self, req: Request, prompt_tokens: int, output_tokens: int) -> None:
        """P3: charge the session for the work just done on `req`."""
        s = req.session_id
        self.counters[s] = (self.counters.get(s, 0.0)
                            + self.w_in * prompt_tokens + self.w_out * output_tokens)
        served = self.served.setdefault(s, {"prompt_tokens": 0, "output_tokens": 0})
        served["prompt_tokens"] += prompt_tokens
        served["output_tokens"] += output_tokens

    def on_request_finished(self, req: Request) -> None:
        """Cleanup. The session's counter is deliberately *kept*.

        If a returning session restarted at 0 it would get the catch-up burst
        the lift exists to prevent. The lift can only raise a counter, so it
        cannot repair a counter that was thrown away when the session returns
        while nobody else waits. The cost is one float per session ever seen.
        """
        if any(r is req for r in self._waiting):  # finished while still waiting
            self.remove(req)

    # --- views ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._waiting, key=self.key))

    def __len__(self) -> int:
        return len(self._waiting)

    def stats(self) -> dict[str, Any]:
        queued: dict[str, int] = {}
        for r in self._waiting:
            queued[r.session_id] = queued.get(r.session_id, 0) + 1
        return {"name": self.name, "w_in": self.w_in, "w_out": self.w_out,
                "counters": dict(self.counters),
                "served": {s: dict(v) for s, v in self.served.items()},
                "queued": queued}
