"""Sampling: the batched sampler chooses, row for row, what the per-row one chooses, and a
decode tick reads the host once, however many rows it has (SPEC A1, D5).

`Sampler.sample_row` is the readable reference (one row, `torch.multinomial`);
`Sampler.sample` is what a tick calls: every row of a forward in one batched call and one
copy to the host. Both draw from each row's own generator, so a request's tokens depend on
its seed and nothing else, whoever shares the batch.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from minserve import SamplingParams
from minserve.sampling import NAN_LOGITS, NO_FINITE_LOGIT, Sampler, make_generator

from .conftest import make_engine

row_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 1e-6, 1e-4, 0.3, 0.7, 1.0, 1.5, 7.0]),
    top_k=st.sampled_from([0, 0, 1, 2, 5, 40, 10_000]),
    top_p=st.sampled_from([1.0, 1.0, 0.95, 0.9, 0.5, 0.05, 1e-30]))


def per_row(logits, params, seeds):
    """The reference: each row alone through `sample_row`, errors as their messages."""
    out, gens = [], [make_generator(s) for s in seeds]
    for row, p, g in zip(logits, params, gens):
        try:
            out.append(Sampler.sample_row(row, p, g))
        except ValueError as e:
            out.append(str(e))
    return out, gens


@settings(max_examples=30, deadline=None)
@given(params=st.lists(row_params, min_size=1, max_size=12),
       vocab=st.sampled_from([3, 50, 1000, 8192]), scale=st.sampled_from([0.5, 3.0, 20.0]),
       data=st.data())
def test_the_batched_sampler_picks_each_rows_token_as_the_per_row_one_does(params, vocab,
                                                                           scale, data):
    seeds = data.draw(st.lists(st.integers(0, 2**62), min_size=len(params), max_size=len(params)))
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(seeds[0])) * scale
    want, gens_a = per_row(logits, params, seeds)
    gens_b = [make_generator(s) for s in seeds]
    got = Sampler.sample(logits, params, gens_b)
    assert got == want
    # and each generator moved exactly as far: the row's next draws are the same too
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(gens_a, gens_b))


def test_rows_that_cannot_be_sampled_fail_alone_in_a_batched_call():
    logits = torch.randn(5, 20, generator=torch.Generator().manual_seed(0))
    logits[1, 3] = float("nan")  # NaN: refused under greedy too
    logits[2] = float("-inf")  # nothing finite: a sampled row cannot draw from it
    logits[3, 4] = float("nan")
    params = [SamplingParams(temperature=0.8), SamplingParams(), SamplingParams(temperature=0.8),
              SamplingParams(temperature=0.8, top_p=0.5), SamplingParams(top_k=3, temperature=1)]
    seeds = [1, 2, 3, 4, 5]
    want, _ = per_row(logits, params, seeds)
    got = Sampler.sample(logits, params, [make_generator(s) for s in seeds])
    assert got == want
    assert got[1] == NAN_LOGITS and got[3] == NAN_LOGITS and got[2] == NO_FINITE_LOGIT
    assert isinstance(got[0], int) and isinstance(got[4], int)


def test_a_greedy_row_is_argmax_and_draws_nothing_from_its_generator():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    g = make_generator(7)
    before = g.get_state()
    got = Sampler.sample(logits, [SamplingParams()] * 3, [g] * 3)
    assert got == logits.argmax(dim=-1).tolist() and torch.equal(g.get_state(), before)


class HostReads(TorchDispatchMode):
    """Counts the operators that read a tensor's value on the host (`.item()`, `bool(t)`):
    on a GPU each one waits for every kernel queued before it."""

    READS = ("aten._local_scalar_dense", "aten.is_nonzero")
    # indexing with a boolean mask (`t[mask]`, `t[mask] = x`): the result's size is the
    # mask's count, which a GPU must send to the host first (a `nonzero` inside the op)
    INDEXING = ("aten.index.", "aten.index_put", "aten._index_put_impl_")

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(self.READS):
            self.ops[name] += 1
        if name.startswith(self.INDEXING) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            self.ops[name + " with a boolean mask"] += 1
        return func(*args, **(kwargs or {}))


def test_the_batched_sampler_reads_the_host_only_for_its_one_copy():
    """Every setting at once (greedy, temperature, top-k, top-p, both): not one operator
    that waits for the GPU; the `.tolist()` of the answer (not an operator) is the one."""
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(), SamplingParams(temperature=0.7, seed=1),
              SamplingParams(temperature=0.9, top_k=5, seed=2),
              SamplingParams(temperature=1.1, top_p=0.8, seed=3),
              SamplingParams(temperature=0.5, top_k=3, top_p=0.9, seed=4)]
    with HostReads() as counted:
        got = Sampler.sample(logits, params, [make_generator(p.seed or 0) for p in params])
    assert not counted.ops, counted.ops
    assert got == [Sampler.sample_row(row, p, make_generator(p.seed or 0))
                   for row, p in zip(logits, params)]


@pytest.mark.parametrize("runner", ["hf", "compact"])
def test_a_decode_tick_reads_the_host_as_often_for_8_rows_as_for_2(tiny_model, runner):
    """No `.item()` or `bool()` per row on the decode path (the sampler's own copy to the
    host, `.tolist()` once, is not an operator and is not counted)."""
    reads = {}
    for rows in (2, 8):
        engine = make_engine(tiny_model, backend="paged", model_runner=runner, max_batch_size=8)
        for i in range(rows):  # half greedy, half sampled with a nucleus
            engine.submit([5 + i, 6, 7], SamplingParams(
                max_tokens=20, ignore_eos=True, temperature=0.8 * (i % 2), top_p=0.9, seed=i))
        s = engine.scheduler
        s.admit_pending(), s.advance_prefill_chunk(), s.evict_finished(), s.decode_step()
        s.admit_pending(), s.advance_prefill_chunk(), s.evict_finished()
        assert len(s.active) == rows
        with HostReads() as counted:
            s.decode_step()
        reads[rows] = sum(counted.ops.values())
    assert reads[8] == reads[2], reads
    if runner == "compact":  # the compact forward and the sampler read the host not at all
        assert reads[8] == 0, reads
