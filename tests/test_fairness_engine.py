"""Policies inside the running engine (SPEC P1, P2, P4): who gets the next free row."""

from __future__ import annotations

import pytest

from minserve import SamplingParams

from .conftest import make_engine, run_checked


def _admission_order(engine) -> list[str]:
    order: list[str] = []
    run_checked(engine, on_phase=lambda name, rec: order.extend(
        a["request_id"] for a in rec.admitted) if name == "admit_pending" else None)
    return order


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_light_session_is_served_ahead_of_a_heavy_backlog_only_under_vtc(tiny_model, policy):
    engine = make_engine(tiny_model, policy=policy, max_batch_size=2)
    heavy = [engine.submit([3] * 20, SamplingParams(max_tokens=6, ignore_eos=True), session_id="heavy")
             for _ in range(8)]
    for _ in range(4):  # heavy is being served and charged
        engine.step()
    light = engine.submit([4] * 5, SamplingParams(max_tokens=6, ignore_eos=True), session_id="light")
    waiting_heavy = [h.request_id for h in heavy if not h.events]
    order = _admission_order(engine)
    pos = order.index(light.request_id)
    if policy == "fair":
        assert pos == 0, "VTC: the light session goes before the heavy backlog"
        stats = engine.stats()["policy"]
        assert set(stats["counters"]) == {"heavy", "light"}
        assert stats["served"]["light"]["output_tokens"] == 6
    else:
        assert order[:pos] == waiting_heavy, "FCFS: the light request waits behind all of heavy"
    assert engine.scheduler.is_drained()


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_higher_priority_is_admitted_first_under_both_policies(tiny_model, policy):
    engine = make_engine(tiny_model, policy=policy, max_batch_size=1)
    low = [engine.submit([1, 2], SamplingParams(max_tokens=2), session_id=f"s{i}") for i in range(3)]
    high = engine.submit([5, 6], SamplingParams(max_tokens=2), priority=5, session_id="vip")
    order = _admission_order(engine)
    assert order[0] == high.request_id
    if policy == "fcfs":
        assert order[1:] == [h.request_id for h in low]


def test_new_session_is_lifted_not_reset_to_zero(tiny_model):
    engine = make_engine(tiny_model, policy="fair", max_batch_size=1)
    for _ in range(4):
        engine.submit([3] * 10, SamplingParams(max_tokens=4, ignore_eos=True), session_id="a")
        engine.submit([3] * 10, SamplingParams(max_tokens=4, ignore_eos=True), session_id="b")
    for _ in range(12):
        engine.step()
    counters = engine.stats()["policy"]["counters"]
    engine.submit([5] * 3, SamplingParams(max_tokens=2), session_id="newcomer")
    lifted = engine.stats()["policy"]["counters"]["newcomer"]
    assert lifted == min(counters["a"], counters["b"]) > 0  # no catch-up burst, no starvation
    run_checked(engine)
