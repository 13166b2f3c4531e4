"""engine.explain(request_id): where a request is and why, in data and one sentence."""

from __future__ import annotations

from minserve import SamplingParams

from .conftest import make_engine, run_checked

P = SamplingParams(max_tokens=6, ignore_eos=True)


def test_pending_behind_a_full_batch_names_the_rows_and_who_is_ahead(tiny_model):
    engine = make_engine(tiny_model, max_batch_size=2)
    running = [engine.submit([5, 6, 7], P) for _ in range(2)]
    engine.step()  # both rows taken
    waiting = [engine.submit([8, 9], P) for _ in range(3)]
    head, third = engine.explain(waiting[0].request_id), engine.explain(waiting[2].request_id)
    assert head["state"] == "pending" and head["position"] == 0
    assert head["held_by"]["reason"] == "batch_full"
    assert "the batch is full (2/2 rows)" in head["sentence"]
    assert third["ahead"] == 2 and "2 requests ahead of you" in third["sentence"]
    assert "batch is full" in third["sentence"]
    act = engine.explain(running[0].request_id)
    assert act["state"] == "active" and act["tokens_so_far"] >= 1
    assert act["sentence"].startswith("running:")


def test_pending_behind_g2_says_reserved_budget_and_need(tiny_model):
    engine = make_engine(tiny_model, max_batch_size=4, kv_budget_tokens=40)
    engine.submit(list(range(1, 20)), SamplingParams(max_tokens=15))  # reserves 34
    engine.step()
    h = engine.submit([3, 4, 5], SamplingParams(max_tokens=8))  # needs 11
    e = engine.explain(h.request_id)
    assert e["held_by"]["gate"] == "G2"
    assert e["held_by"]["numbers"] == {"need": 11, "active_kv_reserved": 34,
                                       "kv_budget_tokens": 40}
    assert "G2: 34 of 40 KV tokens are reserved, it needs 11" in e["sentence"]


def test_pending_behind_g3_says_free_blocks_and_need(tiny_model):
    engine = make_engine(tiny_model, backend="paged", max_batch_size=4, num_blocks=6,
                         block_size=4, kv_budget_tokens=1000)
    engine.submit(list(range(1, 12)), SamplingParams(max_tokens=9))  # 20 tokens: 5 blocks
    engine.step()
    h = engine.submit([3, 4, 5], SamplingParams(max_tokens=3))  # 6 tokens: 2 blocks
    e = engine.explain(h.request_id)
    assert e["held_by"]["gate"] == "G3"
    assert "G3: 1 free blocks, it needs 2" in e["sentence"]


def test_prefilling_counts_the_prompt_computed_so_far(tiny_model):
    engine = make_engine(tiny_model, prefill_chunk_size=4)
    h = engine.submit(list(range(1, 15)), P)
    engine.step()
    e = engine.explain(h.request_id)
    assert e["state"] == "prefilling" and e["computed"] == 4
    assert e["sentence"] == "prefilling: 4 of 14 prompt tokens computed"


def test_preempted_finished_and_unknown(tiny_model):
    engine = make_engine(tiny_model, admission="preempt", backend="paged", max_batch_size=6,
                         num_blocks=12, block_size=4)
    handles = [engine.submit(list(range(10 * i + 1, 10 * i + 9)), SamplingParams(
        max_tokens=14, ignore_eos=True)) for i in range(4)]
    seen = None
    for _ in range(300):
        engine.step()
        waiting = [r for r in engine.scheduler.pending if r.num_preemptions]
        if waiting:
            seen = engine.explain(waiting[0].request_id)
            break
    assert seen is not None, "nothing was preempted"
    assert seen["state"] == "pending" and seen["preemptions"] == 1
    assert "preempted once; re-admission recomputes" in seen["sentence"]
    run_checked(engine)
    done = engine.explain(handles[0].request_id)
    assert done["state"] == "finished" and done["finish_reason"] == "length"
    assert done["sentence"].startswith("finished (length): 14 tokens")
    assert engine.explain("no-such-id")["state"] == "unknown"


def test_fair_policy_shows_the_session_counter_against_the_lowest_waiting(tiny_model):
    engine = make_engine(tiny_model, policy="fair", max_batch_size=1)
    engine.submit([1, 2, 3], P, session_id="alice")
    engine.step()
    engine.submit([4, 5], P, session_id="bob")  # lifted to alice's counter now ...
    engine.step()
    engine.step()  # ... while alice, still running, is charged on
    mine = engine.submit([6, 7], P, session_id="alice")
    e = engine.explain(mine.request_id)
    assert e["fair"]["session_counter"] > e["fair"]["lowest_waiting_counter"]
    assert "your session's counter is" in e["sentence"]
