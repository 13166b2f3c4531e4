"""admission="preempt" (P6): admit on the prompt's need, preempt a running row when decode
would run out of KV, recompute it on re-admission; the client's stream never notices."""

from __future__ import annotations

import random

import pytest

from minserve import EngineConfig, SamplingParams

from .conftest import hf_greedy, make_engine, run_checked

random.seed(0)
PROMPTS = [[random.randrange(1, 256) for _ in range(n)] for n in (9, 14, 5, 11, 7, 13)]
NEW = 14

# Small enough that six rows cannot all grow to the end together: preemption must happen.
SETUPS = {
    "padded": dict(backend="padded", kv_budget_tokens=90),
    "padded-chunked": dict(backend="padded", kv_budget_tokens=90, prefill_chunk_size=4),
    "paged": dict(backend="paged", num_blocks=24, block_size=4),
    "paged-mixed": dict(backend="paged", num_blocks=24, block_size=4,
                        prefill_mode="mixed_batch", prefill_chunk_size=5),
}


def run(model, admission, setup, prompts=PROMPTS, new=NEW, params=None, **extra):
    engine = make_engine(model, admission=admission, max_batch_size=6, **{**setup, **extra})
    engine.trace = []
    handles = [engine.submit(p, params or SamplingParams(max_tokens=new)) for p in prompts]
    ticks = run_checked(engine)  # R1 and the queues checked after every phase
    assert engine.scheduler.is_drained()
    return engine, handles, ticks


@pytest.mark.parametrize("setup", SETUPS, ids=list(SETUPS))
def test_preempted_rows_stream_on_exactly_as_hf_generate_alone(tiny_model, setup):
    engine, handles, ticks = run(tiny_model, "preempt", SETUPS[setup])
    stats = engine.stats()
    assert stats["preemptions"] >= 2, stats["preemptions"]  # it really happened
    assert stats["recomputed_tokens"] > 0
    for p, h in zip(PROMPTS, handles):
        assert h.output.token_ids == hf_greedy(tiny_model, p, NEW)
        # the stream: every token once, in order, no gap or repeat across a preemption
        indices = [ev.index for ev in h.events if ev.token_id is not None]
        assert indices == list(range(len(h.output.token_ids)))
    preempted = [p for t in ticks for p in t["decode_step"].preempted]
    assert len(preempted) == stats["preemptions"]
    assert all(p["released_tokens"] > 0 and p["why"] for p in preempted)
    # a preempted request came back: its recompute showed in a later admission
    assert any(a["recompute"] > 0 for t in ticks for a in t["admit_pending"].admitted)


@pytest.mark.parametrize("setup", ["padded", "paged"])
def test_reserve_never_preempts_and_runs_fewer_rows_at_once(tiny_model, setup):
    """The trade-off in one number: at the same KV budget, reserve admits on prompt +
    max_tokens and so runs fewer rows side by side; preempt runs more, and pays in
    recomputation."""
    runs = {}
    for admission in ("reserve", "preempt"):
        engine, handles, ticks = run(tiny_model, admission, SETUPS[setup])
        rows = max(len(t["decode_step"].rows) for t in ticks)
        runs[admission] = (engine.stats()["preemptions"], rows,
                           [h.output.token_ids for h in handles])
    assert runs["reserve"][0] == 0 and runs["preempt"][0] > 0
    assert runs["preempt"][1] > runs["reserve"][1], runs
    assert runs["reserve"][2] == runs["preempt"][2]  # the same tokens either way


@pytest.mark.parametrize("setup", ["padded", "paged"])
def test_a_request_that_could_never_fit_alone_is_still_refused_at_once(tiny_model, setup):
    engine = make_engine(tiny_model, admission="preempt", **SETUPS[setup])
    h = engine.submit(list(range(1, 40)), SamplingParams(max_tokens=200))
    engine.step()
    assert h.output.finish_reason == "error"
    assert h.output.rejection["gate"] in ("G2", "G3") and h.output.rejection["hard"]
    assert engine.scheduler.is_drained()


def test_the_victim_is_the_lowest_priority_then_the_latest_arrival(tiny_model):
    engine = make_engine(tiny_model, admission="preempt", max_batch_size=4, backend="padded",
                         kv_budget_tokens=60)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    early = engine.submit(PROMPTS[0], params, priority=0)
    high = engine.submit(PROMPTS[1], params, priority=1)  # arrives second, outranks both
    late = engine.submit(PROMPTS[3], params, priority=0)
    ticks = run_checked(engine)
    victims = [p["request_id"] for t in ticks for p in t["decode_step"].preempted]
    assert victims and victims[0] == late.request_id, victims
    assert high.request_id not in victims
    for h, p in ((early, PROMPTS[0]), (high, PROMPTS[1]), (late, PROMPTS[3])):
        assert h.output.token_ids == hf_greedy(tiny_model, p, NEW) or params.ignore_eos


def test_fair_policy_keeps_the_counter_and_never_charges_recomputation(tiny_model):
    engine, handles, _ = run(tiny_model, "preempt", SETUPS["paged"], policy="fair",
                             params=SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert engine.stats()["preemptions"] > 0
    served = engine.scheduler.policy.served["default"]
    # every prompt token and every output token charged exactly once
    assert served["prompt_tokens"] == sum(len(p) for p in PROMPTS)
    assert served["output_tokens"] == NEW * len(PROMPTS)
    assert engine.scheduler.policy.counters["default"] == pytest.approx(
        sum(len(p) for p in PROMPTS) + 2.0 * NEW * len(PROMPTS))


def test_cancelling_a_preempted_request_while_it_waits_gives_everything_back(tiny_model):
    engine = make_engine(tiny_model, admission="preempt", max_batch_size=6, policy="fair",
                         **SETUPS["paged"])
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    handles = [engine.submit(p, params) for p in PROMPTS]
    s = engine.scheduler
    for _ in range(200):
        engine.step()
        s.check_invariants()
        waiting = [r for r in s.pending if r.num_preemptions]
        if waiting:
            break
    assert waiting, "nothing was preempted"
    victim = waiting[0]
    assert engine.cancel(victim.request_id)
    run_checked(engine)
    done = {h.request_id: h.output for h in handles}
    assert done[victim.request_id].finish_reason == "cancelled"
    assert s.is_drained() and s.policy._running == {}


def test_config_names_the_two_admission_modes():
    assert EngineConfig().admission == "reserve"
    with pytest.raises(ValueError, match="admission='evict'"):
        EngineConfig(admission="evict")


@pytest.mark.real_model
@pytest.mark.parametrize("backend", ["padded", "paged"])
def test_real_model_preemption_is_token_exact(real_model, real_oracle, backend):
    model, tok = real_model
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in (
        "The capital of France is", "Water boils at a temperature of",
        "One, two, three, four,", "The largest planet in our solar system is")]
    setup = (dict(kv_budget_tokens=56) if backend == "padded"
             else dict(num_blocks=10, block_size=8))
    engine = make_engine(model, tok, backend=backend, admission="preempt", max_batch_size=4,
                         **setup)
    handles = [engine.submit(p, SamplingParams(max_tokens=12, ignore_eos=True))
               for p in prompts]
    run_checked(engine)
    assert engine.stats()["preemptions"] > 0
    for p, h in zip(prompts, handles):
        assert h.output.token_ids == real_oracle(p, 12)


def test_the_trace_and_the_timeline_show_each_preemption(tiny_model):
    from minserve.inspection import viz
    from minserve.inspection.trace import PREEMPTED, TraceRecorder, request_states

    rec = TraceRecorder(make_engine(tiny_model, admission="preempt", max_batch_size=6,
                                    **SETUPS["paged"]))
    for p in PROMPTS:
        rec.submit(p, SamplingParams(max_tokens=NEW))
    while rec.engine.scheduler.has_work():
        rec.step()
    trace = rec.trace()
    marks = [(rid, ev["tick"]) for rid, evs in request_states(trace).items() for ev in evs
             if ev["state"] == PREEMPTED]
    assert len(marks) == rec.engine.stats()["preemptions"] > 0
    fig = viz.timeline(trace)
    drawn = [t for t in fig.data if t.name == PREEMPTED]
    assert drawn and len(drawn[0].x) == len(marks)
    assert sorted(drawn[0].x) == sorted(t for _, t in marks)
