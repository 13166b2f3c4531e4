"""Inside the model's forward: where a tick's time goes, and what the compact forward saves.

`tick-profile`: the chat mix (`-n` requests at t=0, batch 8, chunks of 256, EOS ignored)
  run twice: plain, with forward hooks (wall time, time inside the forward, and in it the
  output head), then under `torch.profiler`, the forward's CPU time by operator group.
  The profiler slows small operators more than large ones: quote its shares, and the
  plain run's seconds.
`compact`: per batch size B, two paged engines (`model_runner="hf"` and `"compact"`) with
  B rows of `--prompt-len` tokens decoding, and the floor (the weight matmuls of one
  forward at batch B alone), interleaved; then the compact tick's operator split.
`linear`: every weight matmul of one SmolLM2-135M decode forward at batch B, done with
  `F.linear` (what HF's `nn.Linear` calls) and with `compact.Linear` (oneDNN, the weight
  reordered once into its blocked layout), interleaved.
"""

from __future__ import annotations

import statistics
import time

from .overhead import fill_decode_batch
from .registry import at_least, experiment, option
from .report import md_table
from .timing import ForwardClock, decode_race, drain, fastest_ms, interleave, medians_ms

GROUPS = {
    "weight matmuls (linear layers + head)": ("aten::mm", "aten::addmm",
                                              "mkldnn::_linear_pointwise"),
    "KV gather / write (paged pool)": ("aten::index_select", "aten::index_copy_"),
    "attention math": ("aten::bmm", "aten::_softmax", "aten::masked_fill_",
                       "aten::_scaled_dot_product_flash_attention_for_cpu"),
}


def op_shares(step, n: int) -> dict[str, float]:
    """`step()` n times under torch.profiler: the share of CPU time in each of GROUPS."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            step()
    ops = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(ops.values())
    return {g: sum(ops.get(op, 0.0) for op in group) / total for g, group in GROUPS.items()}


@experiment("tick-profile", option("-n", type=at_least(1), default=16,
                                   help="requests of the chat mix"),
            option("--backend", default="paged", choices=["padded", "paged"],
                   help="minserve backend"),
            option("--prefill-mode", default="mixed_batch",
                   choices=["monolithic", "chunked", "mixed_batch"], help="how prompts run"),
            option("--max-tokens", type=at_least(1), default=None,
                   help="cap every reply at this many tokens (default: the chat mix's lengths)"),
            smallest=("-n", "2", "--max-tokens", "4"))
def tick_profile(bench):
    """Where a serving run's time goes: outside the forward, the head, operator groups."""
    from .. import SamplingParams
    from .workload import make_workload

    a = bench.args
    model, _ = bench.model()

    def run() -> tuple[float, int, int]:
        engine = bench.engine(backend=a.backend, prefill_mode=a.prefill_mode,
                              prefill_chunk_size=256, max_batch_size=8)
        for r in make_workload(a.n, seed=0).requests:
            engine.submit(list(r.prompt_ids), SamplingParams(
                max_tokens=min(r.max_tokens, a.max_tokens or r.max_tokens), ignore_eos=True))
        t0, ticks = time.perf_counter(), 0
        while engine.scheduler.has_work():
            engine.step()
            ticks += 1
        wall = time.perf_counter() - t0
        drain(engine, close=True)
        return wall, ticks, engine.stats()["tokens_generated"]

    clocks = ForwardClock(model), ForwardClock(model.lm_head)
    wall, ticks, tokens = run()
    for c in clocks:  # the profiled run times itself
        c.remove()
    shares = op_shares(run, 1)
    shares["the rest (norms, RoPE, SiLU, adds, copies)"] = 1 - sum(shares.values())
    fwd, head = clocks[0].spent, clocks[1].spent
    bench.publish(f"tick-profile-{a.backend}-{a.prefill_mode}", [
        f"## Where the time goes: `{a.prefill_mode}` on the {a.backend} backend", "",
        f"`.venv/bin/minserve bench tick-profile --backend {a.backend} --prefill-mode {a.prefill_mode}`: "
        f"the chat mix, {a.n} requests at t=0, batch 8, chunks of 256, EOS ignored; one plain "
        "run with forward hooks, one under `torch.profiler`.", "",
        *md_table(["where", "seconds", "share of the run"], [
            [f"the whole run ({ticks} ticks, {tokens} output tokens)", f"{wall:.1f}", "100%"],
            ["outside the model's forward (scheduler, sampling, streaming, records)",
             f"{wall - fwd:.1f}", f"{100 * (wall - fwd) / wall:.1f}%"],
            ["inside the forward", f"{fwd:.1f}", f"{100 * fwd / wall:.1f}%"],
            ["of which the output head (`lm_head`, logits only where sampled)", f"{head:.1f}",
             f"{100 * head / wall:.1f}%"]]), "",
        *md_table(["inside the forward, by operator (profiled run)", "share of the forward"],
                  [[g, f"{100 * v:.1f}%"] for g, v in shares.items()])])


def _floor_step(runner, inputs) -> None:
    """The weight matmuls of one decode forward at batch B, nothing else."""
    x, attn, act = inputs  # (B, E), (B, H*D), (B, I)
    for w in runner.layers:  # as the compact forward calls them (compact.Linear)
        w["qkv"](x)
        w["o"](attn)
        w["gate_up"](x)
        w["down"](act)
    runner.head(x)


def compact_ticks(model, tokenizer, B: int, prompt_len: int, ticks: int, warmup: int = 2) -> dict:
    """Medians (and fastest) ms of a decode tick of both runners and of the floor, the
    compact tick's time outside its forward, and its forward's operator shares."""
    import torch

    from .. import Engine, EngineConfig

    per_row = -(-(prompt_len + ticks + warmup + 16) // 16)  # blocks one row needs
    engines = {r: Engine(EngineConfig(device="cpu", backend="paged", model_runner=r,
                                      max_batch_size=B, num_blocks=B * per_row + 2,
                                      enable_prefix_caching=False), model=model, tokenizer=tokenizer)
               for r in ("hf", "compact")}
    handles = [h for e in engines.values()
               for h in fill_decode_batch(e, B, prompt_len, ticks + warmup, seed=0)[1]]
    backend = engines["compact"].scheduler.backend
    runner, inner, spent, fwd = backend.runner, backend._run, [0.0], []

    def timed_run(*a, **kw):  # the forward inside the compact tick
        t = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            spent[0] += time.perf_counter() - t

    backend._run = timed_run
    inputs = (torch.randn(B, runner.embed.shape[1]),
              torch.randn(B, runner.num_heads * runner.head_dim),
              torch.randn(B, runner.layers[0]["down"].shape[1]))

    def seen(name: str, _) -> None:
        if name == "compact":
            fwd.append(spent[0])
            spent[0] = 0.0

    with torch.inference_mode():
        times = decode_race(engines, ticks, warmup, rows=B, seen=seen,
                            floor=lambda: _floor_step(runner, inputs))
        shares = op_shares(engines["compact"].step, min(4, ticks))
    for e in engines.values():
        drain(e, handles, close=True)
    outside = statistics.median(t - f for t, f in zip(times["compact"], fwd[warmup:]))
    return {"B": B, **medians_ms(times), **{k + "_min": v for k, v in fastest_ms(times).items()},
            "outside_ms": outside * 1e3, "shares": shares}


@experiment("compact", option("--batch", type=at_least(1), nargs="+", default=[1, 8, 16, 32],
                              help="rows in the decode batch, one run each"),
            option("--prompt-len", type=at_least(1), default=384, help="tokens of history per row"),
            option("--ticks", type=at_least(1), default=12, help="decode ticks timed"),
            smallest=("--batch", "1", "--prompt-len", "8", "--ticks", "1"))
def compact(bench):
    """A decode tick: the HF model vs the compact forward, against the weight-matmul floor."""
    a = bench.args
    model, tokenizer = bench.model()
    rows = []
    for B in a.batch:
        r = compact_ticks(model, tokenizer, B, a.prompt_len, a.ticks)
        s = list(r["shares"].values())
        rows.append([B, f"{r['hf']:.1f}", f"{r['compact']:.1f}",
                     f"{r['compact'] / r['hf']:.2f} ({r['compact_min'] / r['hf_min']:.2f})",
                     f"{r['floor']:.1f}",
                     f"{r['compact'] / r['floor']:.2f} ({r['compact_min'] / r['floor_min']:.2f})",
                     f"{r['outside_ms']:.1f}", " / ".join(f"{100 * x:.0f}%" for x in
                                                          [*s, 1 - sum(s)])])
        print(rows[-1], flush=True)
    threads = f" --threads {a.threads}" if a.threads else ""
    bench.publish("compact-forward" + (f"-threads{a.threads}" if a.threads else ""), [
        "## Compact forward: decode tick, HF model vs `model_runner=\"compact\"`", "",
        f"`.venv/bin/minserve bench compact{threads}`: paged backend, SmolLM2-135M fp32, B rows of "
        f"{a.prompt_len} tokens in the decode batch; one tick of each engine and the weight "
        f"matmuls alone, interleaved, medians of {a.ticks} rounds (in brackets: the ratio of the "
        "fastest, least disturbed ticks). The operator split is from `torch.profiler` over 4 "
        "more compact ticks (it inflates small operators, so read it as shares).", "",
        *md_table(["batch", "HF model (ms/tick)", "compact (ms/tick)", "compact / HF (fastest "
                   "ticks)", "weight-matmul floor (ms)", "compact / floor (fastest)", "compact: "
                   "outside the forward (ms)", "compact forward: matmuls / KV gather+write / "
                   "attention math / rest"], rows)])


def weight_pairs(runner) -> list[tuple[object, object]]:
    """(plain weight, prepacked Linear) for every linear layer of one forward."""
    lins = [w[name] for w in runner.layers for name in ("qkv", "o", "gate_up", "down")]
    # a Linear with a packed copy drops its plain one; rebuild it from oneDNN's
    return [(lin.weight if lin.weight is not None else lin.packed.to_dense(), lin)
            for lin in [*lins, runner.head]]


def linear_times(runner, B: int, rounds: int, c_rows: int = 0) -> dict[str, float]:
    """Median ms of every weight matmul of one forward at batch B, each way: `F.linear`,
    oneDNN prepacked, and up to `c_rows` rows the C matmul on panels (decode_kernel.c,
    `rows_linear`)."""
    import torch
    import torch.nn.functional as F

    pairs = weight_pairs(runner)
    x = {lin.shape[1]: torch.randn(B, lin.shape[1]) for _, lin in pairs}

    def onednn(lin, xb):
        return torch.ops.mkldnn._linear_pointwise(xb, lin.packed, lin.bias, "none", [], "")

    sides = {"F.linear": lambda: [F.linear(x[lin.shape[1]], w) for w, lin in pairs],
             "prepacked": lambda: [onednn(lin, x[lin.shape[1]]) for _, lin in pairs]}
    if B <= c_rows and runner.kernel is not None:
        sides["C"] = lambda: [runner.kernel.linear(x[lin.shape[1]], lin.panels, lin.bias)
                              for _, lin in pairs]
    with torch.inference_mode():
        return medians_ms(interleave(sides, rounds))


@experiment("linear", option("--batch", type=at_least(1), nargs="+",
                             default=[1, 2, 4, 8, 16, 32, 64], help="rows, one run each"),
            option("--rounds", type=at_least(1), default=9, help="interleaved rounds timed"),
            option("--c-rows", type=at_least(0), default=64,
                   help="time the C matmul up to this batch"),
            threads=1, smallest=("--batch", "1", "--rounds", "1"))
def linear(bench):
    """Linear layers: `F.linear`, the prepacked oneDNN `Linear` and the C matmul on panels."""
    from ..fast.compact import CompactLlama, Linear

    a = bench.args
    runner = CompactLlama(bench.model()[0], max_model_len=64)
    if runner.head.packed is None:
        raise SystemExit("this torch has no oneDNN (mkldnn): nothing prepacked to time")
    rows = []
    for B in a.batch:
        r = linear_times(runner, B, a.rounds, a.c_rows)
        c = (f"{r['C']:.1f}", f"{r['C'] / r['prepacked']:.2f}x") if "C" in r else ("–", "–")
        rows.append([B, f"{r['F.linear']:.1f}", f"{r['prepacked']:.1f}",
                     f"{r['F.linear'] / r['prepacked']:.2f}x", *c])
        print(rows[-1], flush=True)
    bench.publish(f"linear-layers-threads{a.threads}", [
        "## Linear layers: `F.linear` vs prepacked oneDNN vs the C matmul", "",
        f"`.venv/bin/minserve bench linear --threads {a.threads}`: every weight matmul of one SmolLM2-135M "
        "decode forward at batch B (30 layers' fused qkv, o, gate_up, down, and the output "
        "head; fp32), done with PyTorch's `F.linear`, with oneDNN on weights reordered once, "
        f"and up to {a.c_rows} rows with the C matmul of decode_kernel.c (`rows_linear`, "
        f"weights packed in panels once), interleaved, medians of {a.rounds} rounds. HF's "
        f"model runs the first; the compact forward's `Linear` runs the C matmul up to "
        f"{Linear.PANEL_ROWS} rows, oneDNN above.", "",
        *md_table(["batch", "`F.linear` (ms)", "prepacked oneDNN (ms)", "F.linear / oneDNN",
                   "C matmul (ms)", "C / oneDNN"], rows)])
