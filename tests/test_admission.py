"""Admission modes (R1, P6): reserve and preempt, one contract each (minserve/admission.py).

The engine-level behaviour (oracle tokens, preemption, the gates' numbers) is pinned in
tests/test_preemption.py and tests/test_gates.py; here, what each mode states, and that the
scheduler asks the mode and the backend instead of testing names.
"""

from __future__ import annotations

import pytest

from minserve.admission import MODES, PreemptAdmission, ReserveAdmission
from minserve.request import Request
from minserve.sampling import SamplingParams

from .conftest import make_engine, run_checked


def make_req(prompt: int = 20, out: int = 64, produced: int = 0) -> Request:
    req = Request(request_id="r", prompt_token_ids=[1] * prompt,
                  sampling=SamplingParams(max_tokens=out), arrival_seq=0)
    req.output_token_ids = [2] * produced
    req.recompute_token_ids = list(req.output_token_ids)  # as after a preemption
    return req


def test_reserve_needs_and_reserves_prompt_plus_max_tokens_and_never_grows():
    mode, req = ReserveAdmission(), make_req(produced=5)
    assert mode.need(req) == mode.reserve(req) == 20 + 64
    assert mode.per_decode == 0


def test_preempt_needs_its_prefill_plus_one_and_grows_one_token_per_decode():
    mode, req = PreemptAdmission(), make_req(produced=5)
    assert mode.reserve(req) == 20 + 5  # the prompt and the tokens it must recompute
    assert mode.need(req) == 20 + 5 + 1  # ... and its next token
    assert mode.per_decode == 1


@pytest.mark.parametrize("admission", ["reserve", "preempt"])
def test_the_engine_uses_the_configured_mode_and_r1_holds_after_every_phase(tiny_model,
                                                                           admission):
    engine = make_engine(tiny_model, admission=admission, backend="paged", num_blocks=12,
                         block_size=4, max_batch_size=4)
    assert isinstance(engine.scheduler.admission, MODES[admission])
    for i in range(6):
        engine.submit([1 + i] * (5 + i), SamplingParams(max_tokens=12, ignore_eos=True))
    run_checked(engine)  # check_invariants (R1, the mode's per-row check) after every phase
    assert engine.scheduler.is_drained()
    assert (engine.scheduler.preemptions > 0) == (admission == "preempt")


@pytest.mark.parametrize("backend, grows", [("padded", False), ("paged", True)])
def test_where_kv_grows_is_the_backends_to_say(tiny_model, backend, grows):
    engine = make_engine(tiny_model, backend=backend)
    assert engine.scheduler.backend.kv_grows_in_pool is grows


def test_choose_lets_another_sessions_request_past_a_head_whose_session_holds_its_rows(
        tiny_model):
    """T1 asks the mode whom to admit (`choose`); explain asks it what holds the head."""
    engine = make_engine(tiny_model, max_batch_size=4, max_rows_per_session=1)
    s, long = engine.scheduler, SamplingParams(max_tokens=50, ignore_eos=True)
    engine.submit([1, 2, 3], long, session_id="alice")
    engine.step()  # alice holds her one row
    mine = engine.submit([4, 5], long, session_id="alice")
    other = engine.submit([6, 7], long, session_id="bob")
    head = s.policy.peek_next()
    assert head.request_id == mine.request_id
    chosen, verdict = s.admission.choose(s, head)
    assert chosen.request_id == other.request_id and verdict is None
    other.cancel()  # nobody else waits: the head is held by its session's share
    chosen, verdict = s.admission.choose(s, head)
    assert chosen is head and verdict.reason == "session_cap" and not verdict.hard
    assert engine.explain(mine.request_id)["held_by"]["reason"] == "session_cap"
