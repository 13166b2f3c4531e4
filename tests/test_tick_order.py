"""The tick's phase order (SPEC T5), pinned by behaviour, not by the order's name.

The order admit → prefill → evict → decode is the only one in which four
behaviours all hold; together they leave no other order of the four phases:

    admit   before prefill  a request admitted this tick streams its first token
                            this tick (monolithic prefill)
    prefill before decode   ... and joins this tick's decode batch: a new row gets
                            two tokens in its first tick, no idle tick in the batch
    prefill before evict    a request finished by its first token (max_tokens=1,
                            or EOS) leaves in the same tick: its reservation and
                            blocks are back before the next tick's admission
    evict   before decode   a finished row is never decoded again: every request
                            gets exactly max_tokens tokens (or stops at EOS), and
                            each token after the first came from one decode step

(The last one alone would also allow "decode, then evict" at the end of a tick;
the second rules that out.)

What the order costs: admission runs before eviction, so a row that finished in
tick t's decode is evicted by tick t+1's T3, after tick t+1's T1 ran: its slot
is refilled in tick t+2. One tick of an idle slot per finished row.

`test_every_reordering_fails_a_behavioural_check` runs all 23 other orders
through the same four checks and requires each to fail at least one.
"""

from __future__ import annotations

import itertools

import pytest

from minserve import SamplingParams

from .conftest import PHASES, make_engine

BACKENDS = ["padded", "paged"]


def tick_in_order(engine, order=PHASES):
    """One tick with the phases in `order` (the canonical one: exactly `Scheduler.step`)."""
    s = engine.scheduler
    recs = {}
    for name in order:
        recs[name] = getattr(s, name)()
        s.check_invariants()
    return s.end_tick(*(recs[name] for name in PHASES))


# --------------------------------------------------------------------------- the three behaviours
def first_token_streams_in_the_tick_of_admission(model, backend, order):
    engine = make_engine(model, backend=backend, max_batch_size=2)
    h = engine.submit([1, 2, 3, 4], SamplingParams(max_tokens=5))
    rec = tick_in_order(engine, order)
    assert [a["request_id"] for a in rec.admit.admitted] == [h.request_id]
    assert h.events and h.events[0].index == 0, \
        "admitted this tick but no first token this tick: prefill must follow admit (T5)"


def admitted_row_joins_the_decode_batch_of_the_same_tick(model, backend, order):
    engine = make_engine(model, backend=backend, max_batch_size=2)
    h = engine.submit([1, 2, 3, 4], SamplingParams(max_tokens=5))
    rec = tick_in_order(engine, order)
    assert rec.decode.rows == [h.request_id] and len(h.events) == 2, \
        "promoted this tick but not decoded this tick: decode must follow prefill (T5)"


def request_finished_by_its_first_token_leaves_in_the_same_tick(model, backend, order):
    engine = make_engine(model, backend=backend, max_batch_size=2)
    h = engine.submit([1, 2, 3, 4], SamplingParams(max_tokens=1))
    tick_in_order(engine, order)
    assert h.finished and len(h.output.token_ids) == 1
    assert engine.scheduler.is_drained(), \
        "finished by its first token, but still holds its row / reservation after the tick: " \
        "evict must follow prefill (T5)"


def finished_row_is_never_decoded_again(model, backend, order):
    engine = make_engine(model, backend=backend, max_batch_size=3)
    plan = [([5, 6, 7], 2), ([8] * 5, 4), ([9, 10], 1), ([11] * 7, 3), ([12, 13, 14, 15], 5)]
    handles = [engine.submit(p, SamplingParams(max_tokens=n)) for p, n in plan]
    decoded = {h.request_id: 0 for h in handles}
    for _ in range(100):
        if not engine.scheduler.has_work():
            break
        rec = tick_in_order(engine, order)
        for rid in rec.decode.rows:
            decoded[rid] += 1
    assert not engine.scheduler.has_work()
    for (_, n), h in zip(plan, handles):
        out = h.output
        assert len(out.token_ids) == n or out.finish_reason == "stop"
        assert len(out.token_ids) <= n, "decoded past max_tokens: a finished row was decoded"
        assert decoded[h.request_id] == len(out.token_ids) - 1


CHECKS = [first_token_streams_in_the_tick_of_admission,
          admitted_row_joins_the_decode_batch_of_the_same_tick,
          request_finished_by_its_first_token_leaves_in_the_same_tick,
          finished_row_is_never_decoded_again]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_canonical_tick_order_holds(tiny_model, backend, check):
    check(tiny_model, backend, PHASES)


def test_step_runs_the_phases_in_the_canonical_order(tiny_model, monkeypatch):
    """`Scheduler.step` (what the worker runs) is the order the checks above accept."""
    engine = make_engine(tiny_model, max_batch_size=2)
    calls = []
    for name in PHASES:
        real = getattr(engine.scheduler, name)
        monkeypatch.setattr(engine.scheduler, name,
                            lambda real=real, name=name: (calls.append(name), real())[1])
    engine.submit([1, 2, 3], SamplingParams(max_tokens=2))
    engine.step()
    assert tuple(calls) == PHASES


OTHER_ORDERS = [o for o in itertools.permutations(PHASES) if o != PHASES]


@pytest.mark.parametrize("order", OTHER_ORDERS, ids=lambda o: "-".join(p.split("_")[0] for p in o))
def test_every_reordering_fails_a_behavioural_check(tiny_model, order):
    failed = []
    for check in CHECKS:
        for backend in BACKENDS:
            try:
                check(tiny_model, backend, order)
            except (AssertionError, RuntimeError) as e:
                failed.append((check.__name__, backend, str(e).splitlines()[0][:120]))
    assert failed, f"order {order} passed every behavioural check of T5"
    assert len(failed) >= 2, "each reordering should be caught on both backends"
