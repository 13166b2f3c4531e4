"""Backpressure (SPEC G1–G6): refuse, hold, or admit — always with a reason and its numbers."""

from __future__ import annotations

import pytest

from minserve import SamplingParams

from .conftest import make_engine, run_checked


def test_queue_full_refuses_at_submit_naming_gate_g1(tiny_model):
    engine = make_engine(tiny_model, max_queue_size=2)
    a = engine.submit([1, 2], SamplingParams(max_tokens=2))
    b = engine.submit([1, 3], SamplingParams(max_tokens=2))
    c = engine.submit([1, 4], SamplingParams(max_tokens=2))
    assert not a.finished and not b.finished
    assert c.finished and c.output.finish_reason == "error"
    rej = c.events[-1].rejection
    assert rej["gate"] == "G1" and rej["reason"] == "queue_full" and rej["hard"]
    assert rej["numbers"] == {"pending": 2, "max_queue_size": 2}
    assert engine.stats()["kv_admit_blocked"]["G1"] == 1
    run_checked(engine)
    assert a.output.finish_reason in ("stop", "length") and engine.scheduler.is_drained()


def test_kv_budget_soft_holds_the_head_then_admits_it_when_room_opens(tiny_model):
    engine = make_engine(tiny_model, kv_budget_tokens=40, max_batch_size=4)
    a = engine.submit([1] * 10, SamplingParams(max_tokens=20, ignore_eos=True))  # needs 30
    b = engine.submit([2] * 10, SamplingParams(max_tokens=10, ignore_eos=True))  # needs 20: 50 > 40
    c = engine.submit([3] * 2, SamplingParams(max_tokens=3, ignore_eos=True))  # needs 5: would fit
    rec = engine.scheduler.admit_pending()
    assert [x["request_id"] for x in rec.admitted] == [a.request_id]
    held = rec.held
    assert held["request_id"] == b.request_id
    r = held["rejection"]
    assert (r["gate"], r["reason"], r["hard"]) == ("G2", "kv_budget", False)
    assert r["numbers"] == {"need": 20, "active_kv_reserved": 30, "kv_budget_tokens": 40}
    # G4: the held head keeps its place; c does not jump the queue although it would fit
    assert [q.request_id for q in engine.scheduler.pending] == [b.request_id, c.request_id]
    admitted_order = []
    run_checked(engine, on_phase=lambda name, rec: admitted_order.extend(
        x["request_id"] for x in rec.admitted) if name == "admit_pending" else None)
    assert admitted_order == [b.request_id, c.request_id]
    assert all(h.output.finish_reason == "length" for h in (a, b, c))
    assert engine.stats()["kv_admit_blocked"]["G2"] >= 1


def test_request_that_can_never_fit_is_hard_rejected_with_numbers(tiny_model):
    engine = make_engine(tiny_model, kv_budget_tokens=40)
    big = engine.submit([1] * 30, SamplingParams(max_tokens=20))  # 50 > 40, alone
    ok = engine.submit([2] * 3, SamplingParams(max_tokens=2))
    rec = engine.scheduler.admit_pending()
    assert rec.rejected[0]["request_id"] == big.request_id
    r = big.output.rejection
    assert (r["gate"], r["reason"], r["hard"]) == ("G2", "kv_budget_exceeded", True)
    assert r["numbers"]["need"] == 50 and r["numbers"]["kv_budget_tokens"] == 40
    assert big.output.finish_reason == "error" and "40" in r["message"]
    assert [x["request_id"] for x in rec.admitted] == [ok.request_id]  # the next one still goes
    run_checked(engine)
    assert engine.stats()["rejected"]["G2"] == 1


@pytest.mark.parametrize("backend", ["padded", "paged"])
def test_block_pool_soft_holds_and_hard_rejects_gate_g3(tiny_model, backend):
    # 6 blocks of 4 tokens; budget large so only G3 decides.
    engine = make_engine(tiny_model, backend=backend, block_size=4, num_blocks=6,
                         kv_budget_tokens=1000, enable_prefix_caching=False)
    too_big = engine.submit(list(range(1, 30)), SamplingParams(max_tokens=1))  # 8 blocks > 6
    a = engine.submit(list(range(1, 14)), SamplingParams(max_tokens=2, ignore_eos=True))  # 4 blocks
    b = engine.submit(list(range(40, 53)), SamplingParams(max_tokens=2, ignore_eos=True))  # 4 more
    rec = engine.scheduler.admit_pending()
    r = too_big.output.rejection
    assert (r["gate"], r["reason"], r["hard"]) == ("G3", "prompt_exceeds_block_pool", True)
    assert r["numbers"]["prompt_blocks"] == 8 and r["numbers"]["num_blocks"] == 6
    assert [x["request_id"] for x in rec.admitted] == [a.request_id]
    h = rec.held["rejection"]
    assert (h["gate"], h["reason"], h["hard"]) == ("G3", "block_pool", False)
    assert h["numbers"]["blocks_needed"] == 4 and h["numbers"]["free_blocks"] == 2
    run_checked(engine)
    assert b.output.finish_reason == "length" and engine.scheduler.is_drained()
    s = engine.stats()
    assert s["kv_admit_blocked"]["G3"] >= 2 and s["rejected"]["G3"] == 1


def test_stats_surface_pressure_reservation_and_queue_lengths(tiny_model):
    engine = make_engine(tiny_model, max_batch_size=1, block_size=4, num_blocks=20)
    engine.submit([1] * 10, SamplingParams(max_tokens=5, ignore_eos=True))
    engine.submit([2] * 10, SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    s = engine.stats()
    assert s["queues"] == {"pending": 1, "prefilling": 0, "active": 1}
    assert s["active_kv_reserved"] == 15
    assert s["kv_pressure"] == pytest.approx(3 / 20)  # 10 prompt tokens -> 3 blocks of 4 in use
    assert s["kv_admit_blocked"]["batch"] == 1
    assert set(s["blocks"]) >= {"free", "used", "cached", "prefix_hit_rate"}


def test_paged_decode_never_runs_out_of_blocks_because_g3_counts_max_tokens(tiny_model):
    """Paged KV grows while decoding: 4 rows x 5 blocks would need 20 of 10 blocks.
    G3 admits only what can finish; without it decode would fail mid-flight."""
    engine = make_engine(tiny_model, backend="paged", block_size=4, num_blocks=10,
                         kv_budget_tokens=1000, max_batch_size=4, enable_prefix_caching=False)
    hs = [engine.submit([i + 1] * 3, SamplingParams(max_tokens=14, ignore_eos=True)) for i in range(4)]
    rec = engine.scheduler.admit_pending()
    assert len(rec.admitted) == 2
    assert rec.held["rejection"]["gate"] == "G3"
    run_checked(engine)
    assert all(h.output.finish_reason == "length" and len(h.output.token_ids) == 14 for h in hs)
    big = engine.submit([1] * 3, SamplingParams(max_tokens=40))  # 43 tokens = 11 blocks > 10
    engine.step()
    assert big.output.rejection["reason"] == "prompt_exceeds_block_pool"


@pytest.mark.parametrize("backend", ["padded", "paged"])
def test_a_request_bigger_than_the_pool_is_refused_at_once_even_behind_a_full_batch(tiny_model,
                                                                                    backend):
    """G3's hard reject is immediate: never held at the head as `batch_full` while the batch
    is busy (it used to be checked only once a row and G2 were free)."""
    engine = make_engine(tiny_model, backend=backend, max_batch_size=1, num_blocks=8,
                         block_size=4, kv_budget_tokens=10_000, enable_prefix_caching=False)
    busy = engine.submit([1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()  # the only batch row is taken
    big = engine.submit(list(range(1, 41)), SamplingParams(max_tokens=2))  # 10 blocks > 8
    behind = engine.submit([4, 5], SamplingParams(max_tokens=2))
    rec = engine.step()
    assert big.finished and big.output.rejection["gate"] == "G3"
    assert big.output.rejection["reason"] == "prompt_exceeds_block_pool"
    assert [r["request_id"] for r in rec.admit.rejected] == [big.request_id]
    assert rec.admit.held["request_id"] == behind.request_id  # the next one waits for the row
    assert not busy.finished


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_a_session_at_its_row_cap_lets_another_sessions_request_go_first(tiny_model, policy):
    """max_rows_per_session: a flood of one session cannot take every batch row, so a
    light user's request gets a row at the next admission instead of waiting for a
    flood request to finish (FCFS too, where the flood is ahead of it in the queue)."""
    engine = make_engine(tiny_model, policy=policy, max_batch_size=4, max_rows_per_session=3)
    flood = [engine.submit([1 + i, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True),
                           session_id="flood") for i in range(8)]
    rec = engine.step()
    assert len(rec.admit.admitted) == 3  # the fourth row is left to somebody else
    assert rec.admit.held["rejection"]["reason"] == "session_cap"
    light = engine.submit([7, 8], SamplingParams(max_tokens=2, ignore_eos=True),
                          session_id="light")
    rec = engine.step()
    assert [a["request_id"] for a in rec.admit.admitted] == [light.request_id]
    assert light.events and light.events[0].index == 0  # first token in that same tick
    for _ in range(200):
        if not engine.scheduler.has_work():
            break
        engine.step()
        s = engine.scheduler
        assert sum(r.session_id == "flood" for r in s.prefilling + s.active) <= 3
    assert all(h.output.finish_reason == "length" for h in flood + [light])
    assert engine.scheduler.is_drained()


def test_without_a_cap_the_light_request_waits_for_a_flood_row_to_free(tiny_model):
    engine = make_engine(tiny_model, policy="fair", max_batch_size=4)
    for i in range(8):
        engine.submit([1 + i, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True),
                      session_id="flood")
    engine.step()
    light = engine.submit([7, 8], SamplingParams(max_tokens=2, ignore_eos=True),
                          session_id="light")
    rec = engine.step()
    assert not rec.admit.admitted and not light.events  # every row is the flood's
    assert rec.admit.held["rejection"]["reason"] == "batch_full"
