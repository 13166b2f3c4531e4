"""Chunked prefill (SPEC C1–C3): same tokens as monolithic, and the decode batch never stalls."""

from __future__ import annotations

import pytest

from minserve import SamplingParams

from .conftest import hf_greedy, make_engine, run_checked


@pytest.mark.parametrize("backend", ["padded", "paged"])
@pytest.mark.parametrize("chunk", [1, 3, 16, 64])
def test_chunked_equals_monolithic_equals_hf_on_tiny(tiny_model, backend, chunk):
    prompts = [list(range(1, 50)), [5, 6, 7], list(range(100, 137)), [9] * 20]
    outs = {}
    for mode_chunk in (0, chunk):
        engine = make_engine(tiny_model, backend=backend, prefill_chunk_size=mode_chunk,
                             max_batch_size=2, enable_prefix_caching=False)
        outs[mode_chunk] = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=6))]
    assert outs[0] == outs[chunk] == [hf_greedy(tiny_model, p, 6) for p in prompts]


@pytest.mark.parametrize("backend", ["padded", "paged"])
def test_active_streams_get_a_token_every_tick_while_a_2000_token_prompt_prefills(tiny_model, backend):
    engine = make_engine(tiny_model, backend=backend, prefill_chunk_size=128, max_batch_size=4,
                         max_model_len=4096, num_blocks=400, enable_prefix_caching=False)
    streams = [engine.submit([i + 1] * 5, SamplingParams(max_tokens=60, ignore_eos=True)) for i in range(3)]
    engine.step()  # the three short prompts are admitted, prefilled and start decoding
    long = engine.submit([(7 * k) % 250 + 1 for k in range(2000)], SamplingParams(max_tokens=4))
    ticks = []
    while not long.events:  # until the long prompt's first token
        ticks.append(engine.step())
        engine.check_invariants()
    prefill_ticks = [t for t in ticks if any(c["request_id"] == long.request_id for c in t.prefill.chunks)]
    assert len(prefill_ticks) == -(-2000 // 128)  # 16 chunks, one per tick
    for t in prefill_ticks:
        assert all(c["end"] - c["start"] <= 128 for c in t.prefill.chunks)
        # every running stream got exactly one token in that very tick (and on the final
        # chunk's tick, the long request joins the batch and decodes too)
        final = any(c["final"] for c in t.prefill.chunks)
        expect = [s.request_id for s in streams] + ([long.request_id] if final else [])
        assert sorted(t.decode.rows) == sorted(expect)
    run_checked(engine)
    assert long.output.token_ids == hf_greedy(tiny_model, long.output.prompt_token_ids, 4)


@pytest.mark.parametrize("backend", ["padded", "paged"])
def test_a_short_prompt_behind_a_2000_token_prompt_gets_its_first_token_within_two_ticks(
        tiny_model, backend):
    """C1: every prefilling row pushes its own next chunk each tick. With one chunk budget
    shared in admission order, the 5-token prompt waited for all 16 chunks of the long one."""
    engine = make_engine(tiny_model, backend=backend, prefill_chunk_size=128, max_batch_size=4,
                         max_model_len=4096, num_blocks=400, enable_prefix_caching=False)
    long = engine.submit([(7 * k) % 250 + 1 for k in range(2000)], SamplingParams(max_tokens=4))
    engine.step()  # the long prompt is admitted and pushes its first chunk
    short = engine.submit([3, 1, 4, 1, 5], SamplingParams(max_tokens=4))
    ticks = []
    while not short.events:
        ticks.append(engine.step())
        engine.check_invariants()
    admitted = next(i for i, t in enumerate(ticks)
                    if any(a["request_id"] == short.request_id for a in t.admit.admitted))
    assert len(ticks) - admitted <= 2, f"first token {len(ticks) - admitted} ticks after admission"
    assert not long.events, "the long prompt should still be prefilling"
    for t in ticks:  # and the long prompt kept its own chunk every tick
        assert [c["end"] - c["start"] for c in t.prefill.chunks
                if c["request_id"] == long.request_id] == [128]
    run_checked(engine)
    assert short.output.token_ids == hf_greedy(tiny_model, [3, 1, 4, 1, 5], 4)
    assert long.output.token_ids == hf_greedy(tiny_model, long.output.prompt_token_ids, 4)


def test_monolithic_prefill_does_the_whole_prompt_in_one_forward(tiny_model):
    engine = make_engine(tiny_model, prefill_mode="monolithic", prefill_chunk_size=0)
    h = engine.submit([k % 250 + 1 for k in range(299)], SamplingParams(max_tokens=2))
    rec = engine.step()
    assert [(c["start"], c["end"]) for c in rec.prefill.chunks] == [(0, 299)]
    run_checked(engine)
    assert h.output.timing["prefill_chunks"] == 1


REAL_PROMPTS = [
    "Chunked prefill splits a long prompt into pieces so that the decode batch keeps moving. " * 2,
    "def add(a, b):\n    return a + b\n\ndef mul(a, b):",
    "Hi",
]


@pytest.mark.real_model
@pytest.mark.parametrize("chunk", [1, 7, 32])
def test_real_model_chunked_equals_monolithic_equals_hf(real_model, real_oracle, chunk):
    model, tok = real_model
    engine = make_engine(model, tok, max_batch_size=2, prefill_chunk_size=chunk, enable_prefix_caching=False)
    outs = engine.generate(REAL_PROMPTS, SamplingParams(max_tokens=8))
    mono = make_engine(model, tok, max_batch_size=2, enable_prefix_caching=False).generate(
        REAL_PROMPTS, SamplingParams(max_tokens=8))
    lengths = [len(engine.encode(p)) for p in REAL_PROMPTS]
    assert chunk == 1 or any(n % chunk for n in lengths), "some prompt must end mid-chunk"
    for p, o, m in zip(REAL_PROMPTS, outs, mono):
        ids = engine.encode(p)
        assert o.token_ids == m.token_ids == real_oracle(ids, 8)
        assert o.timing["prefill_chunks"] == -(-len(ids) // chunk)  # one chunk per tick per row
