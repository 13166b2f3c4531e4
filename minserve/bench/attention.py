"""Decode attention: the PyTorch version (`paged._attend`) against the C kernel.

    minserve bench attention                 # ~1 min, then ~8 min for the ticks
    minserve bench attention --no-ticks --no-docs

1. One layer's decode attention, SmolLM2-135M's shapes (9 query heads over 3 KV heads,
   head dim 64, blocks of 16), B rows that share a 330-token system prompt's blocks (as
   prefix caching leaves them) and then hold 16..288 tokens of their own in blocks
   scattered over the pool, as the chat workload does. Both ways on the same pool and
   tables, interleaved, medians; they must agree (checked each run).
2. Unless `--no-ticks`: whole decode ticks of two engines on the embedded model, the
   compact forward, one with `decode_attention="torch"` and one with `"kernel"`, the same
   B rows in each, ticks interleaved. What the kernel changes in what a user waits for.

One torch thread (`--threads` to change), as `minserve serve` runs on 2 cores.
"""

from __future__ import annotations

import argparse

import torch

from .registry import at_least, experiment, option
from .report import md_table
from .timing import decode_race, decoding, drain, interleave, medians_ms

SYSTEM_TOKENS, S, H, H_KV, D = 330, 16, 9, 3, 64


def _rows(B: int, num_blocks: int, seed: int) -> list[tuple[list[int], int, int]]:
    """B decode rows: the shared prompt's full blocks, then 1..18 own blocks each."""
    g = torch.Generator().manual_seed(seed)
    shared = list(range(SYSTEM_TOKENS // S))
    free = (torch.randperm(num_blocks - len(shared), generator=g) + len(shared)).tolist()
    rows = []
    for _ in range(B):
        own = [free.pop() for _ in range(int(torch.randint(1, 19, (1,), generator=g)))]
        table = shared + own
        rows.append((table, len(table) * S - int(torch.randint(1, S + 1, (1,), generator=g)), 1))
    return rows


def layer_times(B: int, rounds: int = 60) -> dict[str, float]:
    """Median ms of one layer's decode attention at batch B, each way."""
    from ..backends.kv_storage import KVBlockStorage
    from ..backends.paged import PagedForward, _attend
    from ..fast import decode_kernel

    storage = KVBlockStorage(1024, S, 1, H_KV, D)
    for t in storage.flat(0):
        t.normal_()
    rows = _rows(B, storage.num_blocks, seed=B)
    ctx = {"torch": PagedForward.build_rows(storage, rows),
           "kernel": PagedForward.build_rows(storage, rows, decode_kernel.load())}
    q = torch.randn(B, H, 1, D)

    def run(name: str) -> torch.Tensor:
        return _attend(ctx[name], 0, ctx[name].groups[0], q, H_KV, D ** -0.5)

    torch.testing.assert_close(run("kernel"), run("torch"), rtol=1e-4, atol=1e-5)
    return medians_ms(interleave({"torch": lambda: run("torch"), "kernel": lambda: run("kernel")},
                                 rounds, warmup=2))


def tick_times(model, tokenizer, B: int, ticks: int = 16) -> dict[str, float]:
    """Median ms of a whole decode tick, B rows sharing a system prompt, each way."""
    from .. import Engine, EngineConfig, SamplingParams

    g = torch.Generator().manual_seed(B)
    system = torch.randint(100, 40_000, (SYSTEM_TOKENS,), generator=g).tolist()
    prompts = [system + torch.randint(100, 40_000, (int(torch.randint(10, 120, (1,), generator=g)),),
                                      generator=g).tolist() for _ in range(B)]
    engines, handles = {}, []
    for mode in ("torch", "kernel"):
        cfg = EngineConfig(device="cpu", backend="paged", model_runner="compact",
                           decode_attention=mode, max_batch_size=B + 1, num_blocks=64 * B + 64,
                           prefill_mode="mixed_batch", prefill_chunk_size=256)
        e = Engine(cfg, model=model, tokenizer=tokenizer)
        e.generate([system + [5]], SamplingParams(max_tokens=1))  # cache the system prompt
        engines[mode], handles = e, handles + decoding(e, prompts, ticks + 8)
    times = decode_race(engines, ticks, warmup=2, rows=B)
    for e in engines.values():
        drain(e, handles)
    return medians_ms(times)


@experiment("attention", option("--batch", type=at_least(1), nargs="+", default=[1, 2, 8, 16, 32],
                                help="rows, one run each"),
            option("--ticks", action=argparse.BooleanOptionalAction, default=True,
                   help="whole decode ticks too, after one layer's attention"),
            option("--rounds", type=at_least(1), default=60,
                   help="one layer's attention: interleaved rounds timed"),
            threads=1, smallest=("--batch", "1", "--rounds", "1"))
def attention(bench):
    """Decode attention: PyTorch (`paged._attend`) against the C kernel, a layer and a tick."""
    rows = []
    for B in bench.args.batch:
        r = layer_times(B, bench.args.rounds)
        rows.append([B, f"{r['torch']:.2f}", f"{r['kernel']:.2f}", f"{r['kernel'] / r['torch']:.2f}"])
        print(rows[-1], flush=True)
    ticks = []
    if bench.args.ticks:
        model, tok = bench.model()
        for B in bench.args.batch:
            r = tick_times(model, tok, B)
            ticks.append([B, f"{r['torch']:.0f}", f"{r['kernel']:.0f}",
                          f"{r['kernel'] / r['torch']:.2f}"])
            print(ticks[-1], flush=True)
    bench.publish("decode-attention", [
        "## Decode attention: PyTorch vs the C kernel", "",
        "`minserve bench attention`: one layer's decode attention at SmolLM2-135M's shapes (9 "
        "query heads over 3 KV heads, head dim 64, blocks of 16), B rows sharing a "
        f"{SYSTEM_TOKENS}-token system prompt's blocks and holding 16-288 tokens of their own in "
        "blocks scattered over the pool; `paged._attend` (`decode_attention=\"torch\"`: gather, "
        "two batched matmuls, the shared prefix read once) and `decode_kernel.c` (`\"kernel\"`: "
        "the blocks read in place), the same pool and tables, checked equal, interleaved, "
        "medians. Then whole decode ticks of the compact forward on the embedded model, one "
        "engine each way, ticks interleaved. One torch thread.", "",
        *md_table(["batch", "one layer, PyTorch (ms)", "one layer, C kernel (ms)",
                   "kernel / PyTorch"], rows),
        *(["", *md_table(["batch", "decode tick, PyTorch attention (ms)",
                          "decode tick, C kernel (ms)", "kernel / PyTorch"], ticks)]
          if ticks else [])])
