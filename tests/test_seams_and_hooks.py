"""The scheduler's seams, asserted at scheduler level (SPEC C3, P hooks).

* C3: `_promote_to_decode` is the one seam through which every completed
  prefill enters the decode batch: monolithic, chunked, fully cached prompt,
  both backends. `backend.promote` runs only inside it, and `active` grows
  only through it.
* The five policy hooks are called by the scheduler at fixed points, once each:
  `on_request_arrived` per accepted submit, `on_tokens_processed` for exactly
  the tokens computed, `on_request_finished` once per admitted request when it
  leaves `prefilling` / `active` (finish, cancel, error), never for a request
  that never ran.

The policy here is the real FCFS policy with a log of its hook calls (a
subclass, not a mock): what it orders is what the engine serves.
"""

from __future__ import annotations

import pytest

from minserve import SamplingParams
from minserve.policies import FCFSPolicy

from .conftest import PHASES, make_engine

BACKENDS = ["padded", "paged"]


class LoggingFCFS(FCFSPolicy):
    """FCFS that records every hook call: (hook, request_id, extra)."""

    def __init__(self, scheduler):
        super().__init__()
        self.scheduler = scheduler
        self.calls: list[tuple] = []

    def on_request_arrived(self, req):
        self.calls.append(("arrived", req.request_id))
        super().on_request_arrived(req)

    def on_tokens_processed(self, req, prompt_tokens, output_tokens):
        self.calls.append(("tokens", req.request_id, prompt_tokens, output_tokens))

    def on_request_finished(self, req):
        s = self.scheduler
        # the hook runs once the row has left the running queues
        still_running = any(r is req for r in s.prefilling + s.active)
        self.calls.append(("finished", req.request_id, still_running))

    def count(self, hook, rid=None):
        return sum(1 for c in self.calls if c[0] == hook and (rid is None or c[1] == rid))


def engine_with_logging_policy(model, **cfg):
    engine = make_engine(model, **cfg)
    engine.scheduler.policy = policy = LoggingFCFS(engine.scheduler)
    return engine, policy


def spy_on_the_seam(engine):
    """Count `_promote_to_decode` calls; fail if `backend.promote` or a growth of
    `active` happens outside it."""
    s = engine.scheduler
    seen = {"promoted": [], "inside": False}
    real_seam, real_promote = s._promote_to_decode, s.backend.promote

    def seam(req):
        seen["promoted"].append(req.request_id)
        seen["inside"] = True
        try:
            real_seam(req)
        finally:
            seen["inside"] = False

    def backend_promote(req):
        assert seen["inside"], "backend.promote ran outside _promote_to_decode (C3)"
        real_promote(req)

    s._promote_to_decode = seam
    s.backend.promote = backend_promote
    return seen


def run_phase_by_phase(engine, seen, max_ticks=500):
    s = engine.scheduler
    for _ in range(max_ticks):
        if not s.has_work():
            return
        recs = {}
        for name in PHASES:
            before = {r.request_id for r in s.active}
            recs[name] = getattr(s, name)()
            joined = {r.request_id for r in s.active} - before
            assert joined <= set(seen["promoted"]), f"{joined} entered `active` outside the seam"
            s.check_invariants()
        s.end_tick(*(recs[n] for n in PHASES))
    raise AssertionError("did not drain")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", [0, 3], ids=["monolithic", "chunked3"])
def test_every_completed_prefill_enters_decode_through_promote_to_decode(tiny_model, backend,
                                                                         chunk):
    engine = make_engine(tiny_model, backend=backend, max_batch_size=3, prefill_chunk_size=chunk,
                         block_size=4)
    seen = spy_on_the_seam(engine)
    shared = list(range(30, 46))  # 4 full blocks: the second request with it hits the cache
    prompts = [shared + [1], [5, 6], shared + [1], list(range(60, 71)), shared]
    handles = [engine.submit(p, SamplingParams(max_tokens=3)) for p in prompts]
    engine.step()
    run_phase_by_phase(engine, seen)
    assert sorted(seen["promoted"]) == sorted(h.request_id for h in handles)
    assert len(seen["promoted"]) == len(set(seen["promoted"])), "a request promoted twice"
    assert engine.scheduler.is_drained()


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_hook_is_called_once_at_its_point_for_every_way_a_request_ends(tiny_model, backend):
    engine, policy = engine_with_logging_policy(tiny_model, backend=backend, max_batch_size=2,
                                                prefill_chunk_size=4, max_queue_size=8)
    s = engine.scheduler
    done = engine.submit([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    in_prefill = engine.submit(list(range(10, 40)), SamplingParams(max_tokens=5))
    waiting = engine.submit([7, 7], SamplingParams(max_tokens=5))
    engine.step()
    engine.step()
    assert any(r is s.requests[in_prefill.request_id] for r in s.prefilling)
    in_prefill.cancel()  # leaves from `prefilling`
    waiting.cancel()  # leaves from `pending`: it never ran
    for _ in range(10):
        engine.step()
    assert done.finished and in_prefill.finished and waiting.finished
    active = engine.submit([4, 5, 6], SamplingParams(max_tokens=50, ignore_eos=True))
    failing = engine.submit([8, 9], SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    active.cancel()  # leaves from `active`
    engine.step()
    assert active.output.finish_reason == "cancelled"
    assert s.fail_all("injected") == 1  # error: leaves from `active`
    assert failing.output.finish_reason == "error" and s.is_drained()

    for h in (done, in_prefill, waiting, active, failing):
        assert policy.count("arrived", h.request_id) == 1
    for h in (done, in_prefill, active, failing):  # admitted: finished exactly once, after leaving
        assert [c for c in policy.calls if c[:2] == ("finished", h.request_id)] == \
            [("finished", h.request_id, False)]
    assert policy.count("finished", waiting.request_id) == 0  # never admitted
    # on_tokens_processed saw exactly the work done: prompt tokens computed, tokens sampled
    charged_prompt = sum(c[2] for c in policy.calls if c[0] == "tokens")
    charged_output = sum(c[3] for c in policy.calls if c[0] == "tokens")
    assert charged_prompt == s.prompt_tokens_computed
    assert charged_output == s.tokens_generated


def test_a_hard_rejected_request_never_reaches_on_request_finished(tiny_model):
    engine, policy = engine_with_logging_policy(tiny_model, max_batch_size=2, kv_budget_tokens=32)
    big = engine.submit(list(range(1, 40)), SamplingParams(max_tokens=8))
    engine.step()
    assert big.output.finish_reason == "error" and big.output.rejection["gate"] == "G2"
    assert policy.count("arrived", big.request_id) == 1
    assert policy.count("finished", big.request_id) == 0
    assert engine.scheduler.is_drained()
