"""SPEC B2 for `model_runner="compact"` (fast/compact.py): the written-out Llama
forward gives Hugging Face's tokens and logits.

Token-exact against `generate` on each prompt alone, in every prefill mode, with prefix
caching on and prompts that share a prefix (so cache hits start rows mid-prompt); logits
allclose against the HF path on the same paged pool layout; an unsupported model or
pairing refused at construction with the reason.
"""

from __future__ import annotations

import pytest
import torch

from minserve import EngineConfig, SamplingParams
from minserve.backends.paged import PagedBackend, PagedForward
from minserve.fast import decode_kernel
from minserve.fast.compact import CompactLlama, Linear
from minserve.kv_cache import BlockManager

from .conftest import hf_greedy, make_engine, run_checked
from .test_architectures import tiny

SHARED = list(range(30, 54))  # 24 tokens: three blocks of 8, cached after the first row
PROMPTS = [(SHARED + [5, 6, 7], 6), (list(range(1, 40)), 4), ([7, 9, 11], 8),
           (SHARED + list(range(100, 130)), 3), (SHARED + [8], 5)]
MODES = {"monolithic": {}, "chunked": {"prefill_chunk_size": 16},
         "mixed_batch": {"prefill_mode": "mixed_batch", "prefill_chunk_size": 16}}
VARIANTS = {"llama": ("llama", {}), "qwen2": ("qwen2", {}),  # qwen2: q/k/v biases
            "mistral": ("mistral", {"sliding_window": 4096}),
            "llama-rope-linear": ("llama", {"rope_parameters": {
                "rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}})}


def _model(variant: str):
    family, extra = VARIANTS[variant]
    return tiny(family, **extra)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_compact_greedy_equals_hf_generate_alone(variant, mode):
    model = _model(variant)
    engine = make_engine(model, backend="paged", model_runner="compact", max_batch_size=3,
                         block_size=8, enable_prefix_caching=True, **MODES[mode])
    handles = [engine.submit(p, SamplingParams(max_tokens=n)) for p, n in PROMPTS]
    run_checked(engine)
    assert engine.block_manager.prefix_hit_tokens > 0  # some rows started from cached blocks
    for (prompt, n), h in zip(PROMPTS, handles):
        assert h.output.token_ids == hf_greedy(model, prompt, n), (variant, mode, prompt[:4])


def _backend(model, runner: str) -> PagedBackend:
    compact = CompactLlama(model, max_model_len=64) if runner == "compact" else None
    return PagedBackend(model, BlockManager(16, 8, False), runner=compact)


@pytest.mark.parametrize("row_block", [None, 5])  # 5: the 18-token prefill in 4 row blocks
def test_compact_logits_allclose_hf_path_for_a_batch(row_block):
    """Same pool layout, same forwards (a batched prefill, a decode step, a mixed
    forward): the compact runner's logits equal the HF model's to float rounding, its
    matmuls taking a forward's tokens all at once or `row_block` at a time."""
    model = tiny("qwen2")  # biases too
    hf, compact = _backend(model, "hf"), _backend(model, "compact")
    if row_block is not None:
        compact.runner.ROW_BLOCK = row_block
    tables = [[1, 2], [3, 4], [5, 6]]
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (3, 6))  # (B, T)
    prefill = torch.arange(6).repeat(3, 1)  # (B, T): positions 0..5
    decode_ids, decode_pos = torch.randint(0, 256, (3, 1)), torch.full((3, 1), 6)
    mixed_ids = torch.randint(0, 256, (1, 5))  # (1, N): rows 0 and 1 decode, row 2 a chunk of 3
    mixed_rows = [(tables[0], 7, 1), (tables[1], 7, 1), (tables[2], 7, 3)]
    mixed_pos = torch.tensor([[7, 7, 7, 8, 9]])
    keep = torch.tensor([0, 1, 4])
    outs = {}
    for name, b in (("hf", hf), ("compact", compact)):
        outs[name] = [
            b._run(ids, prefill, PagedForward.build(b.storage, tables, prefill), 6),
            b._run(decode_ids, decode_pos, PagedForward.build(b.storage, tables, decode_pos), 1),
            b._run(mixed_ids, mixed_pos, PagedForward.build_rows(b.storage, mixed_rows), keep)]
    hf.close()
    for got, want in zip(outs["compact"], outs["hf"]):
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # the pools hold the same K/V, so the next forward would agree too
    for layer in range(model.config.num_hidden_layers):
        torch.testing.assert_close(compact.storage.flat(layer)[0], hf.storage.flat(layer)[0],
                                   rtol=1e-4, atol=1e-5)


def test_compact_refuses_an_architecture_it_does_not_compute():
    with pytest.raises(ValueError, match="model_type='qwen3'.*model_runner='hf'"):
        make_engine(tiny("qwen3", head_dim=16), backend="paged", model_runner="compact")


def test_compact_refuses_a_length_dependent_rope():
    model = tiny("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                           "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="rope_type='dynamic'"):
        make_engine(model, backend="paged", model_runner="compact")


def test_model_runner_knob_is_validated():
    with pytest.raises(ValueError, match="runs on backend='paged'"):
        EngineConfig(backend="padded", model_runner="compact")
    with pytest.raises(ValueError, match="model_runner='fast'"):
        EngineConfig(backend="paged", model_runner="fast")


def test_auto_runner_is_compact_where_it_runs_the_model_and_hf_elsewhere():
    """`model_runner="auto"` (what `minserve serve` uses): never refuses a model."""
    llama = make_engine(tiny("llama"), backend="paged", model_runner="auto")
    assert isinstance(llama.scheduler.backend.runner, CompactLlama)
    qwen3 = make_engine(tiny("qwen3", head_dim=16), backend="paged", model_runner="auto")
    assert qwen3.scheduler.backend.runner is None  # the HF model's own forward
    assert EngineConfig(backend="padded", model_runner="auto").backend == "padded"


@pytest.mark.parametrize("rows", [1, 5, Linear.PANEL_ROWS, Linear.PANEL_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])  # up to PANEL_ROWS: the C matmul; then oneDNN
def test_prepacked_linear_computes_what_f_linear_computes(bias, rows):
    torch.manual_seed(0)
    w, b, x = torch.randn(48, 32), torch.randn(48) if bias else None, torch.randn(rows, 32)
    lin = Linear(w, b, decode_kernel.load())
    assert lin.packed is not None or not torch.backends.mkldnn.is_available()
    assert lin.panels is not None
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    xt = x.t().contiguous().t()  # (rows, 32), not contiguous
    torch.testing.assert_close(lin(xt), lin(x))
    plain = Linear(w.double(), None if b is None else b.double())  # no oneDNN: F.linear
    assert plain.packed is None and plain(x.double()).dtype == torch.float64
    # the model's own weight, read as it is by one row; a strided one is not (panels instead)
    own = Linear(w, b, decode_kernel.load(), plain=True)
    strided = Linear(w.t().contiguous().t(), b, decode_kernel.load(), plain=True)
    assert own.plain is not None and strided.plain is None
    for lin in (own, strided):
        torch.testing.assert_close(lin(x[:1]), torch.nn.functional.linear(x[:1], w, b),
                                   rtol=1e-5, atol=1e-5)


def test_compact_leaves_the_hf_model_usable():
    """The compact runner only reads the model: generate still works, attention unchanged."""
    model = tiny("llama")
    before = model.config._attn_implementation
    want = hf_greedy(model, [3, 4, 5], 4)
    make_engine(model, backend="paged", model_runner="compact")
    assert model.config._attn_implementation == before
    assert hf_greedy(model, [3, 4, 5], 4) == want


@pytest.mark.real_model
def test_compact_on_smollm2_equals_hf_generate(real_model, real_oracle):
    model, tokenizer = real_model
    engine = make_engine(model, tokenizer, backend="paged", model_runner="compact",
                         prefill_mode="mixed_batch", prefill_chunk_size=32, max_batch_size=3)
    prompts = [tokenizer(t)["input_ids"] for t in (
        "The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far",
        "The capital of France is a city")]
    handles = [engine.submit(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
    run_checked(engine)
    for p, h in zip(prompts, handles):
        assert h.output.token_ids == real_oracle(p, 12)


def test_compact_bench_times_pure_decode_ticks_of_both_runners():
    """The benchmark's building block runs on any Llama: both engines tick B rows."""
    from minserve.bench.forward import compact_ticks

    r = compact_ticks(tiny("llama"), None, B=2, prompt_len=12, ticks=2, warmup=1)
    assert r["B"] == 2 and min(r["hf"], r["compact"], r["floor"]) > 0
    assert set(r["shares"]) and 0 < sum(r["shares"].values()) <= 1


def test_linear_bench_times_the_same_products_both_ways():
    """The linear benchmark's plain weights are the ones each Linear multiplies: same math,
    timed by F.linear, oneDNN and (up to its row count) the C loop."""
    from minserve.bench.forward import linear_times, weight_pairs

    runner = CompactLlama(tiny("llama"), max_model_len=64)
    pairs = weight_pairs(runner)
    assert len(pairs) == 4 * len(runner.layers) + 1  # every projection and the output head
    for w, lin in pairs:
        x = torch.randn(3, lin.shape[1])
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)
    r = linear_times(runner, B=2, rounds=1, c_rows=2)
    assert set(r) == {"F.linear", "prepacked", "C"} and min(r.values()) > 0
    assert set(linear_times(runner, B=3, rounds=1, c_rows=2)) == {"F.linear", "prepacked"}
