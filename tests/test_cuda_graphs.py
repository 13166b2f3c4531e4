"""The decode step over static buffers, per batch-size bucket (fast/cuda_graphs.py, SPEC D5).

What runs on a CPU: the buckets, and the static step itself (`DecodeGraphs(capture=False)`
runs over the very buffers a graph records, eagerly): rows joining and leaving, padding
rows that write only the spare block, token-exact against HF `generate`. The capture and
replay need a GPU: tests/test_cuda.py (marked `cuda`).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from minserve import EngineConfig, SamplingParams
from minserve.backends.kv_storage import KVBlockStorage
from minserve.backends.paged import PagedBackend
from minserve.fast.compact import CompactLlama
from minserve.fast.cuda_graphs import DecodeGraphs, batch_buckets, block_bucket, bucket_for

from .conftest import hf_greedy, make_engine, run_checked

# rows of different lengths, joining and leaving: a short prompt, long ones that cross
# block buckets (block_size 4: 1, 2, 4, 8, 16 blocks) while they decode
PLAN = [([5, 6, 7], 9), (list(range(10, 31)), 14), ([40, 41], 3), (list(range(50, 62)), 11),
        ([70, 71, 72, 73, 74], 6), (list(range(80, 86)), 12), ([90], 5)]


def test_batch_buckets_are_powers_of_two_then_the_largest_batch():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(1) == [1]
    assert [bucket_for(n, batch_buckets(6)) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    with pytest.raises(ValueError):
        bucket_for(7, batch_buckets(6))
    assert [block_bucket(n, 12) for n in (1, 2, 3, 5, 9, 12)] == [1, 2, 4, 8, 12, 12]


def static_engine(model, max_batch_size: int = 6, capture: bool = False):
    """A paged engine whose decode steps run through `DecodeGraphs`' static step (eagerly:
    no CUDA here), over a pool with the spare block the padding rows write into."""
    engine = make_engine(model, backend="paged", model_runner="compact", block_size=4,
                         max_batch_size=max_batch_size, prefill_chunk_size=8)
    s, old = engine.scheduler, engine.scheduler.backend
    storage = KVBlockStorage.for_model(model, engine.num_blocks, 4, spare_blocks=1)
    runner = CompactLlama(model, engine.max_model_len)
    graphs = DecodeGraphs(runner, storage, max_batch_size, engine.max_model_len, capture=capture)
    s.backend = PagedBackend(model, engine.block_manager, storage, engine.max_model_len,
                             runner, graphs=graphs)
    old.close()
    return engine, graphs, storage


def test_the_static_decode_step_gives_hf_tokens_as_rows_join_and_leave(tiny_model):
    engine, graphs, storage = static_engine(tiny_model)
    handles = [engine.submit(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in PLAN]
    run_checked(engine)  # R1 and the queues after every phase
    for (p, n), h in zip(PLAN, handles):
        assert h.output.token_ids == hf_greedy(tiny_model, p, n), p[:3]
    sizes = {B for B, _ in graphs.graphs}
    assert len(sizes) >= 3 and len({M for _, M in graphs.graphs}) >= 3, graphs.graphs.keys()
    assert graphs.replays > 10
    # the padding rows wrote into the spare block, and only there
    k, _ = storage.flat(0)  # (H_kv, (num_blocks + 1) * S, D)
    assert k[:, storage.num_blocks * 4:].abs().sum() > 0


def test_the_static_step_writes_the_pool_as_the_eager_step_does(tiny_model):
    """Same workload, eager compact vs the static step: every real block ends with the
    same KV (padding rows touched none of them) and every token is the same."""
    eager = make_engine(tiny_model, backend="paged", model_runner="compact", block_size=4,
                        max_batch_size=6, prefill_chunk_size=8)
    static, _, storage = static_engine(tiny_model)
    outs = []
    for engine in (eager, static):
        hs = [engine.submit(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in PLAN]
        run_checked(engine)
        outs.append([h.output.token_ids for h in hs])
    assert outs[0] == outs[1]
    n = storage.num_blocks * 4
    for layer in range(storage.num_layers):
        for a, b in zip(eager.scheduler.backend.storage.flat(layer), storage.flat(layer)):
            torch.testing.assert_close(a, b[:, :n], rtol=1e-4, atol=1e-5)


def test_seeded_sampling_through_the_static_step_is_the_eager_one(tiny_model):
    eager = make_engine(tiny_model, backend="paged", model_runner="compact", block_size=4,
                        max_batch_size=6)
    static, _, _ = static_engine(tiny_model)
    params = [SamplingParams(max_tokens=n, temperature=0.9, top_p=0.9, seed=i, ignore_eos=True)
              for i, (_, n) in enumerate(PLAN)]
    got = [[o.token_ids for o in e.generate([p for p, _ in PLAN], params)] for e in (eager, static)]
    assert got[0] == got[1]


def test_the_cuda_graphs_knob_is_validated_and_off_the_gpu_changes_nothing(tiny_model):
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="on")
    engine = make_engine(tiny_model, backend="paged", model_runner="compact", cuda_graphs="auto")
    assert engine.scheduler.backend.graphs is None  # no CUDA here: eager
    assert engine.scheduler.backend.storage.spare_blocks == 0
    with pytest.raises(ValueError, match="spare block"):
        DecodeGraphs(engine.scheduler.backend.runner, engine.scheduler.backend.storage, 4, 64,
                     capture=False)


def test_the_static_step_reads_no_value_on_the_host_so_a_graph_can_record_it():
    """A CUDA graph records kernels, not Python: a step that reads a tensor's value on the
    host (`.item()`, `bool(t)`, a shape taken from the data) cannot be captured. On the
    meta device tensors have shapes and no values, so any such read raises: the whole
    static step, the compact forward and the paged attention in it, runs there."""
    graphs = meta_graphs()
    assert graphs.storage.device.type == "meta"
    out = graphs.run([1, 2, 3], [5, 9, 2], [[0, 1], [2, 3, 4], [5]])
    assert out.shape == (3, 256) and out.device.type == "meta"


class FakeCudaGraphs:
    """torch.cuda's stream and graph calls, recorded, so that the capture path of
    `DecodeGraphs` (capture=True) runs on a CPU. A fake graph replays as a CUDA graph does:
    the step it recorded runs again over the same input buffers and writes into the SAME
    output tensor. What it cannot show (a kernel that may not be captured, a host read)
    the meta-device test above and tests/test_cuda.py do."""

    def __init__(self, monkeypatch):
        self.log: list[tuple] = []
        self.stream = "default"  # the current stream's name
        self.capturing = None  # the fake graph being captured
        self.device = None  # inside `torch.cuda.device(...)`: its name
        fake = self

        class Stream:
            made = 0

            def __init__(self, name=None):
                Stream.made += 1
                self.name = name or f"stream {Stream.made}"

            def wait_stream(self, other):
                fake.log.append(("wait", self.name, other.name))

        class CUDAGraph:
            def replay(self):
                with torch.inference_mode():  # (the output is an inference tensor)
                    self.output.copy_(self.step())  # the same kernels, the same addresses

        @contextlib.contextmanager
        def stream(s):
            before, fake.stream = fake.stream, s.name
            yield
            fake.stream = before

        @contextlib.contextmanager
        def graph(g, pool=None, stream=None, capture_error_mode="global"):
            fake.log.append(("capture", pool, stream and stream.name, capture_error_mode,
                             fake.device))
            fake.capturing = g
            yield
            fake.capturing = None

        @contextlib.contextmanager
        def device(d):
            before, fake.device = fake.device, str(d)
            yield
            fake.device = before

        real_step = DecodeGraphs._step

        def step(graphs, g):
            fake.log.append(("step", fake.stream if fake.capturing is None else "capture",
                             (g.B, g.M)))
            out = real_step(graphs, g)
            if fake.capturing is not None:
                fake.capturing.step, fake.capturing.output = (lambda: real_step(graphs, g)), out
            return out

        def pin_memory(t):
            fake.log.append(("pin",))
            return t

        for name, value in (("graph_pool_handle", lambda: "the pool"), ("Stream", Stream),
                            ("current_stream", lambda: Stream("default")), ("stream", stream),
                            ("CUDAGraph", CUDAGraph), ("graph", graph), ("device", device)):
            monkeypatch.setattr(torch.cuda, name, value)
        monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
        monkeypatch.setattr(DecodeGraphs, "_step", step)


def test_every_graph_is_warmed_up_then_captured_into_one_pool_and_replays_give_hf_tokens(
        tiny_model, monkeypatch):
    """The capture path, on a CPU with torch.cuda's graph calls faked (`FakeCudaGraphs`):
    every (B, M) graph runs its step once on a side stream first (lazy initialisations,
    cuBLAS's workspace, must not happen inside a capture), is captured into the one shared
    pool from one stream with capture_error_mode="thread_local" (the server ticks the
    engine in a thread beside others), on the pool's device, every step's inputs come from
    pinned memory, and reading each replay's output tensor gives HF's tokens as rows join
    and leave."""
    fake = FakeCudaGraphs(monkeypatch)
    engine, graphs, _ = static_engine(tiny_model, capture=True)
    handles = [engine.submit(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in PLAN]
    run_checked(engine)
    for (p, n), h in zip(PLAN, handles):
        assert h.output.token_ids == hf_greedy(tiny_model, p, n), p[:3]
    assert len(graphs.graphs) >= 6 and all(g.graph is not None for g in graphs.graphs.values())
    steps = [(where, key) for kind, *rest in fake.log if kind == "step" for where, key in [rest]]
    assert all(where != "default" for where, _ in steps)  # no step ran outside a graph
    captures = [entry for entry in fake.log if entry[0] == "capture"]
    capture_stream = captures[0][2]
    assert captures == [("capture", "the pool", capture_stream, "thread_local", "cpu")] * len(
        graphs.graphs)  # one pool, one stream, on the pool's device
    for key in graphs.graphs:  # exactly one warm-up on a side stream, then one capture
        (warm, _), (then, _) = [(w, k) for w, k in steps if k == key]
        assert warm not in ("default", "capture", capture_stream) and then == "capture", key
    assert len({id(g.graph) for g in graphs.graphs.values()}) == len(graphs.graphs)
    assert sum(entry == ("pin",) for entry in fake.log) == graphs.replays + len(graphs.graphs)


def test_capture_all_captures_every_bucket_a_run_can_meet_largest_first(tiny_model):
    """Before a measured run (the GPU benchmark): every (B, M) up to the longest row, the
    largest first; the run then captures nothing."""
    engine, graphs, _ = static_engine(tiny_model)  # block_size 4, max_batch_size 6
    longest = max(len(p) + n for p, n in PLAN)  # 36 tokens: 9 blocks, bucket 16
    assert graphs.capture_all(longest) == 4 * 5  # B in 1, 2, 4, 6; M in 1, 2, 4, 8, 16
    assert list(graphs.graphs)[0] == (6, 16) and list(graphs.graphs)[-1] == (1, 1)
    engine.generate([p for p, _ in PLAN], [SamplingParams(max_tokens=n, ignore_eos=True)
                                            for _, n in PLAN])
    assert len(graphs.graphs) == 20 and graphs.replays > 10


class CaptureRules(TorchDispatchMode):
    """Every operator the step dispatches, checked against what a CUDA graph can record:
    no tensor from the host (a `torch.tensor(list)` or a `.to(device)` of a CPU tensor is
    a pageable copy, refused during a capture; a CPU scalar tensor would be read once, at
    capture, and baked into every replay) and no value read back (`.item()`)."""

    def __init__(self):
        super().__init__()
        self.ops, self.broken = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        host = [tuple(t.shape) for t in tree_flatten((args, kwargs))[0]
                if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
        if host or func is torch.ops.aten._local_scalar_dense.default:
            self.broken.append((str(func), host))
        return func(*args, **kwargs)


def meta_graphs(max_batch_size=4):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).eval()
    storage = KVBlockStorage.for_model(model, 16, 4, spare_blocks=1)
    return DecodeGraphs(CompactLlama(model, 256), storage, max_batch_size, 256, capture=False)


def test_the_recorded_step_takes_nothing_from_the_host_and_reads_nothing_back(monkeypatch):
    """What `_make` captures, `_step` over a bucket's buffers, run on the meta device under
    `CaptureRules`: every operator a device operator on device tensors. The inputs reach
    the device before, in `run`'s one copy. Proved able to fail: a step that builds its
    key positions on the host, or takes a scalar as a CPU tensor, is caught."""
    graphs = meta_graphs()
    for B, M in ((1, 1), (4, 8)):
        g = graphs._make(B, M)
        with torch.inference_mode(), CaptureRules() as rules:
            out = graphs._step(g)
        assert out.shape == (B, 256) and rules.ops > 50 and rules.broken == [], rules.broken

    arange = torch.arange  # the mutation: positions made on the host, then moved
    monkeypatch.setattr(torch, "arange", lambda *a, device=None, **k: arange(*a, **k).to(device))
    g = graphs._make(2, 2)
    with torch.inference_mode(), CaptureRules() as rules:
        graphs._step(g)
    assert [shape for _, shape in rules.broken] == [[(8,)]], rules.broken  # the 2 x 4 keys
