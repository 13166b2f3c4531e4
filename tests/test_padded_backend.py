"""The padded backend's mask bookkeeping (SPEC R3), in the situation where it matters.

R3: splice-in sizes the mask from the mask's own width, never from a backend
metric such as `kv_length` (the longest row's real KV). The two differ as soon
as leading columns are padding in every row. With `trim_on_remove=False` that
happens every time the longest row leaves; a splice-in sized from `kv_length`
then concatenates tensors of different widths and the worker dies (the
mixed-workload crash the design records). These tests build exactly that
situation, check it really arose, and check the outputs against HF `generate`.
"""

from __future__ import annotations

import pytest

from minserve import SamplingParams

from .conftest import hf_greedy, make_engine, run_checked

# 0 is the longest prompt and leaves first (max_tokens 2); 3 and 4 splice in afterwards.
PLAN = [(list(range(1, 41)), 2), ([7, 8, 9, 10, 11], 12), (list(range(20, 30)), 12),
        ([3, 4, 5], 6), (list(range(100, 120)), 5)]


@pytest.mark.parametrize("trim", [True, False], ids=["trim", "no-trim"])
def test_splice_in_after_the_longest_row_left_uses_the_mask_width(tiny_model, trim):
    engine = make_engine(tiny_model, max_batch_size=3, enable_prefix_caching=False)
    backend = engine.scheduler.backend
    backend.trim_on_remove = trim
    handles = [engine.submit(p, SamplingParams(max_tokens=n)) for p, n in PLAN]
    splices = []  # (mask width, kv_length) seen just before each splice-in into a live batch
    real_promote = backend.promote

    def promote(req):
        if backend.row_ids:
            splices.append((backend.width, backend.kv_length))
        real_promote(req)
        assert backend.width == backend.cache.layers[0].keys.shape[2]

    backend.promote = promote
    run_checked(engine)
    if trim:
        assert all(w == k for w, k in splices), "trimmed: width and kv_length never differ"
    else:
        # the situation R3 is about really arose: a splice-in into a batch whose
        # mask is wider than its longest row
        assert any(w > k for w, k in splices), splices
    for (p, n), h in zip(PLAN, handles):
        assert h.output.token_ids == hf_greedy(tiny_model, p, n)
    assert engine.scheduler.is_drained()


def test_kv_length_is_the_longest_row_and_mask_width_can_exceed_it(tiny_model):
    engine = make_engine(tiny_model, max_batch_size=3, enable_prefix_caching=False)
    backend = engine.scheduler.backend
    backend.trim_on_remove = False
    long = engine.submit(list(range(1, 13)), SamplingParams(max_tokens=1, ignore_eos=True))
    short = engine.submit([5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()  # both admitted, prefilled, spliced in; `long` is finished by its first token
    assert long.finished and backend.row_ids == [short.request_id]
    # `long` left in T3 without a trim: 12 columns, + 1 for the decode step. `short` holds its
    # 3 prompt tokens + its first token (fed to this decode step): 4 real columns.
    assert backend.width == 13 and backend.kv_length == 4
    assert backend.snapshot()["padding_tokens"] == 13 - 4
