"""Failure isolation: an error in one row fails that row only and gives back what it held.

A fault is injected, once, into each backend method, each policy hook and the
sampler in turn, in the middle of a small workload. After every tick R1 and the
queue invariants hold (`check_invariants`); at the end everything is drained (R2),
every client got a final event, every request the fault did not hit produced
exactly the tokens of a fault-free run, and the engine serves the next request.

Which requests a fault may take down:

    fault in                                 fails
    begin_prefill, prefill_chunk, promote,   the one row it was working on
    on_tokens_processed, the sampler
    on_request_arrived                       the request being submitted (submit raises)
    decode_step_batched                      the rows of that one batched forward
    remove_row, peek_next, pick_next         the rows in flight (the tick raised outside
                                             any one row: the worker's `recover`)
    on_request_finished                      nobody: the client still gets its end
"""

from __future__ import annotations

import pytest

from minserve import SamplingParams

from .conftest import make_engine

PLAN = [([1, 2, 3, 4, 5], 6), ([9, 8, 7], 9), (list(range(20, 45)), 5), ([11, 12], 7),
        (list(range(50, 60)), 4)]
ONE_ROW = {"begin_prefill", "prefill_chunk", "promote", "on_tokens_processed", "sample_row",
           "on_request_arrived"}
FAULTS = [("backend", m) for m in ("begin_prefill", "prefill_chunk", "promote",
                                  "decode_step_batched", "remove_row")] + \
         [("policy", m) for m in ("on_request_arrived", "peek_next", "pick_next",
                                  "on_tokens_processed", "on_request_finished")] + \
         [("sampler", "sample_row")]


class Injected(RuntimeError):
    pass


def inject(obj, method: str, at_call: int) -> dict:
    """Make `obj.method` raise once, on call number `at_call`; other calls are real."""
    real = getattr(obj, method)
    state = {"calls": 0, "fired": False}

    def faulty(*args, **kwargs):
        state["calls"] += 1
        if state["calls"] == at_call:
            state["fired"] = True
            raise Injected(f"injected fault in {method}")
        return real(*args, **kwargs)

    setattr(obj, method, faulty)
    return state


def run(engine, plan, fault=None, at_call=3):
    s = engine.scheduler
    state = None
    if fault is not None:
        where, method = fault
        target = {"backend": s.backend, "policy": s.policy, "sampler": s.sampler}[where]
        state = inject(target, method, at_call)
    handles, refused = [], 0
    for p, n in plan:
        try:
            handles.append(engine.submit(p, SamplingParams(max_tokens=n, ignore_eos=True)))
        except Injected:
            refused += 1
        s.check_invariants()
    for _ in range(200):
        if not s.has_work():
            break
        try:
            engine.step()
        except Injected as e:  # what the worker thread does with a tick that raised
            engine.recover(e)
        s.check_invariants()  # R1 and queue membership, after every tick, fault or not
    assert not s.has_work() and s.is_drained(), "R2: not drained after the fault"
    return handles, refused, state


@pytest.fixture(scope="module")
def reference(tiny_model):
    engine = make_engine(tiny_model, max_batch_size=3, prefill_chunk_size=8)
    handles, _, _ = run(engine, PLAN)
    return [h.output.token_ids for h in handles]


@pytest.mark.parametrize("backend", ["padded", "paged"])
@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f"{f[0]}.{f[1]}")
def test_a_fault_fails_only_what_it_hit_and_everything_is_given_back(tiny_model, reference,
                                                                      backend, fault):
    engine = make_engine(tiny_model, backend=backend, max_batch_size=3, prefill_chunk_size=8)
    handles, refused, state = run(engine, PLAN, fault)
    assert state["fired"], f"the workload never called {fault[1]} 3 times"
    assert all(h.finished for h in handles), "a client was left without a final event"
    errored = [h for h in handles if h.output.finish_reason == "error"]
    for h in errored:
        assert "injected fault" in h.events[-1].error and "Traceback" not in h.events[-1].error
    by_id = {h.request_id: i for i, h in enumerate(handles)}
    for h in handles:  # the requests the fault did not hit: exactly the fault-free tokens
        if h.output.finish_reason != "error":
            offset = refused if fault[1] == "on_request_arrived" and by_id[h.request_id] >= 2 else 0
            assert h.output.token_ids == reference[by_id[h.request_id] + offset]
    method = fault[1]
    if method in ONE_ROW:
        assert len(errored) + refused == 1, [h.output.finish_reason for h in handles]
    elif method == "on_request_finished":
        assert not errored and engine.scheduler.hook_errors == 1
    else:
        assert 1 <= len(errored) <= 3  # the rows of one batch / one tick
    assert engine.last_error and "injected fault" in engine.last_error
    # and the engine keeps serving
    again = engine.submit([3, 1, 4, 1, 5], SamplingParams(max_tokens=4, ignore_eos=True))
    for _ in range(20):
        if again.finished:
            break
        engine.step()
    assert again.output.finish_reason == "length" and engine.scheduler.is_drained()
