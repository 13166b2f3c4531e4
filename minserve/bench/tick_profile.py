"""Where a tick's time goes: a whole serving run, split by what the CPU was doing.

    python -m minserve.bench.tick_profile                # mixed_batch, ~3 min on 2 cores
    python -m minserve.bench.tick_profile --backend padded --prefill-mode chunked

The bench's chat mix (16 requests at t=0, batch 8, chunks of 256, EOS ignored) on
the embedded SmolLM2, run twice:

1. plain, with forward hooks only: wall time, time inside the model's forward, and
   inside it the output head (`lm_head`). Wall - forward is the engine itself:
   scheduling, sampling, streaming, records.
2. under `torch.profiler`: the forward's CPU time by operator, grouped:
   weight matmuls (`aten::mm` / `addmm`: every linear layer and the head), the
   attention's KV gather and write (`index_select`, `index_copy_`), the attention
   math (`bmm`, `softmax`, fused SDPA, masking), and the rest (norms, RoPE, SiLU,
   residual adds, copies). The profiler slows small operators down more than large
   ones, so shares from run 2 are of the forward's profiled time, and run 1's
   numbers are the ones to quote in seconds.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from .docs_report import machine_line, publish

GROUPS = {
    "weight matmuls (linear layers + head)": ("aten::mm", "aten::addmm",
                                              "mkldnn::_linear_pointwise"),
    "KV gather / write (paged pool)": ("aten::index_select", "aten::index_copy_"),
    "attention math": ("aten::bmm", "aten::_softmax", "aten::masked_fill_",
                       "aten::_scaled_dot_product_flash_attention_for_cpu"),
}


def _timed(module, box: dict, key: str) -> list:
    """Add the time spent inside `module`'s forward to box[key]; returns the hook handles."""
    start = {}
    return [module.register_forward_pre_hook(
                lambda m, a: start.__setitem__("t", time.perf_counter())),
            module.register_forward_hook(
                lambda m, a, o: box.__setitem__(key, box[key] + time.perf_counter() - start["t"]))]


def run(model, tokenizer, profile: bool, n: int, **cfg) -> dict:
    from .. import Engine, EngineConfig, SamplingParams
    from .workload import make_workload

    engine = Engine(EngineConfig(device="cpu", **cfg), model=model, tokenizer=tokenizer)
    for r in make_workload(n, seed=0).requests:
        engine.submit(list(r.prompt_ids), SamplingParams(max_tokens=r.max_tokens,
                                                         ignore_eos=True))
    t0, ticks = time.perf_counter(), 0
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            while engine.scheduler.has_work():
                engine.step()
                ticks += 1
        ops = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
    else:
        while engine.scheduler.has_work():
            engine.step()
            ticks += 1
        ops = {}
    wall = time.perf_counter() - t0
    close = getattr(engine.scheduler.backend, "close", None)
    if close is not None:
        close()
    return {"wall_s": wall, "ticks": ticks, "ops": ops,
            "tokens": engine.stats()["tokens_generated"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=16)
    p.add_argument("--backend", default="paged")
    p.add_argument("--prefill-mode", default="mixed_batch")
    p.add_argument("--no-docs", action="store_true")
    args = p.parse_args(argv)
    from ..models import load_model

    torch.manual_seed(0)
    model, tokenizer = load_model(None, "float32", "cpu")
    box = defaultdict(float)
    hooks = _timed(model, box, "forward") + _timed(model.lm_head, box, "head")
    cfg = dict(backend=args.backend, prefill_mode=args.prefill_mode, prefill_chunk_size=256,
               max_batch_size=8)
    plain = run(model, tokenizer, False, args.n, **cfg)
    fwd, head = box["forward"], box["head"]
    for h in hooks:  # the profiled run times itself
        h.remove()
    prof = run(model, tokenizer, True, args.n, **cfg)
    total = sum(prof["ops"].values())
    shares = {g: sum(prof["ops"].get(op, 0.0) for op in ops) / total
              for g, ops in GROUPS.items()}
    shares["the rest (norms, RoPE, SiLU, adds, copies)"] = 1 - sum(shares.values())
    wall = plain["wall_s"]
    rows = ["| where | seconds | share of the run |", "|---|---|---|",
            f"| the whole run ({plain['ticks']} ticks, {plain['tokens']} output tokens) | "
            f"{wall:.1f} | 100% |",
            f"| outside the model's forward (scheduler, sampling, streaming, records) | "
            f"{wall - fwd:.1f} | {100 * (wall - fwd) / wall:.1f}% |",
            f"| inside the forward | {fwd:.1f} | {100 * fwd / wall:.1f}% |",
            f"| of which the output head (`lm_head`, logits only where sampled) | {head:.1f} | "
            f"{100 * head / wall:.1f}% |"]
    split = ["| inside the forward, by operator (profiled run) | share of the forward |",
             "|---|---|"] + [f"| {g} | {100 * v:.1f}% |" for g, v in shares.items()]
    md = "\n".join([
        f"## Where the time goes: `{args.prefill_mode}` on the {args.backend} backend", "",
        f"`python -m minserve.bench.tick_profile --backend {args.backend} --prefill-mode "
        f"{args.prefill_mode}`: the chat mix, {args.n} requests at t=0, batch 8, chunks of "
        "256, EOS ignored; one plain run with forward hooks, one under `torch.profiler`.", "",
        *rows, "", *split, "", machine_line()])
    publish(f"tick-profile-{args.backend}-{args.prefill_mode}", md, write=not args.no_docs)


if __name__ == "__main__":
    main()
