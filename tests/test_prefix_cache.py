"""Prefix caching inside the engine (SPEC K1–K3), on both backends: real KV reuse, never stale."""

from __future__ import annotations

import pytest

from minserve import SamplingParams

from .conftest import hf_greedy, make_engine, run_checked

BACKENDS = ["padded", "paged"]
SYSTEM = list(range(1, 33))  # 32 tokens = 4 full blocks of 8


@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_prefix_is_reused_not_recomputed_and_tokens_stay_exact(tiny_model, backend):
    engine = make_engine(tiny_model, backend=backend, block_size=8, max_batch_size=2)
    first = engine.generate([SYSTEM + [40, 41, 42]], SamplingParams(max_tokens=5))[0]
    assert first.num_cached_tokens == 0
    computed_before = engine.stats()["prompt_tokens_computed"]
    second = engine.generate([SYSTEM + [50, 51]], SamplingParams(max_tokens=5))[0]
    assert second.num_cached_tokens == 32
    # only the 2 new tokens went through the model
    assert engine.stats()["prompt_tokens_computed"] - computed_before == 2
    assert second.token_ids == hf_greedy(tiny_model, SYSTEM + [50, 51], 5)
    assert engine.stats()["blocks"]["prefix_hit_rate"] > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_cached_prompt_still_computes_its_last_token(tiny_model, backend):
    engine = make_engine(tiny_model, backend=backend, block_size=8)
    engine.generate([SYSTEM], SamplingParams(max_tokens=3))
    rec_chunks = []
    h = engine.submit(SYSTEM, SamplingParams(max_tokens=3))
    run_checked(engine, on_phase=lambda n, r: rec_chunks.extend(r.chunks) if n == "advance_prefill_chunk" else None)
    assert h.output.num_cached_tokens == 24  # 3 of 4 blocks: the last block holds the last token
    assert [(c["start"], c["end"]) for c in rec_chunks] == [(24, 32)]
    assert h.output.token_ids == hf_greedy(tiny_model, SYSTEM, 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_tick_admissions_never_read_uncomputed_shared_kv(tiny_model, backend):
    engine = make_engine(tiny_model, backend=backend, block_size=8, max_batch_size=4,
                         prefill_chunk_size=8)  # chunked: the first prefill is still running
    a = engine.submit(SYSTEM + [60], SamplingParams(max_tokens=4))
    b = engine.submit(SYSTEM + [61], SamplingParams(max_tokens=4))
    rec = engine.scheduler.admit_pending()
    assert [x["cached_tokens"] for x in rec.admitted] == [0, 0]  # K3: nothing computed yet
    run_checked(engine)
    assert a.output.token_ids == hf_greedy(tiny_model, SYSTEM + [60], 4)
    assert b.output.token_ids == hf_greedy(tiny_model, SYSTEM + [61], 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_blocks_evicted_under_pressure_are_recomputed_correctly(tiny_model, backend):
    engine = make_engine(tiny_model, backend=backend, block_size=8, num_blocks=8,
                         kv_budget_tokens=64, max_batch_size=1)
    engine.generate([SYSTEM + [70]], SamplingParams(max_tokens=2))  # caches 4 blocks
    other = list(range(100, 140))  # 40 tokens: needs 5+1 blocks -> evicts cached ones (LRU)
    engine.generate([other], SamplingParams(max_tokens=2))
    assert engine.stats()["blocks"]["evictions"] > 0
    again = engine.generate([SYSTEM + [71]], SamplingParams(max_tokens=4))[0]
    assert again.num_cached_tokens < 32  # some of it was evicted ...
    assert again.token_ids == hf_greedy(tiny_model, SYSTEM + [71], 4)  # ... and recomputed right
    assert engine.scheduler.is_drained()
    assert all(b["ref_count"] == 0 for b in engine.block_manager.snapshot())


def test_prefix_caching_off_shares_nothing(tiny_model):
    engine = make_engine(tiny_model, block_size=8, enable_prefix_caching=False)
    engine.generate([SYSTEM + [1]], SamplingParams(max_tokens=2))
    out = engine.generate([SYSTEM + [2]], SamplingParams(max_tokens=2))[0]
    assert out.num_cached_tokens == 0
