"""Traces (SPEC T6): records saved, loaded and replayed without a model; derived views.

The traces here are recorded once per module on a tiny random Llama, saved to JSON,
and every test that can reads them back from the file: what a replay sees.
"""

from __future__ import annotations

import random

import pytest

from minserve import SamplingParams
from minserve.inspection import viz
from minserve.inspection.stepper import Stepper
from minserve.inspection.trace import (
    DECODE,
    FINISHED,
    HELD,
    PREFILL,
    PREFILL_WAIT,
    QUEUED,
    REJECTED,
    Trace,
    TraceRecorder,
    describe_tick,
    request_states,
    service_by_session,
    snapshot_record,
)
from minserve.records import AdmitRecord, DecodeRecord, EvictRecord, PrefillRecord, TickRecord

from .conftest import make_engine


def record_workload(model, **cfg) -> TraceRecorder:
    """Mixed work: a shared prefix, two sessions, a held head, a late arrival."""
    rng = random.Random(0)
    prefix = [rng.randrange(1, 256) for _ in range(8)]
    rec = TraceRecorder(make_engine(model, **cfg))
    for i in range(5):
        tail = [rng.randrange(1, 256) for _ in range(3 + 2 * i)]
        rec.submit(prefix + tail, SamplingParams(max_tokens=3 + i), session_id=("a", "b")[i % 2])
    rec.step()
    rec.step()
    rec.submit(prefix + [7, 7, 7], SamplingParams(max_tokens=4), session_id="c")
    rec.run()
    return rec


@pytest.fixture(scope="module")
def saved(tiny_model, tmp_path_factory):
    """{name: path of a saved trace}: padded/fcfs, paged/fair, chunked/padded."""
    out = tmp_path_factory.mktemp("traces")
    runs = {"padded": {}, "paged_fair": {"backend": "paged", "policy": "fair"},
            "chunked": {"prefill_chunk_size": 5}}
    paths = {}
    for name, cfg in runs.items():
        rec = record_workload(tiny_model, max_batch_size=3, block_size=4, num_blocks=24, **cfg)
        paths[name] = rec.trace().save(out / f"{name}.json")
    return paths


def test_trace_round_trips_through_json_unchanged(saved):
    for path in saved.values():
        trace = Trace.load(path)
        assert trace.to_dict() == Trace.from_dict(trace.to_dict()).to_dict()
        again = trace.save(path.with_suffix(".again.json"))
        assert again.read_text() == path.read_text()
        rec = trace.ticks[0]
        assert isinstance(rec, TickRecord)
        assert isinstance(rec.admit, AdmitRecord) and isinstance(rec.prefill, PrefillRecord)
        assert isinstance(rec.evict, EvictRecord) and isinstance(rec.decode, DecodeRecord)
        assert [r.tick for r in trace.ticks] == list(range(1, len(trace) + 1))


def test_a_saved_trace_replays_into_every_figure_without_a_model(saved, monkeypatch):
    """Replay needs the JSON file only: building an engine or a model would fail here."""
    import minserve.engine
    import minserve.models

    def no(*a, **k):
        raise AssertionError("a replay must not need a model or an engine")

    monkeypatch.setattr(minserve.engine.Engine, "__init__", no)
    monkeypatch.setattr(minserve.models, "load_model", no)
    monkeypatch.setattr(minserve.models, "tiny_llama", no)
    for path in saved.values():
        trace = Trace.load(path)
        for rec in trace.ticks:
            for fig in (viz.queues(rec, trace), viz.batch(rec, trace), viz.kv_blocks(rec, trace)):
                assert fig.to_dict()["data"] is not None
        for fig in (viz.timeline(trace), viz.fairness(trace), viz.work(trace)):
            assert fig.data


def test_recorder_cards_keep_arrival_tick_outputs_and_g1_refusals(tiny_model):
    rec = TraceRecorder(make_engine(tiny_model, max_queue_size=1, max_batch_size=1))
    ok = rec.submit([1, 2, 3], SamplingParams(max_tokens=2), session_id="s")
    refused = rec.submit([4, 5], SamplingParams(max_tokens=2))  # pending is full: G1
    rec.run()
    trace = rec.trace()
    card = trace.requests[ok.request_id]
    assert card["arrival_tick"] == 1 and card["session"] == "s" and card["prompt_len"] == 3
    assert card["output_token_ids"] == ok.output.token_ids and card["finish_reason"] == "length"
    bad = trace.requests[refused.request_id]
    assert bad["rejection"]["gate"] == "G1"
    assert request_states(trace)[refused.request_id] == [
        {"tick": 1, "state": REJECTED, "detail": "G1 queue_full"}]


def test_phases_run_one_by_one_record_the_same_tick_as_engine_step(tiny_model):
    """snapshot_record after T1..T4 == the scheduler's own TickRecord (figures see the same)."""
    engines = [make_engine(tiny_model, max_batch_size=2, block_size=4, num_blocks=16)
               for _ in range(2)]
    stepper = Stepper(engines[1])
    for e in engines:
        e.trace = e.trace if e.trace is not None else []
        for i in range(3):
            e.submit([i + 1] * (4 + i), SamplingParams(max_tokens=3), session_id=f"s{i}")
    for _ in range(6):
        whole = engines[0].step()
        for _ in range(4):
            stepper.next_phase()
        parts = engines[1].trace[-1]
        a, b = whole.to_dict(), parts.to_dict()
        a.pop("duration_s"), b.pop("duration_s")
        assert a == b


def test_snapshot_after_admit_shows_admitted_rows_before_any_forward(tiny_model):
    engine = make_engine(tiny_model, max_batch_size=1)
    engine.submit([1, 2, 3], SamplingParams(max_tokens=2))
    engine.submit([4, 5, 6], SamplingParams(max_tokens=2))
    admit = engine.scheduler.admit_pending()
    rec = snapshot_record(engine, admit)
    assert rec.tick == 1 and rec.queues["prefilling"] == ["req-0"]
    assert rec.queues["pending"] == ["req-1"] and rec.admit.held["request_id"] == "req-1"
    assert rec.requests["req-0"]["computed"] == 0 and rec.prefill.chunks == []


def test_request_states_follow_the_tick_order_t1_to_t4(saved):
    trace = Trace.load(saved["padded"])
    states = request_states(trace)
    # monolithic: admitted, prefilled and decoded in the same tick, prefill first (T2 < T4)
    first = states["req-0"][:2]
    assert [(e["tick"], e["state"]) for e in first] == [(1, PREFILL), (1, DECODE)]
    # batch of 3 rows: req-3 waits at the head (held), req-4 behind it (queued)
    assert {e["state"] for e in states["req-3"] if e["tick"] == 1} == {HELD}
    assert {e["state"] for e in states["req-4"] if e["tick"] == 1} == {QUEUED}
    for rid, events in states.items():
        assert events[-1]["state"] == FINISHED, rid  # everyone drained
        ticks = [e["tick"] for e in events]
        assert ticks == sorted(ticks)


def test_chunked_prefill_shows_every_prefilling_row_advancing_each_tick(saved):
    """C1 in the records: each prefilling row pushes its own chunk every tick, so no
    row ever sits in `prefilling` without a chunk (PREFILL_WAIT) waiting for others."""
    trace = Trace.load(saved["chunked"])
    states = request_states(trace)
    chunks = [e for evs in states.values() for e in evs if e["state"] == PREFILL]
    assert len(chunks) > len(states)  # at least one prompt took several chunks
    assert not any(e["state"] == PREFILL_WAIT for evs in states.values() for e in evs)
    assert any(len(rec.prefill.chunks) > 1 for rec in trace.ticks)  # rows prefill side by side
    for rec in trace.ticks:  # never more than prefill_chunk_size prompt tokens per row
        assert all(c["end"] - c["start"] <= 5 for c in rec.prefill.chunks)


def test_service_by_session_equals_what_the_fair_policy_charged(saved):
    """P3 from the records alone == the policy's own `served` counts, every tick."""
    trace = Trace.load(saved["paged_fair"])
    service = service_by_session(trace)
    w_in, w_out = trace.config["fair_w_in"], trace.config["fair_w_out"]
    for i, rec in enumerate(trace.ticks):
        for s, served in rec.policy["served"].items():
            expected = w_in * served["prompt_tokens"] + w_out * served["output_tokens"]
            assert service[s][i] == pytest.approx(expected), (rec.tick, s)


def test_describe_tick_names_every_phase_and_the_reservation(saved):
    trace = Trace.load(saved["padded"])
    text = describe_tick(trace[0])
    for word in ("tick 1", "T1 admit_pending", "T2 advance_prefill_chunk", "T3 evict_finished",
                 "T4 decode_step", "active_kv_reserved"):
        assert word in text
    assert "held req-3 at the head (batch batch_full: rows=3, max_batch_size=3)" in text


def test_trace_from_engine_keeps_config_and_derived_sizes(tiny_model):
    engine = make_engine(tiny_model, block_size=4, num_blocks=10, kv_budget_tokens=30)
    engine.trace = []
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    trace = Trace.from_engine(engine)
    assert trace.config["num_blocks"] == 10 and trace.config["kv_budget_tokens"] == 30
    assert trace.config["block_size"] == 4 and len(trace) == len(engine.trace) > 0
    assert trace.request_ids() == ["req-0"]


def test_worker_ticks_keep_the_state_copy_only_for_a_trace_and_step_mode_always(tiny_model):
    """The serving worker's ticks skip the copy of the state after the tick (nobody reads
    it) unless a trace is kept; a trace and step mode always get the whole record (T6)."""
    engine = make_engine(tiny_model, backend="paged", block_size=8)
    trace = engine.trace = []
    engine.start()
    try:
        engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4))
        assert engine.scheduler.snapshot_ticks  # a trace: the worker copies the state
        engine.trace = None
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
        assert not engine.scheduler.snapshot_ticks  # no trace: it does not
    finally:
        engine.stop()
    assert trace and all(r.blocks is not None and r.backend for r in trace)
    assert any(r.queues["active"] for r in trace)
    h = engine.submit([1, 2, 3], SamplingParams(max_tokens=2))
    rec = engine.step()  # step mode again: the whole record, blocks included
    assert engine.scheduler.snapshot_ticks and rec.blocks is not None
    assert rec.requests[h.request_id]["prompt_len"] == 3
