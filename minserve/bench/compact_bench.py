"""Decode tick: the HF model vs the compact forward, against the weight-matmul floor.

    python -m minserve.bench.compact_bench                  # batch 1, 8, 16, 32; ~5 min on 2 cores
    python -m minserve.bench.compact_bench --batch 1 8 --threads 1 --no-docs

For each batch size B, two paged engines on the same embedded SmolLM2 (fp32), one
with `model_runner="hf"` and one with `model_runner="compact"`, each holding B rows
of `--prompt-len` random tokens in its decode batch. Then, interleaved (the order
rotates every round, so neither always runs first on a busy machine): one decode
tick of each, and the floor, i.e. only the weight matmuls of one forward at batch B
(every layer's fused qkv, o, gate_up, down `compact.Linear`, plus the output head on B
rows). Medians over the rounds; the ratios are the figures to quote.

Where the compact tick's remaining time goes comes from one more pass of ticks under
`torch.profiler`, by operator group (as `tick_profile`), plus the tick's time outside
the forward (scheduler, sampling, streaming, records).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from .docs_report import machine_line, publish
from .overhead import _fill_decode_batch
from .tick_profile import GROUPS


class _RunClock:
    """Times `backend._run` (the forward) inside each tick."""

    def __init__(self, backend) -> None:
        self.spent, self._inner = 0.0, backend._run

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return self._inner(*a, **kw)
            finally:
                self.spent += time.perf_counter() - t

        backend._run = timed


def _engine(model, tokenizer, runner: str, B: int, prompt_len: int, ticks: int):
    from .. import Engine, EngineConfig

    per_row = -(-(prompt_len + ticks + 16) // 16)  # blocks one row needs
    cfg = EngineConfig(device="cpu", backend="paged", model_runner=runner, max_batch_size=B,
                       num_blocks=B * per_row + 2, enable_prefix_caching=False)
    return Engine(cfg, model=model, tokenizer=tokenizer)


def _floor_step(runner, inputs: tuple[torch.Tensor, ...]) -> None:
    """The weight matmuls of one decode forward at batch B, nothing else."""
    x, attn, act = inputs  # (B, E), (B, H*D), (B, I)
    for w in runner.layers:  # as the compact forward calls them (compact.Linear)
        w["qkv"](x)
        w["o"](attn)
        w["gate_up"](x)
        w["down"](act)
    runner.head(x)


@torch.inference_mode()
def measure(model, tokenizer, B: int, prompt_len: int, ticks: int, warmup: int = 2) -> dict:
    engines = {r: _engine(model, tokenizer, r, B, prompt_len, ticks + warmup)
               for r in ("hf", "compact")}
    handles = []
    for e in engines.values():
        handles += _fill_decode_batch(e, B, prompt_len, ticks + warmup, seed=0)[1]
    runner = engines["compact"].scheduler.backend.runner
    inputs = (torch.randn(B, runner.embed.shape[1]), torch.randn(B, runner.num_heads * runner.head_dim),
              torch.randn(B, runner.layers[0]["down"].shape[1]))
    clock = _RunClock(engines["compact"].scheduler.backend)
    times = {"hf": [], "compact": [], "floor": []}
    fwd = []
    names = ["hf", "compact", "floor"]
    for k in range(warmup + ticks):
        for name in names[k % 3:] + names[:k % 3]:  # rotate the order every round
            clock.spent = 0.0
            t = time.perf_counter()
            if name == "floor":
                _floor_step(runner, inputs)
            else:
                rec = engines[name].step()
                assert len(rec.decode.rows) == B and not rec.prefill.chunks, "not a pure decode tick"
            if k >= warmup:
                times[name].append(time.perf_counter() - t)
                if name == "compact":
                    fwd.append(clock.spent)
    # where the compact tick's time goes, by operator
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(min(4, ticks)):
            engines["compact"].step()
    ops = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(ops.values())
    shares = {g: sum(ops.get(op, 0.0) for op in group) / total for g, group in GROUPS.items()}
    for h in handles:
        h.cancel()
    for e in engines.values():
        while e.scheduler.has_work():
            e.step()
        e.scheduler.backend.close()
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    fastest = {k + "_min": min(v) * 1e3 for k, v in times.items()}  # the least disturbed
    outside = statistics.median(t - f for t, f in zip(times["compact"], fwd)) * 1e3
    return {"B": B, **med, **fastest, "outside_ms": outside, "shares": shares}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16, 32])
    p.add_argument("--prompt-len", type=int, default=384, help="tokens of history per row")
    p.add_argument("--ticks", type=int, default=12)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--no-docs", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from ..models import load_model

    torch.manual_seed(0)
    model, tokenizer = load_model(None, "float32", "cpu")
    rows = ["| batch | HF model (ms/tick) | compact (ms/tick) | compact / HF (fastest ticks) "
            "| weight-matmul floor (ms) | compact / floor (fastest) | compact: outside the "
            "forward (ms) | compact forward: matmuls / KV gather+write / attention math / rest |",
            "|---|---|---|---|---|---|---|---|"]
    for B in args.batch:
        r = measure(model, tokenizer, B, args.prompt_len, args.ticks)
        s = list(r["shares"].values())
        rows.append(f"| {B} | {r['hf']:.1f} | {r['compact']:.1f} | {r['compact'] / r['hf']:.2f} "
                    f"({r['compact_min'] / r['hf_min']:.2f}) | {r['floor']:.1f} | "
                    f"{r['compact'] / r['floor']:.2f} ({r['compact_min'] / r['floor_min']:.2f}) | "
                    f"{r['outside_ms']:.1f} | {100 * s[0]:.0f}% / {100 * s[1]:.0f}% / "
                    f"{100 * s[2]:.0f}% / {100 * (1 - sum(s)):.0f}% |")
        print(rows[-1], flush=True)
    threads = f" --threads {args.threads}" if args.threads else ""
    md = "\n".join([
        "## Compact forward: decode tick, HF model vs `model_runner=\"compact\"`", "",
        f"`python -m minserve.bench.compact_bench{threads}`: paged backend, SmolLM2-135M "
        f"fp32, B rows of {args.prompt_len} tokens in the decode batch; one tick of each "
        "engine and the weight matmuls alone, interleaved, medians of "
        f"{args.ticks} rounds (in brackets: the ratio of the fastest, least disturbed "
        "ticks). The operator split is from `torch.profiler` over 4 more "
        "compact ticks (it inflates small operators, so read it as shares).", "",
        *rows, "", machine_line()])
    publish("compact-forward" + (f"-threads{args.threads}" if args.threads else ""), md,
            write=not args.no_docs)


if __name__ == "__main__":
    main()
