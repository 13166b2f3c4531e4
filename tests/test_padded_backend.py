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
import torch

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


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("mode, chunk", [("monolithic", 0), ("chunked", 5)])
def test_a_ticks_prefills_go_through_one_forward_left_padded(tiny_model, prefix_cache, mode,
                                                            chunk):
    """Rows admitted together are prefilled in ONE forward (their pieces left-padded
    side by side, over their own left-padded past KV), token-exact against HF. With the
    prefix cache, rows start from different cached lengths: the past columns differ
    per row too."""
    shared = [7, 3, 9, 11, 2, 5, 8, 1, 4, 6, 12, 13]  # 12 tokens: 3 full blocks of 4
    prompts = [shared + [20, 21, 22], [30, 31, 32], shared + list(range(40, 57)), [50] * 9]
    engine = make_engine(tiny_model, backend="padded", prefill_mode=mode,
                         prefill_chunk_size=chunk, max_batch_size=4,
                         enable_prefix_caching=prefix_cache, block_size=4)
    if prefix_cache:  # warm the cache with the shared prefix, so two rows start at 12
        engine.generate([shared + [99]], SamplingParams(max_tokens=1))
    engine.trace = []
    outs = engine.generate(prompts, SamplingParams(max_tokens=5))
    assert [o.token_ids for o in outs] == [hf_greedy(tiny_model, p, 5) for p in prompts]
    if prefix_cache:
        assert sum(o.num_cached_tokens for o in outs) == 24  # the two shared-prefix rows
    busy = [r for r in engine.trace if len(r.prefill.chunks) > 1]
    assert busy, "no tick prefilled several rows"
    for r in busy:  # one forward for the prefill pieces, plus the decode forward if any
        assert len(r.forwards) == 1 + (1 if r.decode.rows else 0), r.forwards


def test_prefill_together_gives_each_row_the_logits_and_kv_it_gets_alone(tiny_model):
    """Backend level, logits not tokens (the tiny model's greedy tokens barely depend on
    positions): rows of 19, 3 and 11 tokens, pushed as two rounds of pieces (so the
    second round has past KV of different lengths), match each row prefilled alone,
    logits and KV, to float32 rounding."""
    from minserve.backends.padded import PaddedBackend
    from minserve.request import Request

    prompts = [list(range(1, 20)), [5, 6, 7], list(range(30, 41))]

    def rows():
        return [Request(request_id=f"r{i}", prompt_token_ids=p, arrival_seq=i,
                        sampling=SamplingParams(max_tokens=2)) for i, p in enumerate(prompts)]

    together, alone = PaddedBackend(tiny_model), PaddedBackend(tiny_model)
    a_rows, b_rows = rows(), rows()
    for a, b in zip(a_rows, b_rows):
        together.begin_prefill(a)
        alone.begin_prefill(b)
    for lo, hi in ((0, 4), (4, None)):
        pieces = [(r, lo, min(r.prompt_len, hi or r.prompt_len)) for r in a_rows
                  if r.prompt_len > lo]
        got = together.prefill_together(pieces)
        for (r, start, end), logits in zip(pieces, got):
            b = b_rows[a_rows.index(r)]
            want = alone.prefill_chunk(b, start, end)
            assert (logits is None) == (end < r.prompt_len)
            if logits is not None:
                assert torch.allclose(logits, want, atol=1e-4), (r.request_id, start, end)
    for a, b in zip(a_rows, b_rows):  # each staging cache is the row's own real KV
        for la, lb in zip(together.staging[a.request_id].layers,
                          alone.staging[b.request_id].layers):
            assert la.keys.shape == lb.keys.shape
            assert torch.allclose(la.keys, lb.keys, atol=1e-5)
            assert torch.allclose(la.values, lb.values, atol=1e-5)


def test_the_decode_batch_grows_in_place_and_computes_what_hf_cache_layers_compute(tiny_model):
    """fast/in_place_cache.py, which the engine gives every padded backend: over a workload
    whose rows join and leave mid-flight, every decode step's logits are the ones HF's own
    `DynamicLayer` gives; and a step in which no row joined or left writes into the
    buffer the batch already had (no copy of its KV), where HF's layer copies every step."""
    from minserve.fast.in_place_cache import InPlaceLayer

    prompts = [list(range(1, 1 + n)) for n in (5, 17, 9, 30, 3, 12)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (6, 3, 9, 4, 7, 5)]
    runs = {}
    for name, layer in (("hf", None), ("in_place", InPlaceLayer)):
        engine = make_engine(tiny_model, max_batch_size=3)
        backend = engine.scheduler.backend
        assert backend.decode_layer is InPlaceLayer  # what the engine gives
        backend.decode_layer = layer
        steps = []  # (rows, logits, where layer 0's keys live) per decode step
        real = backend.decode_step_batched

        def step(reqs, toks, real=real, backend=backend, steps=steps):
            out = real(reqs, toks)
            steps.append((tuple(backend.row_ids), out.clone(),
                          backend.cache.layers[0].keys.data_ptr()))
            return out

        backend.decode_step_batched = step
        outs = engine.generate(prompts, params)
        assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
        runs[name] = steps
    hf, in_place = runs["hf"], runs["in_place"]
    assert [rows for rows, _, _ in hf] == [rows for rows, _, _ in in_place]
    for (rows, a, _), (_, b, _) in zip(hf, in_place):
        assert torch.allclose(a, b, atol=1e-5), rows
    assert len({rows for rows, _, _ in hf}) > 3  # rows joined and left mid-flight

    def same_rows_pairs(steps):
        return [(p, q) for (r1, _, p), (r2, _, q) in zip(steps, steps[1:]) if r1 == r2]

    assert same_rows_pairs(in_place) and all(p == q for p, q in same_rows_pairs(in_place))
    assert all(p != q for p, q in same_rows_pairs(hf))
