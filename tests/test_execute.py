"""Running the tick's forwards and posting their tokens (minserve/execute.py; T2, T4, C1).

The oracle tests (test_oracle.py, test_chunked_prefill.py) pin the tokens. Here, what the
run / postprocess split promises the phases: the pieces of rows admitted together go
through one forward beside the decode forward, each forward counted once with its tokens;
in mixed_batch T2 only plans and T4 completes T2's records; and a piece whose posting
raises takes only its own row with it.
"""

from __future__ import annotations

import pytest

from minserve.sampling import SamplingParams

from .conftest import PHASES, make_engine

BACKENDS = ["padded", "paged"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_admitted_together_prefill_in_one_forward_beside_the_decode_forward(tiny_model,
                                                                                 backend):
    engine = make_engine(tiny_model, backend=backend, max_batch_size=4)
    engine.trace = []
    handles = [engine.submit([i + 1] * n, SamplingParams(max_tokens=3, ignore_eos=True))
               for i, n in enumerate([5, 7, 9])]
    engine.step()
    [rec] = engine.trace
    assert rec.forwards == [5 + 7 + 9, 3]  # T2: every prompt in one forward; T4: 3 rows
    assert rec.prefill.promoted == [h.request_id for h in handles]
    assert all(c["final"] and c["first_token"] is not None for c in rec.prefill.chunks)
    assert all(len(h.events) == 2 for h in handles)  # first token (T2) + one decoded (T4)


def test_mixed_batch_chunk_records_get_their_first_token_and_promotion_from_t4(tiny_model):
    engine = make_engine(tiny_model, backend="paged", prefill_mode="mixed_batch",
                         prefill_chunk_size=4, max_batch_size=2)
    s = engine.scheduler
    h = engine.submit(list(range(1, 11)), SamplingParams(max_tokens=2, ignore_eos=True))
    for start, end in [(0, 4), (4, 8), (8, 10)]:
        recs = {}
        for name in PHASES:
            recs[name] = getattr(s, name)()
            if name == "advance_prefill_chunk":  # T2 only planned the piece
                [chunk] = recs[name].chunks
                assert (chunk["start"], chunk["end"]) == (start, end)
                assert chunk["in_decode_forward"] and chunk["first_token"] is None
                assert not recs[name].promoted
        final = end == 10
        assert (chunk["first_token"] is not None) == final  # T4 ran it, and posted it
        assert recs["advance_prefill_chunk"].promoted == ([h.request_id] if final else [])
        tick = s.end_tick(*(recs[n] for n in PHASES))
        assert tick.forwards == [end - start]  # one forward a tick, T4's
    assert chunk["first_token"] == h.events[0].token_id
    while s.has_work():
        engine.step()
    assert s.is_drained()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_piece_whose_posting_raises_fails_its_row_alone(tiny_model, backend):
    engine = make_engine(tiny_model, backend=backend, max_batch_size=3)
    s = engine.scheduler
    handles = [engine.submit([i + 1] * (4 + i), SamplingParams(max_tokens=3, ignore_eos=True))
               for i in range(3)]
    bad = handles[1].request_id
    real = s._promote_to_decode

    def promote(req):  # the C3 seam raises for one row, after its first token was posted
        if req.request_id == bad:
            raise RuntimeError("injected")
        real(req)

    s._promote_to_decode = promote
    rec = engine.step()
    assert [f["request_id"] for f in rec.prefill.failed] == [bad]
    assert rec.prefill.promoted == [handles[0].request_id, handles[2].request_id]
    s.check_invariants()
    while s.has_work():
        engine.step()
        s.check_invariants()
    assert handles[1].output.finish_reason == "error"
    assert [len(h.output.token_ids) for h in (handles[0], handles[2])] == [3, 3]
    assert s.is_drained()
