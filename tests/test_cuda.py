"""On a CUDA GPU: every mode token-exact against HF `generate` on the device, in float32,
with the decode step replayed from CUDA graphs and without (SPEC B2, C2, D1, D5).

Marked `cuda`: skipped where there is no GPU (CI never has one); `pytest -m cuda` runs
them, and `scripts/gpu_check.sh` runs them with the GPU benchmark on a lent machine.
"""

from __future__ import annotations

import pytest
import torch

from minserve import SamplingParams
from minserve.models import tiny_llama

from .conftest import make_engine

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")]

SHARED = list(range(30, 78))  # 48 tokens: a shared prefix, so the prefix cache has work
PLAN = [(SHARED + [5, 6, 7], 9), (list(range(1, 60)), 17), ([7, 9, 11], 24),
        (SHARED + list(range(100, 140)), 12), (list(range(150, 250)), 33), ([3], 6),
        (SHARED + [8], 21), (list(range(40, 45)), 40)]
MODES = {
    "padded monolithic": dict(backend="padded"),
    "padded chunked": dict(backend="padded", prefill_chunk_size=16),
    "paged monolithic": dict(backend="paged"),
    "paged chunked": dict(backend="paged", prefill_chunk_size=32),
    "paged mixed_batch": dict(backend="paged", prefill_mode="mixed_batch", prefill_chunk_size=32),
    "compact mixed_batch": dict(backend="paged", prefill_mode="mixed_batch", prefill_chunk_size=32,
                                model_runner="compact"),
    "compact preempt, tight pool": dict(backend="paged", model_runner="compact", admission="preempt",
                                        num_blocks=40),
    "fair, padded chunked": dict(policy="fair", backend="padded", prefill_chunk_size=24),
    # prompts on a worker process: the model, the staging pool shared through CUDA IPC,
    # cached prefixes copied into staging (the shared prefix above), each side
    # synchronising before it tells the other (disagg/connector.py, `settle`)
    "compact disaggregated": dict(backend="paged", model_runner="compact",
                                  prefill_mode="disaggregated", prefill_worker_threads=1),
}


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=512, hidden_size=128, num_layers=4, eos_token_id=None).to("cuda")


@pytest.fixture(scope="module")
def oracle(model):
    return [hf_greedy_cuda(model, p, n) for p, n in PLAN]


def hf_greedy_cuda(model, ids, n):
    t = torch.tensor([ids], device="cuda")
    out = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("graphs", ["off", "auto"])
@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_on_cuda_gives_hf_tokens_with_graphs_and_without(model, oracle, mode, graphs):
    engine = make_engine(model, device="cuda", max_batch_size=4, cuda_graphs=graphs, **MODES[mode])
    try:
        outs = engine.generate([p for p, _ in PLAN],
                               [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in PLAN])
    finally:
        if engine.scheduler.remote is not None:
            engine.close()  # the prefill worker process
    assert [o.token_ids for o in outs] == oracle
    assert engine.scheduler.is_drained()
    g = engine.scheduler.backend.__dict__.get("graphs")
    if graphs == "auto" and MODES[mode].get("model_runner") == "compact":
        assert g is not None and g.graphs and all(x.graph is not None for x in g.graphs.values())
        assert g.replays > 0
    else:
        assert g is None


def test_seeded_sampling_is_the_same_with_graphs_and_without(model):
    prompts = [p for p, _ in PLAN]
    params = [SamplingParams(max_tokens=n, temperature=0.8, top_p=0.9, top_k=50, seed=i,
                             ignore_eos=True) for i, (_, n) in enumerate(PLAN)]
    got = [[o.token_ids for o in make_engine(
        model, device="cuda", backend="paged", model_runner="compact", max_batch_size=8,
        cuda_graphs=graphs).generate(prompts, params)] for graphs in ("off", "auto")]
    assert got[0] == got[1]

