"""Scheduler invariants: queues (Q), records (T6), reservation (R1, R2), mask width (R3)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minserve import EngineConfig, SamplingParams
from minserve.models import tiny_llama

from .conftest import PHASES, hf_greedy, make_engine, run_checked

BACKENDS = ["padded", "paged"]


# --------------------------------------------------------------------------- T6
# (T5, the phase order, is pinned by behaviour in test_tick_order.py)
def test_step_returns_one_record_per_phase_and_the_queues(tiny_model):
    engine = make_engine(tiny_model, max_batch_size=1)
    a = engine.submit([1, 2], SamplingParams(max_tokens=3))
    b = engine.submit([3, 4], SamplingParams(max_tokens=3))
    rec = engine.step()
    assert rec.queues == {"pending": [b.request_id], "prefilling": [], "active": [a.request_id]}
    assert rec.admit.held["rejection"]["reason"] == "batch_full"
    d = rec.to_dict()
    assert set(d) >= {"tick", "admit", "prefill", "evict", "decode", "queues", "requests"}


# --------------------------------------------------------------------------- R3
@pytest.mark.parametrize("backend", BACKENDS)
def test_longest_row_evicted_mid_flight_keeps_mask_and_tokens_right(tiny_model, backend):
    """SPEC R3 regression: evict the longest row while others decode and new rows splice in."""
    engine = make_engine(tiny_model, backend=backend, max_batch_size=3, enable_prefix_caching=False)
    plan = [(list(range(1, 61)), 2), ([7, 8, 9, 10, 11], 20), (list(range(20, 30)), 20),
            ([3, 4, 5], 8), (list(range(100, 140)), 6)]  # 0 is longest and leaves first
    handles = [engine.submit(p, SamplingParams(max_tokens=n)) for p, n in plan]
    widths = []

    def on_phase(name, rec):
        if name == "decode_step" and engine.scheduler.active and backend == "padded":
            b = engine.scheduler.backend
            widths.append(b.width)
            assert b.width == b.kv_length  # trimmed on removal: no all-padding column

    run_checked(engine, on_phase=on_phase)
    if backend == "padded":
        assert min(widths[3:]) < max(widths), "width should shrink once the longest row left"
    for (p, n), h in zip(plan, handles):
        assert h.output.token_ids == hf_greedy(tiny_model, p, n)


# --------------------------------------------------------------------------- cancellation
@pytest.mark.parametrize("backend", BACKENDS)
def test_cancel_in_every_queue_releases_everything(tiny_model, backend):
    engine = make_engine(tiny_model, backend=backend, max_batch_size=2, prefill_chunk_size=4)
    active = engine.submit([1, 2, 3], SamplingParams(max_tokens=50))
    prefilling = engine.submit(list(range(10, 50)), SamplingParams(max_tokens=50))
    pending = engine.submit([9, 9], SamplingParams(max_tokens=50))
    for _ in range(3):
        engine.step()
    s = engine.scheduler
    assert [r.request_id for r in s.active] == [active.request_id]
    assert [r.request_id for r in s.prefilling] == [prefilling.request_id]
    assert [r.request_id for r in s.pending] == [pending.request_id]
    pending.cancel()  # pending: dropped at once
    assert pending.finished and pending.output.finish_reason == "cancelled"
    s.check_invariants()
    prefilling.cancel()
    active.cancel()
    engine.step()
    s.check_invariants()
    assert prefilling.output.finish_reason == "cancelled" and active.output.finish_reason == "cancelled"
    assert s.is_drained()


# --------------------------------------------------------------------------- R1/R2 under random traffic
REQS = st.lists(st.tuples(
    st.integers(0, 8),  # arrival tick
    st.integers(0, 2),  # which shared prefix (prefix-cache traffic)
    st.integers(1, 30),  # own prompt tokens
    st.integers(1, 10),  # max_tokens
    st.one_of(st.none(), st.integers(0, 12)),  # cancel at tick
    st.integers(0, 1),  # priority
), min_size=1, max_size=12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=REQS, backend=st.sampled_from(BACKENDS), batch=st.integers(1, 4),
       chunk=st.sampled_from([0, 4, 9]), budget=st.sampled_from([None, 60, 90]),
       queue=st.integers(2, 8), prefix=st.booleans(), policy=st.sampled_from(["fcfs", "fair"]))
def test_reservation_and_queues_hold_after_every_phase_of_random_traces(
        micro_model, reqs, backend, batch, chunk, budget, queue, prefix, policy):
    engine = make_engine(micro_model, backend=backend, max_batch_size=batch, prefill_chunk_size=chunk,
                         kv_budget_tokens=budget, max_queue_size=queue, block_size=4, num_blocks=40,
                         enable_prefix_caching=prefix, policy=policy)
    prefixes = [list(range(1, 9)), list(range(50, 62)), []]
    handles, tick = [], 0
    while tick < 200:
        for (at, pre, own, mt, cancel_at, prio) in reqs:
            if at == tick:
                prompt = prefixes[pre] + [(tick * 7 + k) % 97 + 1 for k in range(own)]
                h = engine.submit(prompt, SamplingParams(max_tokens=mt), priority=prio,
                                  session_id=f"s{pre}")
                handles.append((h, cancel_at))
        for h, cancel_at in handles:
            if cancel_at == tick:
                h.cancel()
        engine.scheduler.check_invariants()
        for name in PHASES:
            getattr(engine.scheduler, name)()
            engine.scheduler.check_invariants()
        tick += 1
        if tick > 8 and not engine.scheduler.has_work():
            break
    assert engine.scheduler.is_drained(), "R2: everything released after the traffic drains"
    for h, _ in handles:
        out = h.output
        assert out is not None and out.finish_reason in {"stop", "length", "cancelled", "error"}
        if out.finish_reason == "error":
            assert out.rejection["gate"] in {"G1", "G2", "G3"}
        assert len(out.token_ids) <= 10


@pytest.fixture(scope="module")
def micro_model():
    return tiny_llama(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, eos_token_id=0)


def test_config_rejects_unknown_and_unbuilt_modes():
    # C2: every (mode, backend) pair that is not built fails loudly at construction
    with pytest.raises(ValueError, match="built on the paged backend, not backend='padded'"):
        EngineConfig(prefill_mode="mixed_batch")
    assert EngineConfig(prefill_mode="mixed_batch", backend="paged").prefill_mode == "mixed_batch"
    with pytest.raises(ValueError, match="disaggregated' is built on the paged backend"):
        EngineConfig(prefill_mode="disaggregated")
    with pytest.raises(ValueError, match="max_batch_size"):
        EngineConfig(max_batch_size=0)
    with pytest.raises(ValueError, match="policy"):
        EngineConfig(policy="lifo")
    with pytest.raises(TypeError):
        EngineConfig(max_batch=3)
    assert EngineConfig(prefill_chunk_size=16).prefill_mode == "chunked"
    assert EngineConfig().prefill_mode == "monolithic"


def test_config_replace_derives_a_derived_prefill_mode_again():
    """C2: an empty mode follows the chunk size, also through `replace`."""
    base = EngineConfig()
    assert base.replace(prefill_chunk_size=16).prefill_mode == "chunked"
    assert base.replace(prefill_chunk_size=16).replace(prefill_chunk_size=0).prefill == "monolithic"
    # a mode that was named stays named (and a contradiction fails loudly)
    named = EngineConfig(prefill_mode="monolithic")
    assert named.replace(max_batch_size=2).prefill_mode == "monolithic"
    with pytest.raises(ValueError, match="chunked"):
        EngineConfig(prefill_mode="chunked", prefill_chunk_size=8).replace(prefill_chunk_size=0)
    import dataclasses
    assert "_derived_prefill_mode" not in dataclasses.asdict(base)  # not a knob
