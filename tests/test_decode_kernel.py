"""`decode_attention="kernel"` (fast/decode_kernel.c): the decode step's attention in C,
reading each row's blocks in place, must compute what `paged._attend` computes (to float
rounding) and give Hugging Face `generate`'s tokens (SPEC B2). Where it cannot run it is
refused at construction ("kernel") or left out ("auto"), never half-used."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minserve import EngineConfig, SamplingParams
from minserve.backends.kv_storage import KVBlockStorage
from minserve.backends.paged import PagedForward, _attend
from minserve.fast import decode_kernel
from minserve.models import tiny_llama

from .conftest import hf_greedy, make_engine, run_checked
from .test_architectures import tiny
from .test_oracle import TINY_PROMPTS


def _ragged_rows(rng: torch.Generator, B: int, S: int, shared: int, num_blocks: int):
    """B decode rows: a shared prefix of `shared` blocks, then own blocks scattered over
    the pool (not in order, not contiguous), each row ending part-way into its last block."""
    free = torch.randperm(num_blocks - shared, generator=rng) + shared
    rows, taken = [], 0
    for _ in range(B):
        own = int(torch.randint(1, 6, (1,), generator=rng))
        table = list(range(shared)) + free[taken:taken + own].tolist()
        taken += own
        last = len(table) * S - int(torch.randint(1, S + 1, (1,), generator=rng))  # its position
        rows.append((table, last, 1))
    return rows


# G = H / H_kv query heads per KV head: 1, 2, 3, then 4 = 3 + 1 and 5 = 3 + 2 and 6 = 3 + 3
# (the values are summed 3 heads at a time); D past one pass of the sums in registers (72)
@pytest.mark.parametrize("H,H_kv,D", [(4, 2, 16), (9, 3, 64), (4, 4, 8), (8, 2, 24),
                                      (10, 2, 8), (6, 1, 72)])
@pytest.mark.parametrize("B,shared", [(1, 0), (5, 0), (7, 3)])
def test_kernel_attends_as_the_pytorch_decode_over_ragged_block_tables(H, H_kv, D, B, shared):
    S, num_blocks = 4, 64
    storage = KVBlockStorage(num_blocks, S, num_layers=2, num_kv_heads=H_kv, head_dim=D)
    rng = torch.Generator().manual_seed(H * 100 + B)
    for t in storage._k + storage._v:
        t.normal_(generator=rng)
    rows = _ragged_rows(rng, B, S, shared, num_blocks)
    kernel = decode_kernel.load()
    plain = PagedForward.build_rows(storage, rows)
    in_c = PagedForward.build_rows(storage, rows, kernel)
    assert in_c.groups[0].lengths.tolist() == [pos + 1 for _, pos, _ in rows]
    q = torch.randn(B, H, 1, D, generator=rng)
    for layer in range(2):
        want = _attend(plain, layer, plain.groups[0], q, H_kv, D ** -0.5)
        got = _attend(in_c, layer, in_c.groups[0], q, H_kv, D ** -0.5)
        assert got.shape == want.shape == (B, 1, H, D)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_never_reads_a_block_outside_the_pool():
    """The C code trusts the block ids it is given (a bad one would read stray memory),
    so the forward's context refuses them first."""
    storage = KVBlockStorage(8, 4, 1, 2, 16)
    with pytest.raises(ValueError, match="outside"):
        PagedForward.build_rows(storage, [([0, 8], 5, 1)], decode_kernel.load())


# ------------------------------------------------------------ a few rows' matmuls and norms
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), n_out=st.integers(1, 80), n_in=st.integers(1, 70),
       bias=st.booleans(), threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**16))
def test_rows_linear_computes_f_linear_for_any_shape_and_thread_count(rows, n_out, n_in, bias,
                                                                      threads, seed):
    """decode_kernel.c's `rows_linear` on weights packed in panels (what compact.Linear runs
    for a decode step) is F.linear to float rounding: any row count (tiles of every size
    up to MAXR, a rest split in two), output widths that are no multiple of the panel
    (the zero-padded last panel, written only where it has columns), threads splitting
    the panels."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, n_in, generator=g), torch.randn(n_out, n_in, generator=g)
    b = torch.randn(n_out, generator=g) if bias else None
    kernel = decode_kernel.load()
    packed = kernel.pack(w)
    assert packed.data.shape == (-(-n_out // kernel.panel_width), n_in, kernel.panel_width)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernel.linear(x, packed, b)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(n_out=st.integers(1, 80), n_in=st.integers(1, 70), bias=st.booleans(),
       threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**16))
def test_one_row_linear_computes_f_linear_on_the_weight_as_it_is(n_out, n_in, bias, threads,
                                                                 seed):
    """`one_row` (a step of one row reads the HF model's own weights, row after row): F.linear
    to float rounding for widths that are no multiple of its 16-float steps (the scalar
    tail), threads splitting the outputs."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(1, n_in, generator=g), torch.randn(n_out, n_in, generator=g)
    b = torch.randn(n_out, generator=g) if bias else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = decode_kernel.load().one_row(x, w, b)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_packed_panels_hold_each_weight_once_and_zeros_past_the_last_column():
    """The panel layout itself: panel p, input i, lane j is W[p*PW + j, i]; lanes past the
    last output column are 0 (so the C matmul can read whole panels)."""
    kernel = decode_kernel.load()
    PW = kernel.panel_width
    assert PW in (16, 32)
    w = torch.arange(float((PW + 3) * 5)).view(PW + 3, 5)  # a panel and 3 columns
    data = kernel.pack(w).data  # (2, 5, PW)
    torch.testing.assert_close(data[0], w[:PW].t())
    torch.testing.assert_close(data[1, :, :3], w[PW:].t())
    assert not data[1, :, 3:].any()


def test_rms_norm_in_c_is_hf_llama_rms_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(76, eps=1e-5)  # 76: no multiple of 8, the scalar tail too
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 76) * 4
    with torch.no_grad():
        want = norm(x)
    torch.testing.assert_close(decode_kernel.load().rms_norm(x, norm.weight.detach(), 1e-5), want,
                               rtol=1e-6, atol=1e-6)


# -------------------------------------------------- a decode step of a few rows, all in C
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases
@pytest.mark.parametrize("route,B", [("decode_in_c", 1), ("decode_in_c", 5),
                                     ("decode_in_c", 13),  # past a tile of 12 rows
                                     ("decode_rows", 5)])
def test_a_decode_step_in_c_is_the_compact_forward_of_those_rows(family, route, B):
    """`CompactLlama.decode_in_c` (every layer in one C call) and `decode_rows` (C
    between `Linear`'s matmuls; the route of more than `STEP_IN_C_ROWS` rows, lowered
    here on this runner so that 5 rows take it) compute what the compact forward's
    Python loop computes for the same rows: the logits to float rounding, and the same
    K/V written into the pool."""
    from minserve.backends.paged import PagedBackend
    from minserve.fast.compact import CompactLlama
    from minserve.kv_cache import BlockManager

    model = tiny(family)
    g = torch.Generator().manual_seed(B)
    with torch.no_grad():  # HF starts biases at 0, where an offset into the wrong one hides
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(0, 0.5, generator=g)
    kernel = decode_kernel.load()
    runner = CompactLlama(model, max_model_len=64, kernel=kernel)
    if route == "decode_rows":
        runner.STEP_IN_C_ROWS = B - 1
    backends = [PagedBackend(model, BlockManager(3 * B + 1, 8, False), runner=runner,
                             kernel=kernel) for _ in range(2)]
    tables = [[3 * b + 1, 3 * b + 2, 3 * b + 3] for b in range(B)]
    g = torch.Generator().manual_seed(B)
    prompt = torch.randint(0, 256, (B, 13), generator=g)
    decode_ids = torch.randint(0, 256, (B, 1), generator=g)
    decode_pos = torch.full((B, 1), 13)
    got = []
    for b, in_c in zip(backends, (True, False)):
        b._run(prompt, torch.arange(13).repeat(B, 1), PagedForward.build(b.storage, tables,
               torch.arange(13).repeat(B, 1), kernel), 13)  # the same history in both pools
        ctx = PagedForward.build(b.storage, tables, decode_pos, kernel)
        assert runner._in_c(ctx, B, 1, 1)
        calls, real = [], getattr(runner, route)
        setattr(runner, route,
                lambda *a, calls=calls, route=route, real=real: calls.append(route) or real(*a))
        try:
            got.append(runner.forward(decode_ids, decode_pos, ctx, 1) if in_c
                       else _python_forward(runner, decode_ids, decode_pos, ctx))
        finally:
            delattr(runner, route)
        assert calls == ([route] if in_c else [])
    assert got[0].shape == got[1].shape == (B, 1, model.config.vocab_size)
    torch.testing.assert_close(got[0], got[1], rtol=1e-4, atol=1e-4)
    for layer in range(model.config.num_hidden_layers):  # the new token's K/V, in both pools
        for mine, theirs in zip(backends[0].storage.flat(layer), backends[1].storage.flat(layer)):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("route, rows, picks, must, may", [
    # steps of one to three rows: every layer in C (prompt chunks through the Python loop)
    ("decode_in_c", 3, (2, 4, 6, 8), {1, 2, 3}, {1, 2, 3}),  # 24, 12, 16, 20 tokens out
    # steps of four and five with `STEP_IN_C_ROWS` lowered to 3 on this runner: the route
    # of more rows, `Linear`'s matmuls with C between them (smaller: decode_in_c)
    ("decode_rows", 5, (2, 6, 8, 9, 11), {5}, {4, 5}),  # 3-13 tokens in, 11-24 out
])
def test_the_serve_path_runs_its_decode_steps_in_c_and_gives_hf_generate_tokens(
        tiny_model, route, rows, picks, must, may):
    """Each decode step takes the C route for its row count, and every request still
    gets HF's greedy tokens."""
    engine = make_engine(tiny_model, backend="paged", model_runner="compact",
                         decode_attention="kernel", prefill_mode="mixed_batch",
                         prefill_chunk_size=5, max_batch_size=rows, block_size=8)
    runner, calls = engine.scheduler.backend.runner, []
    if route == "decode_rows":
        runner.STEP_IN_C_ROWS = 3
    real = getattr(runner, route)
    setattr(runner, route, lambda ids, *a: calls.append(ids.shape[0]) or real(ids, *a))
    prompts = [TINY_PROMPTS[i] for i in picks]
    handles = [engine.submit(p, SamplingParams(max_tokens=n)) for p, n in prompts]
    run_checked(engine)
    assert must <= set(calls) <= may, calls
    for (prompt, n), h in zip(prompts, handles):
        assert h.output.token_ids == hf_greedy(tiny_model, prompt, n), prompt


def _python_forward(runner, ids, positions, ctx):
    """The compact forward's Python loop for a step `decode_in_c` would take."""
    runner._in_c = lambda *a: False
    try:
        return runner.forward(ids, positions, ctx, 1)
    finally:
        del runner._in_c


@pytest.mark.parametrize("cfg", [
    pytest.param(dict(enable_prefix_caching=True), id="paged+prefix"),
    pytest.param(dict(prefill_chunk_size=3), id="paged+chunked3"),
    pytest.param(dict(prefill_mode="mixed_batch", prefill_chunk_size=5,
                      model_runner="compact"), id="mixed+compact"),
])
def test_engine_with_the_kernel_gives_hf_generate_tokens(tiny_model, cfg):
    engine = make_engine(tiny_model, backend="paged", decode_attention="kernel",
                         max_batch_size=3, block_size=8, **cfg)
    assert engine.scheduler.backend.kernel is not None
    handles = [engine.submit(p, SamplingParams(max_tokens=n)) for p, n in TINY_PROMPTS]
    run_checked(engine)
    assert engine.scheduler.is_drained()
    for (prompt, n), h in zip(TINY_PROMPTS, handles):
        assert h.output.token_ids == hf_greedy(tiny_model, prompt, n), prompt


@pytest.mark.real_model
def test_kernel_on_smollm2_gives_hf_generate_tokens(real_model, real_oracle):
    """The mixed batch on SmolLM2, its decode steps of 2-4 rows through `decode_rows`
    (`STEP_IN_C_ROWS` lowered to 1 on this runner: the route of more rows than a test
    on the real model can afford), token for token HF's."""
    model, tokenizer = real_model
    engine = make_engine(model, tokenizer, backend="paged", model_runner="compact",
                         decode_attention="kernel", prefill_mode="mixed_batch",
                         prefill_chunk_size=32, max_batch_size=4)
    runner, calls = engine.scheduler.backend.runner, []
    runner.STEP_IN_C_ROWS = 1
    real = runner.decode_rows
    runner.decode_rows = lambda ids, *a: calls.append(ids.shape[0]) or real(ids, *a)
    system = tokenizer("You are a helpful assistant who answers in one sentence.")["input_ids"]
    prompts = [system + tokenizer(t)["input_ids"] for t in (
        " The capital of France is", " def fibonacci(n):", " Once upon a time, in a land far",
        " Water boils at")]
    handles = [engine.submit(p, SamplingParams(max_tokens=14, ignore_eos=True)) for p in prompts]
    run_checked(engine)
    assert 4 in calls, calls
    for p, h in zip(prompts, handles):
        assert h.output.token_ids == real_oracle(p, 14)


@pytest.mark.real_model
def test_serve_path_steps_of_one_to_three_rows_on_smollm2_give_hf_generate_tokens(real_model,
                                                                                 real_oracle):
    """`minserve serve`'s path on the real model where a lone stream or a few run: steps
    of one, two and three rows, every layer in C (`decode_in_c`, up to
    `CompactLlama.STEP_IN_C_ROWS` rows), token for token HF's. The fourth prompt waits
    for a row, so steps of three rows, then two, then one all run."""
    model, tokenizer = real_model
    engine = make_engine(model, tokenizer, backend="paged", model_runner="compact",
                         decode_attention="kernel", max_batch_size=3)
    runner, calls = engine.scheduler.backend.runner, []
    real = runner.decode_in_c
    runner.decode_in_c = lambda ids, *a: calls.append(ids.shape[0]) or real(ids, *a)
    prompts = [tokenizer(t)["input_ids"] for t in (
        "The three primary colours are", "import numpy as np\n\ndef mean(xs):",
        "In 1969, the first people to walk on the Moon", "Water boils at")]
    lengths = (20, 9, 14, 6)
    handles = [engine.submit(p, SamplingParams(max_tokens=n, ignore_eos=True))
               for p, n in zip(prompts, lengths)]
    run_checked(engine)
    assert set(calls) == {1, 2, 3}
    for p, h, n in zip(prompts, handles, lengths):
        assert h.output.token_ids == real_oracle(p, n)


def test_kernel_is_refused_where_it_cannot_run(tiny_model):
    with pytest.raises(ValueError, match="backend='paged'"):
        EngineConfig(backend="padded", decode_attention="kernel")
    with pytest.raises(ValueError, match="decode_attention"):
        EngineConfig(decode_attention="fast")
    assert "float32" in decode_kernel.unsupported_reason(torch.bfloat16, torch.device("cpu"), 64)
    assert "cuda" in decode_kernel.unsupported_reason(torch.float32, torch.device("cuda"), 64)
    assert "multiple of 8" in decode_kernel.unsupported_reason(torch.float32, "cpu", 12)
    assert decode_kernel.unsupported_reason(torch.float32, "cpu", 64) is None
    with pytest.raises(ValueError, match="float32"):  # the pool takes the model's dtype
        make_engine(tiny_llama().to(torch.bfloat16), backend="paged", decode_attention="kernel")


def test_without_a_compiler_auto_runs_pytorch_and_kernel_says_why(tiny_model, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(RuntimeError, match="/nonexistent/cc"):
        decode_kernel.load()
    auto = make_engine(tiny_model, backend="paged", decode_attention="auto")
    assert auto.scheduler.backend.kernel is None
    out = auto.generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0]
    assert out.token_ids == hf_greedy(tiny_model, [5, 6, 7], 4)
    with pytest.raises(ValueError, match="cannot run here.*nonexistent"):
        make_engine(tiny_model, backend="paged", decode_attention="kernel")


def test_kernel_is_built_once_and_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("MINSERVE_CACHE_DIR", str(tmp_path))
    decode_kernel._load.cache_clear()
    try:
        first = decode_kernel.load()
        assert first.path.parent == tmp_path / "kernels" and first.path.exists()
        assert decode_kernel.load() is first  # this process: the same object
        decode_kernel._load.cache_clear()
        mtime = first.path.stat().st_mtime_ns
        assert decode_kernel.load().path == first.path  # a new process: the file is reused
        assert first.path.stat().st_mtime_ns == mtime
    finally:
        decode_kernel._load.cache_clear()


def test_attention_bench_times_both_ways_and_checks_they_agree():
    from minserve.bench.attention import layer_times

    r = layer_times(2, rounds=3)
    assert set(r) == {"torch", "kernel"} and min(r.values()) > 0


@settings(max_examples=30, deadline=None)
@given(xs=st.lists(st.floats(-87.25, 88.25, width=32), min_size=1, max_size=40))
def test_the_kernels_exp_is_torch_exp_to_a_tenth_of_a_millionth(xs):
    """decode_kernel.c's `exp8` (its softmax and SiLU): relative error under 1e-7 over
    the range it does not clamp, any count of floats (8 at a time, then a padded tail)."""
    x = torch.tensor(xs, dtype=torch.float32)
    got = decode_kernel.load().exp(x).double()
    want = torch.exp(x.double())
    assert ((got - want).abs() / want).max() < 1e-7


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 80), half=st.integers(1, 1300), threads=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_the_kernels_silu_mul_is_pytorchs_silu_times_up(rows, half, threads, seed):
    """`silu_mul` (gate | up -> silu(gate) * up) for any row count and width: 8 floats at
    a time, then the rest; over the thread threshold (64 rows of 1,536) split over rows."""
    gate_up = torch.randn(rows, 2 * half, generator=torch.Generator().manual_seed(seed)) * 6
    gate_up[0, 0] = 90.0  # past exp8's clamp: silu(g) is g
    want = F.silu(gate_up[:, :half]) * gate_up[:, half:]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = decode_kernel.load().silu_mul(gate_up)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_kernels_exp_clamps_past_the_float_range_and_keeps_nan():
    """Below -87.3 exp comes out about 1e-38 (no denormals, never negative), above 88.3
    about 2e38 (never inf: SiLU divides by 1 + exp(-g)); a NaN stays NaN."""
    x = torch.tensor([float("-inf"), -1e30, -100.0, 100.0, 1e30, float("inf"), float("nan"),
                      0.0, 1.0])
    y = decode_kernel.load().exp(x)
    assert (y[:3] > 0).all() and (y[:3] < 2e-38).all()
    assert torch.isfinite(y[3:6]).all() and (y[3:6] > 1e38).all()
    assert torch.isnan(y[6]) and y[7] == 1.0
    torch.testing.assert_close(y[8], torch.tensor(torch.e, dtype=torch.float32))
