"""Policies (SPEC P): who is admitted next, FCFS (P1) and Fair / VTC (P2-P5).

No model here. The policies are pure bookkeeping, so the tests build Requests
directly. The fairness bound (P5) is checked in a small simulated server
(`simulate`) that calls the hooks the way the scheduler does.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minserve.engine import make_policy
from minserve.fair import FairPolicy
from minserve.labs.vtc import backlogged_gaps, paper_U, simulate
from minserve.policies import FCFSPolicy, Policy
from minserve.request import Request
from minserve.sampling import SamplingParams


def make_req(i: int, session: str = "default", prompt: int = 4, out: int = 4,
             priority: int = 0) -> Request:
    return Request(request_id=f"{session}-{i}", prompt_token_ids=[1] * prompt,
                   sampling=SamplingParams(max_tokens=out), arrival_seq=i,
                   session_id=session, priority=priority)


def admit(policy: Policy) -> Request:
    """What the scheduler does for one admission: peek, pick, charge the prefill."""
    head = policy.peek_next()
    req = policy.pick_next()
    assert req is head
    policy.on_tokens_processed(req, req.prompt_len, 0)
    return req


def serve(policy: Policy, req: Request) -> None:
    """Decode `req` to its max_tokens, one token at a time, then finish it."""
    for _ in range(req.max_tokens):
        policy.on_tokens_processed(req, 0, 1)
    policy.on_request_finished(req)


# ============================================================================ FCFS (P1)
def test_fcfs_admits_in_arrival_order_within_a_priority():
    p = FCFSPolicy()
    reqs = [make_req(i, session=s) for i, s in enumerate("abacab")]
    for r in reversed(reqs):  # the order of the calls must not matter, arrival_seq does
        p.on_request_arrived(r)
    assert [admit(p) for _ in reqs] == reqs


def test_fcfs_higher_priority_goes_first_then_arrival_order():
    p = FCFSPolicy()
    low, high_late, high_early = make_req(0), make_req(2, priority=1), make_req(1, priority=1)
    for r in (low, high_late, high_early):
        p.on_request_arrived(r)
    assert list(p) == [high_early, high_late, low]
    assert [admit(p) for _ in range(3)] == [high_early, high_late, low]


def test_fcfs_remove_keeps_the_order_of_the_rest():
    p = FCFSPolicy()
    reqs = [make_req(i) for i in range(5)]
    for r in reqs:
        p.on_request_arrived(r)
    p.remove(reqs[2])
    p.remove(reqs[0])
    assert list(p) == [reqs[1], reqs[3], reqs[4]] and len(p) == 3


def test_fcfs_peek_is_stable_and_pick_returns_the_peeked_request():
    p = FCFSPolicy()
    for r in (make_req(0), make_req(1)):
        p.on_request_arrived(r)
    head = p.peek_next()
    assert p.peek_next() is head and len(p) == 2  # a soft-held head stays the head (G4)
    assert p.pick_next() is head and len(p) == 1
    p.pick_next()
    assert p.peek_next() is None


@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from("abc")), min_size=1, max_size=30))
def test_fcfs_drains_in_priority_then_arrival_order(spec):
    p = FCFSPolicy()
    reqs = [make_req(i, session=s, priority=pr) for i, (pr, s) in enumerate(spec)]
    for r in reqs:
        p.on_request_arrived(r)
    drained = [admit(p) for _ in reqs]
    assert drained == sorted(reqs, key=lambda r: (-r.priority, r.arrival_seq))


# ============================================================================ Fair (P2-P4)
def test_fair_light_session_is_admitted_ahead_of_a_heavy_backlog():
    """P2: the point of VTC. Under FCFS the light request would be 21st."""
    p = FairPolicy()
    heavy = [make_req(i, "heavy") for i in range(20)]
    light = make_req(20, "light")
    for r in heavy + [light]:
        p.on_request_arrived(r)
    assert admit(p) is heavy[0]  # counters tie at 0, the older request goes first
    # heavy has now been charged for its prompt: light is the least served
    assert p.stats()["counters"]["heavy"] > p.stats()["counters"]["light"]
    assert admit(p) is light


def test_fair_light_session_arriving_after_heavy_was_served_waits_at_most_one_request():
    p = FairPolicy()
    heavy = [make_req(i, "heavy") for i in range(20)]
    for r in heavy:
        p.on_request_arrived(r)
    for _ in range(3):
        serve(p, admit(p))
    light = make_req(20, "light")
    p.on_request_arrived(light)  # lifted to heavy's counter: a tie, so one more heavy first
    order = [admit(p) for _ in range(3)]
    assert light in order[:2]


def test_fair_newcomer_counter_is_lifted_to_the_least_waiting_counter_not_zero():
    p = FairPolicy(w_in=1, w_out=2)
    a, b, idle = make_req(0, "a", prompt=100), make_req(1, "b", prompt=50), make_req(2, "idle")
    for r in (a, b, idle, make_req(3, "a"), make_req(4, "b")):
        p.on_request_arrived(r)
    # a, b and idle each get one request admitted and charged; a and b keep one
    # waiting, idle now has only running work (and a low counter)
    for r in (a, b, idle):
        p.remove(r)
        p.on_tokens_processed(r, r.prompt_len, 0)
    assert p.stats()["counters"] == {"a": 100, "b": 50, "idle": 4}
    p.on_request_arrived(make_req(5, "new"))
    # lifted to min over *waiting* sessions (b: 50), not 0, and not to the counter
    # of "idle", which has only running work (that would hand "new" a burst)
    assert p.stats()["counters"]["new"] == 50


def test_fair_newcomer_gets_no_catch_up_burst():
    """P4: after one served request the newcomer is no longer ahead of everyone."""
    p = FairPolicy()
    olds = [make_req(i, s) for i, s in enumerate("ab" * 10)]
    for r in olds:
        p.on_request_arrived(r)
    for _ in range(8):
        serve(p, admit(p))
    new = [make_req(20 + i, "new") for i in range(5)]
    for r in new:
        p.on_request_arrived(r)
    c = p.stats()["counters"]
    assert c["new"] == min(c["a"], c["b"]) > 0
    order = [admit(p).session_id for _ in range(6)]
    # without the lift (counter 0) all five "new" requests would go first; with
    # it, "new" ties with the least served (older requests win the tie) and then
    # takes turns: its first request is in the first round, and no more than its share
    assert "new" in order[:3] and order.count("new") <= 2


def test_fair_returning_session_keeps_a_higher_counter():
    """P4 is a max: coming back never erases service already received."""
    p = FairPolicy()
    a0, b0 = make_req(0, "a", prompt=200), make_req(1, "b")
    p.on_request_arrived(a0)
    p.on_request_arrived(b0)
    serve(p, admit(p))  # a: 200 + 2*4 = 208, a's queue is now empty
    p.on_request_arrived(make_req(2, "a"))  # returns while b (counter 0) waits
    assert p.stats()["counters"]["a"] == 208
    assert admit(p) is b0


def test_fair_returning_idle_session_is_lifted_up():
    p = FairPolicy()
    a0 = make_req(0, "a")
    p.on_request_arrived(a0)
    serve(p, admit(p))  # a: 4 + 8 = 12, then a goes quiet
    bs = [make_req(1 + i, "b", prompt=50) for i in range(4)]
    for r in bs:
        p.on_request_arrived(r)
    # b arrived on an empty queue: lifted to a's 12 (a was served last)
    for _ in range(2):
        serve(p, admit(p))  # b: 12 + 2 * (50 + 8) = 128, still waiting
    p.on_request_arrived(make_req(9, "a"))
    assert p.stats()["counters"]["a"] == 128


def test_fair_arrival_on_an_empty_queue_is_lifted_to_the_last_served_sessions_counter():
    """P4 when nobody waits (VTC, Algorithm 2): lift to the current counter of the
    session that last left the queue, so the clock never runs backwards and a
    newcomer gets no catch-up burst over a session that was served meanwhile."""
    p = FairPolicy()
    a = [make_req(i, "a") for i in range(3)]
    for r in a:
        p.on_request_arrived(r)
    for _ in a:
        serve(p, admit(p))  # each: 4 + 2*4 = 12; a had 24 when its last request left
    assert len(p) == 0 and p.stats()["counters"]["a"] == 36
    p.on_request_arrived(make_req(3, "new"))  # nobody waits
    # a's counter now (36), not 24 (a's counter when its last request was admitted,
    # before that request was charged), and not 0
    assert p.stats()["counters"]["new"] == 36
    p.on_request_arrived(make_req(4, "a"))
    p.on_request_arrived(make_req(5, "new"))
    # a tie at 36: plain arrival order, then new pays for its first request. Lifted to
    # 24 (or 0) instead, "new" would take two (or all) turns ahead of a.
    assert [admit(p).session_id for _ in range(3)] == ["new", "a", "new"]


def test_fair_first_arrival_in_a_fresh_tier_keeps_its_counter():
    p = FairPolicy()
    p.on_request_arrived(make_req(0, "a", prompt=30))
    serve(p, admit(p))
    p.on_request_arrived(make_req(1, "b", priority=1))  # tier 1 never had anyone waiting
    assert p.stats()["counters"] == {"a": 38, "b": 0}


def test_fair_priority_tier_beats_counters():
    p = FairPolicy()
    rich, poor0 = make_req(0, "rich", prompt=500), make_req(1, "poor")
    p.on_request_arrived(rich)
    p.on_request_arrived(poor0)
    serve(p, admit(p))  # rich has been served a lot (508) ...
    serve(p, admit(p))  # ... poor a little (12)
    poor, rich_urgent = make_req(2, "poor"), make_req(3, "rich", priority=1)
    p.on_request_arrived(poor)
    p.on_request_arrived(rich_urgent)
    assert p.stats()["counters"]["rich"] > p.stats()["counters"]["poor"]
    assert admit(p) is rich_urgent and admit(p) is poor


def test_fair_lift_looks_only_at_the_arriving_requests_priority_tier():
    p = FairPolicy()
    hi = [make_req(i, "hi", prompt=100, priority=1) for i in range(3)]
    lo = make_req(3, "lo", priority=0)
    for r in hi + [lo]:
        p.on_request_arrived(r)
    serve(p, admit(p))  # hi: 100 + 8
    p.on_request_arrived(make_req(4, "new", priority=1))
    # competes with "hi" (108), not with "lo" (0), which waits behind the whole tier
    assert p.stats()["counters"]["new"] == 108


def test_fair_within_a_session_requests_go_fifo():
    p = FairPolicy()
    reqs = [make_req(i, s) for i, s in enumerate("aabbbaab")]
    for r in reqs:
        p.on_request_arrived(r)
    drained = [admit(p) for _ in reqs]
    for s in "ab":
        seqs = [r.arrival_seq for r in drained if r.session_id == s]
        assert seqs == sorted(seqs)


def test_fair_peek_is_stable_between_hooks_and_pick_returns_the_peeked_request():
    p = FairPolicy()
    for r in (make_req(0, "a"), make_req(1, "b"), make_req(2, "a")):
        p.on_request_arrived(r)
    head = p.peek_next()
    assert all(p.peek_next() is head for _ in range(3))  # a soft-held head stays (G4)
    assert p.pick_next() is head
    # pick returns what peek returned, even if a charge reorders in between
    nxt = p.peek_next()
    p.on_tokens_processed(nxt, 1000, 0)
    assert p.pick_next() is nxt


def test_fair_iter_lists_waiting_requests_in_pick_order():
    p = FairPolicy()
    for i, s in enumerate("abcabc"):
        p.on_request_arrived(make_req(i, s, prompt=1 + i))
    p.on_tokens_processed(make_req(99, "b"), 10, 0)  # b served more: its requests go last
    listed = list(p)
    assert [r.session_id for r in listed] == ["a", "c", "a", "c", "b", "b"]
    assert [p.pick_next() for _ in range(len(p))] == listed  # nothing charged in between


def test_fair_remove_takes_out_exactly_that_request():
    p = FairPolicy()
    reqs = [make_req(i, "a") for i in range(3)] + [make_req(3, "b")]
    for r in reqs:
        p.on_request_arrived(r)
    head = p.peek_next()
    p.remove(head)  # e.g. cancelled while it was the (soft-held) head
    assert head not in list(p) and len(p) == 3
    assert p.stats()["queued"] == {"a": 2, "b": 1}
    assert p.pick_next() is not head


def test_fair_charges_w_in_per_prompt_token_and_w_out_per_output_token():
    """P3, with non-default weights so a swapped weight shows."""
    p = FairPolicy(w_in=0.5, w_out=3.0)
    r = make_req(0, "a", prompt=10, out=4)
    p.on_request_arrived(r)
    admit(p)
    serve(p, r)
    st_ = p.stats()
    assert st_["counters"]["a"] == 0.5 * 10 + 3.0 * 4
    assert st_["served"]["a"] == {"prompt_tokens": 10, "output_tokens": 4}
    assert (st_["name"], st_["w_in"], st_["w_out"], st_["queued"]) == ("fair", 0.5, 3.0, {})


def test_fair_finished_session_keeps_its_counter():
    p = FairPolicy()
    r = make_req(0, "a", prompt=7)
    p.on_request_arrived(r)
    serve(p, admit(p))
    assert p.stats()["counters"] == {"a": 7 + 2 * 4}


def test_make_policy_builds_fair_with_the_configured_weights():
    p = make_policy("fair", w_in=2.0, w_out=5.0)
    assert isinstance(p, FairPolicy) and (p.w_in, p.w_out) == (2.0, 5.0)
    assert isinstance(make_policy("fcfs"), FCFSPolicy)


@pytest.mark.parametrize("w_in, w_out", [(-1, 2), (1, float("nan")), (0, 0)])
def test_fair_rejects_weights_that_cannot_count_service(w_in, w_out):
    with pytest.raises(ValueError, match="FairPolicy"):
        FairPolicy(w_in=w_in, w_out=w_out)


# ============================================================================ P5: the bound
# The miniature server and the bound's measures live in minserve/labs/vtc.py, which checks
# a student's VTC with the same simulator: `simulate`, `backlogged_gaps`, `paper_U`.


@st.composite
def traces(draw):
    """2-4 sessions. h0 and h1 have a big backlog at tick 0, so they stay
    backlogged for a long stretch. Every session also sends bursts at random
    times ("on/off" traffic, as in the paper's experiments), so sessions leave,
    return and arrive on an empty queue: that exercises the lift (P4)."""
    max_prompt, max_out = draw(st.integers(1, 12)), draw(st.integers(1, 8))
    sessions = ["h0", "h1", "l0", "l1"][: draw(st.integers(2, 4))]
    plan = [(0, s) for s in sessions[:2] for _ in range(draw(st.integers(8, 25)))]
    for s in sessions:
        for _ in range(draw(st.integers(0 if s.startswith("h") else 1, 4))):
            plan += [(draw(st.integers(0, 200)), s)] * draw(st.integers(1, 6))
    plan.sort(key=lambda a: a[0])  # arrival_seq follows arrival time, as in submit
    prompt, out = st.integers(1, max_prompt), st.integers(1, max_out)
    arrivals = [(t, make_req(i, s, prompt=draw(prompt), out=draw(out)))
                for i, (t, s) in enumerate(plan)]
    batch = draw(st.integers(1, 4))
    kv_budget = draw(st.integers(max_prompt + max_out, batch * (max_prompt + max_out)))
    w_in, w_out = draw(st.sampled_from([(1.0, 2.0), (1.0, 1.0), (0.5, 3.0), (0.0, 1.0)]))
    return arrivals, batch, kv_budget, w_in, w_out


@settings(max_examples=150, deadline=None)
@given(traces())
def test_fair_backlogged_sessions_stay_within_the_vtc_bound(trace):
    """P5, Sheng et al. (OSDI 2024), the theorem on backlogged clients.

    Bound: if f and g both wait throughout [t1, t2),
        |W_f(t1,t2) - W_g(t1,t2)| <= 2U,  U = max(w_in * L_input, w_out * M).
    The proof has two steps, and both are checked here at every charge, for
    every pair of sessions:
    (1) Every waiting session's counter lies in [V, V + U], where V is the
        least waiting counter (see FairPolicy), so |counter_f - counter_g| <= U.
        Its counter was last set to V when it was admitted or lifted. Since
        then it has grown by one prompt (<= L_input) plus the outputs of its
        rows in the batch, all of which fit in M tokens. That is at most
        w_in*p + w_out*(M - p) <= w_out*M, since w_in <= w_out in every weight
        pair drawn here (with w_in > w_out the bound is
        w_in*L_input + w_out*(M - L_input), more than U).
    (2) A waiting session is never lifted, so in the window its counter moves
        exactly with the service metered here: at most U off at each end, 2U.
    How the simulation maps onto the paper: L_input = the longest prompt.
    M = min(kv_budget, max_batch_size * the largest prompt+max_tokens), the
    tokens a batch can hold. A prompt is charged whole on admission
    (monolithic prefill), and each running row 1 output token per tick, the
    same per-step updates as the paper's Algorithm.
    """
    arrivals, batch, kv_budget, w_in, w_out = trace
    policy = FairPolicy(w_in=w_in, w_out=w_out)
    res = simulate(policy, arrivals, batch, kv_budget, w_in, w_out)
    assert all(p is r for p, r in zip(res.picked, res.admitted))  # pick_next gave the head
    U = paper_U(arrivals, batch, kv_budget, w_in, w_out)
    sessions = sorted({r.session_id for _, r in arrivals})
    for a, b in itertools.combinations(sessions, 2):
        counter_gap, service_gap = backlogged_gaps(res, a, b)
        assert counter_gap <= U, (a, b, counter_gap, U)  # step (1)
        assert service_gap <= 2 * U, (a, b, service_gap, U)  # the theorem
    # P3 agrees with the simulation's own meter: counter = service + lifts
    for s in sessions:
        assert policy.counters[s] >= res.service[-1][s] - 1e-9
    for s in ("h0", "h1"):  # in their first backlog, never lifted: counter == service
        for service, counters, waiting in zip(res.service, res.counters, res.waiting):
            if s not in waiting:
                break
            assert counters[s] == pytest.approx(service.get(s, 0.0))
    for s in sessions:  # within a session, admission is FIFO
        seqs = [r.arrival_seq for r in res.admitted if r.session_id == s]
        assert seqs == sorted(seqs)
    assert len(res.admitted) == len(arrivals) and len(policy) == 0


def test_bound_check_catches_an_unfair_policy():
    """The P5 check can fail: FCFS serves all of a's backlog before b's first."""
    arrivals = [(0, make_req(i, "a" if i < 20 else "b")) for i in range(40)]
    U = paper_U(arrivals, 2, 100, 1.0, 2.0)
    _, fcfs_gap = backlogged_gaps(simulate(FCFSPolicy(), arrivals, 2, 100, 1.0, 2.0), "a", "b")
    _, fair_gap = backlogged_gaps(simulate(FairPolicy(), arrivals, 2, 100, 1.0, 2.0), "a", "b")
    assert fcfs_gap > 2 * U >= fair_gap


def test_fair_session_state_stays_bounded_and_never_forgets_a_competing_session():
    """Every distinct `user` used to keep a counter forever (1 MB names -> +91 MB).
    Beyond max_sessions, idle sessions are forgotten; waiting or running ones never."""
    p = FairPolicy(max_sessions=4)
    heavy = [make_req(i, "heavy", prompt=40) for i in range(3)]
    for r in heavy:
        p.on_request_arrived(r)
    running = admit(p)  # heavy: one running, two waiting
    for i in range(100):  # a churn of one-shot sessions, each served and gone
        r = make_req(10 + i, f"drive-by-{i}")
        p.on_request_arrived(r)
        while (head := admit(p)) is not r:  # heavy's waiting work may go first
            serve(p, head)
            p.on_request_arrived(make_req(1000 + i, "heavy", prompt=40))
        serve(p, r)
        assert len(p.counters) <= 4 and len(p.served) <= 4
        assert "heavy" in p.counters  # it has work waiting or running: never forgotten
    assert p.forgotten_sessions >= 95
    assert p.stats()["sessions"] == len(p.counters)
    serve(p, running)
    # a forgotten session that returns is lifted to the clock like a newcomer, not 0
    p.on_request_arrived(make_req(5000, "drive-by-0"))
    assert p.counters["drive-by-0"] > 0
