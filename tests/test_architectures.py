"""SPEC B1/B2 beyond Llama: the model families each backend runs, token-exact.

Each family is a tiny randomly initialised model built from its transformers config
class (no download). On a backend that supports it, batched greedy tokens equal
Hugging Face `generate` on each prompt alone (SPEC B2), with rows of different
lengths joining and leaving. A pair a backend cannot compute is refused when the
engine is built, with the missing feature named, never per row at run time.
docs/backends.md lists the same families.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from minserve import SamplingParams

from .conftest import hf_greedy, make_engine, run_checked

# family -> (config class, model class, config fields beyond the shared tiny shape)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),  # q/k norms
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4096}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),  # fused qkv, gate_up
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),  # scaled embeddings
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16}),  # softcap + window
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),  # post-norms, q/k norms
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),  # residual / logit multipliers
}
# What each backend runs (docs/backends.md says the same). Mistral runs paged because its
# window (4096) is at least the context; Gemma2 soft-caps attention scores.
PAGED_REFUSES = {"gemma2": "soft-capping"}

PROMPTS = [(list(range(5, 20)), 6), (list(range(1, 40)), 4), ([7, 9, 11], 8),
           (list(range(100, 160)), 3)]


def tiny(family: str, **overrides):
    cfg_name, model_name, extra = FAMILIES[family]
    fields = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  eos_token_id=None, bos_token_id=None, pad_token_id=None)
    fields.update(extra)
    fields.update(overrides)
    config = getattr(transformers, cfg_name)(**fields)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # clear greedy margins (see models.tiny_llama)
        model.get_output_embeddings().weight.mul_(50.0)
    return model


def _assert_matches_oracle(model, handles) -> None:
    for (prompt, n), h in zip(PROMPTS, handles):
        got, want = h.output.token_ids, hf_greedy(model, prompt, n)
        if got != want:  # allowed only at a genuine near-tie of the oracle's logits
            i = next(k for k in range(min(len(got), len(want))) if got[k] != want[k])
            with torch.no_grad():
                top = torch.topk(model(torch.tensor([prompt + want[:i]])).logits[0, -1], 2)
            assert float(top.values[0] - top.values[1]) < 1e-3, \
                f"{type(model).__name__}: diverged from HF at step {i} with a clear margin"


@pytest.mark.parametrize("backend", ["padded", "paged"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_batched_greedy_equals_hf_generate_alone(family, backend):
    model = tiny(family)
    if backend == "paged" and family in PAGED_REFUSES:
        with pytest.raises(ValueError, match=PAGED_REFUSES[family]):
            make_engine(model, backend=backend)
        return
    engine = make_engine(model, backend=backend, max_batch_size=3, block_size=8,
                         prefill_chunk_size=16)
    handles = [engine.submit(p, SamplingParams(max_tokens=n)) for p, n in PROMPTS]
    run_checked(engine)
    assert all(h.output.finish_reason == "length" for h in handles)
    _assert_matches_oracle(model, handles)


@pytest.mark.parametrize("backend", ["padded", "paged"])
def test_a_window_smaller_than_the_context_is_refused_at_construction(backend):
    """A window that could hide keys is refused before any request runs, naming it and
    the way out (a context no longer than the window), on both backends; within that
    context the model runs token-exact."""
    model = tiny("mistral", sliding_window=32)
    with pytest.raises(ValueError, match=r"sliding-window attention \(sliding_window=32 < "
                                         r"max_model_len=1024; pass max_model_len <= 32"):
        make_engine(model, backend=backend)
    engine = make_engine(model, backend=backend, max_model_len=32, block_size=8)
    prompt = list(range(1, 20))
    h = engine.submit(prompt, SamplingParams(max_tokens=13))  # 19 + 13 = the whole window
    run_checked(engine)
    assert h.output.token_ids == hf_greedy(model, prompt, 13)


def test_paged_refusal_names_soft_capping_and_the_way_out():
    with pytest.raises(ValueError, match=r"backend='paged' cannot run Gemma2ForCausalLM: .*"
                                         r"attn_logit_softcapping=50.0; use backend='padded'"):
        make_engine(tiny("gemma2"), backend="paged")
