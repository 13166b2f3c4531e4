"""Chunked prefill (SPEC C1–C3): same tokens as monolithic, and the decode batch never stalls.

Version A (`chunked`) runs each prefilling row's chunk as its own forward beside the
decode forward; Version B (`mixed_batch`, paged backend) packs the decode tokens and
every chunk into one forward per tick.
"""

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


SHARED = [(11 * k) % 250 + 1 for k in range(37)]  # a shared prefix: 2 full blocks of 16
MIXED_PROMPTS = [[(5 * i + k) % 250 + 1 for k in range(n)] for i, n in enumerate([3, 17, 40, 9, 64, 1])]
MIXED_PROMPTS += [SHARED + [7, 8, 9], SHARED + [1, 2], SHARED]


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("chunk", [1, 7, 32])
def test_mixed_batch_is_token_exact_against_hf_with_one_forward_per_tick(
        tiny_model, chunk, prefix_caching):
    """Version B: decode rows and chunks in one flattened forward, per-row causal
    attention over block tables. Same greedy tokens as HF `generate` on each prompt
    alone; every tick with work runs exactly one model forward (counted by a hook on
    the model itself, and in the tick records)."""
    engine = make_engine(tiny_model, backend="paged", prefill_mode="mixed_batch",
                         prefill_chunk_size=chunk, max_batch_size=3,
                         enable_prefix_caching=prefix_caching)
    engine.trace = []
    calls = []
    hook = tiny_model.register_forward_hook(lambda m, a, kw, out: calls.append(1), with_kwargs=True)
    try:
        per_tick = []
        handles = [engine.submit(p, SamplingParams(max_tokens=6)) for p in MIXED_PROMPTS]
        while not all(h.finished for h in handles):
            before = len(calls)
            engine.step()
            per_tick.append(len(calls) - before)
            engine.check_invariants()
    finally:
        hook.remove()
    assert [h.output.token_ids for h in handles] == [hf_greedy(tiny_model, p, 6)
                                                     for p in MIXED_PROMPTS]
    assert set(per_tick) <= {0, 1} and per_tick.count(1) == len(per_tick) - per_tick.count(0)
    assert [len(r.forwards) for r in engine.trace] == per_tick  # the records count them right
    mixed = [r for r in engine.trace if r.decode.rows and r.prefill.chunks]
    assert mixed, "some tick should carry decode rows and prompt chunks together"
    for r in mixed:  # its one forward carried every decode token and every chunk's tokens
        assert r.forwards == [len(r.decode.rows) + sum(c["end"] - c["start"]
                                                       for c in r.prefill.chunks)]
    assert engine.scheduler.is_drained()


@pytest.mark.parametrize("backend", ["padded", "paged"])
def test_chunked_version_a_runs_its_chunks_beside_the_decode_forward(tiny_model, backend):
    """Version A: the decode forward, plus ONE forward for all the tick's chunks (paged:
    rows flattened, as in Version B; padded: the rows' pieces left-padded side by side
    over their left-padded staging KV), token-exact either way."""
    engine = make_engine(tiny_model, backend=backend, prefill_chunk_size=7, max_batch_size=3)
    engine.trace = []
    outs = engine.generate(MIXED_PROMPTS, SamplingParams(max_tokens=6))
    assert [o.token_ids for o in outs] == [hf_greedy(tiny_model, p, 6) for p in MIXED_PROMPTS]
    both = [r for r in engine.trace if r.decode.rows and r.prefill.chunks]
    assert both and all(len(r.forwards) == 2 for r in both)
    assert any(len(r.prefill.chunks) > 1 for r in both)


@pytest.mark.parametrize("backend, mode", [("padded", "monolithic"), ("padded", "disaggregated")])
def test_a_prefill_mode_not_built_on_a_backend_fails_at_construction(tiny_model, backend, mode):
    with pytest.raises(ValueError, match="built on the paged backend"):
        make_engine(tiny_model, backend=backend, prefill_mode=mode if mode != "monolithic"
                    else "mixed_batch", prefill_chunk_size=8)


@pytest.mark.parametrize("backend, mode", [("padded", "chunked"), ("paged", "chunked"),
                                           ("paged", "mixed_batch")])
def test_active_streams_get_a_token_every_tick_while_a_2000_token_prompt_prefills(
        tiny_model, backend, mode):
    engine = make_engine(tiny_model, backend=backend, prefill_mode=mode,
                         prefill_chunk_size=128, max_batch_size=4,
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
        # chunk's tick, Version A promotes the long request before T4, so it decodes too;
        # Version B samples its first token from that very forward and decodes next tick)
        final = any(c["final"] for c in t.prefill.chunks) and mode == "chunked"
        expect = [s.request_id for s in streams] + ([long.request_id] if final else [])
        assert sorted(t.decode.rows) == sorted(expect)
    run_checked(engine)
    assert long.output.token_ids == hf_greedy(tiny_model, long.output.prompt_token_ids, 4)


@pytest.mark.parametrize("backend, mode", [("padded", "chunked"), ("paged", "chunked"),
                                           ("paged", "mixed_batch")])
def test_a_short_prompt_behind_a_2000_token_prompt_gets_its_first_token_within_two_ticks(
        tiny_model, backend, mode):
    """C1: every prefilling row pushes its own next chunk each tick. With one chunk budget
    shared in admission order, the 5-token prompt waited for all 16 chunks of the long one."""
    engine = make_engine(tiny_model, backend=backend, prefill_mode=mode,
                         prefill_chunk_size=128, max_batch_size=4,
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
    mixed = make_engine(model, tok, max_batch_size=2, backend="paged", prefill_mode="mixed_batch",
                        prefill_chunk_size=chunk).generate(REAL_PROMPTS, SamplingParams(max_tokens=8))
    for p, o, m, x in zip(REAL_PROMPTS, outs, mono, mixed):
        ids = engine.encode(p)
        assert o.token_ids == m.token_ids == x.token_ids == real_oracle(ids, 8)
        assert o.timing["prefill_chunks"] == -(-len(ids) // chunk)  # one chunk per tick per row
