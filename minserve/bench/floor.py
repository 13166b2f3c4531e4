"""`minserve bench floor`: a decode step against what this machine allows, path by path.

    minserve bench floor                           # batch 1, 8, 32, as `minserve serve` runs
    minserve bench floor --batch 1 --context 384 --threads 2 --no-docs

A decode step of B rows, one new token each, must at least read every weight once and
each row's KV, and do 2 flops per weight per row plus the attention's. So it takes at
least

    floor(B) = max(bytes(B) / bandwidth,  flops(B) / matmul rate)

    bytes(B)  = the weights of every matmul (the linear layers and the output head:
                538 MB for SmolLM2-135M in fp32) + B * context * KV bytes per token
    flops(B)  = 2 * matmul params * B + 4 * B * context * H * D * layers  (q.k and p.v)

bandwidth-bound at small B (a token per weight read: 2 flops per 4 bytes), compute-bound
at large B. Both rates are this machine's, measured by torch at the run's thread count
in the same rounds as the steps (timing.py: interleaved, medians), so drift hits the
floor and the steps alike: `read`, a 256 MB tensor summed; `matmul`, a 1024^3 fp32 GEMM.

The paths, each a pure decode tick of an engine holding B rows of `--context` random
tokens (a tick is what a token costs the engine: forward, sampling, bookkeeping):

    readable   EngineConfig() as the lessons use it: padded backend, HF's forward
    compact    paged backend, `model_runner="compact"` (fast/compact.py)
    serve      ... and `decode_attention="kernel"` (fast/decode_kernel.c): what
               `minserve serve` runs
    hf         Hugging Face's own step, the inner loop of static `generate`: its forward
               over its DynamicCache and an argmax (bench/overhead.py, `BareDecoder`)

Up to `Linear.PANEL_ROWS` rows, where the serve path runs its matmuls in C, two more
engines of the serve path time what each part is worth, in the same rounds:
`serve-onednn`, every matmul by oneDNN and every layer in Python (the serve path before
them), and `serve-rows`, the matmuls in C (`compact.Linear`) but the layers still in
Python; the serve path itself also runs the rest of each layer in C (`decode_in_c`: the
whole layer in one call up to `CompactLlama.STEP_IN_C_ROWS` rows, 32; `decode_rows`:
between the matmuls above).

Threads default to what `minserve serve` uses on this machine: every core but one.
"""

from __future__ import annotations

import os

import torch

from ..fast.compact import Linear
from .overhead import BareDecoder
from .registry import at_least, experiment, option
from .report import md_table
from .timing import decode_race, decoding, drain, medians_ms

PATHS = {
    "readable": ("readable default (padded, HF forward)", {"backend": "padded"}),
    "compact": ("paged + compact forward", {"backend": "paged", "model_runner": "compact",
                                            "decode_attention": "torch"}),
    "serve": ("paged + compact + C decode kernel (serve)",
              {"backend": "paged", "model_runner": "compact", "decode_attention": "kernel"}),
}
# At the batch sizes where the serve path runs its matmuls in C (up to Linear.PANEL_ROWS
# rows), the same path with its C parts taken away one at a time: what each is worth,
# measured in the same rounds. (C matmul, the layers in C: `decode_in_c` up to
# STEP_IN_C_ROWS rows, `decode_rows` above); the serve path itself has both.
PARTS = {"serve-onednn": (False, False), "serve-rows": (True, False)}
# Above them, the matmuls stay in oneDNN and the serve path runs C between them
# (`CompactLlama.decode_rows`): beside it, the same path with its layers in Python.
LOOP = {"serve-loop": (True, False)}
READ_FLOATS = 64 * 2**20  # 256 MB: far beyond any cache
GEMM = 1024


def serve_threads() -> int:
    """Every core this process may use but one: `minserve serve`'s default
    (server/cli.py, `serving_threads`, which bench/ may not import)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) - 1)


def step_cost(model, batch: int, context: int) -> dict[str, float]:
    """Bytes and flops of one decode step of `model` at `batch` rows of `context` tokens."""
    cfg = model.config
    matmul_params = sum(m.weight.numel() for m in model.modules()
                        if isinstance(m, torch.nn.Linear))
    itemsize = next(model.parameters()).element_size()
    layers, heads = cfg.num_hidden_layers, cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_per_token = 2 * layers * kv_heads * head_dim * itemsize  # K and V, every layer
    return {"weights_bytes": matmul_params * itemsize,
            "kv_bytes": batch * context * kv_per_token,
            "flops": 2 * matmul_params * batch + 4 * batch * context * heads * head_dim * layers}


def floor_ms(cost: dict[str, float], read_gbs: float, gflops: float) -> dict[str, float]:
    """The bandwidth floor, the compute floor and the floor (the larger), in ms."""
    bw = (cost["weights_bytes"] + cost["kv_bytes"]) / (read_gbs * 1e9) * 1e3
    compute = cost["flops"] / (gflops * 1e9) * 1e3
    return {"bandwidth": bw, "compute": compute, "floor": max(bw, compute)}


def without_c_parts(engine, rows_in_c: bool, layers_in_c: bool) -> None:
    """Take the serve path's C parts out of `engine`'s compact runner (its own, built for
    it): the few rows' matmuls back to oneDNN, the layers back to the Python loop."""
    runner = engine.scheduler.backend.runner
    if not rows_in_c:
        for lin in [runner.head, *(w[n] for w in runner.layers
                                   for n in ("qkv", "o", "gate_up", "down"))]:
            lin.kernel = None
    if not layers_in_c:
        runner._in_c = lambda *_: False


def measure(bench, batch: int, context: int, ticks: int, paths: list[str]) -> dict[str, float]:
    """Median ms of a decode step of each path, and this machine's read and matmul rates
    (GB/s, GFLOP/s), all interleaved."""
    model, tokenizer = bench.model()
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(100, int(model.config.vocab_size), (batch, context),
                            generator=g).tolist()
    per_row = -(-(context + ticks + 8) // 16)
    engines, handles = {}, {}
    for name in paths:
        if name == "hf":
            continue
        engines[name] = bench.engine(max_batch_size=batch, num_blocks=batch * per_row + 2,
                                     enable_prefix_caching=False, **PATHS[name][1])
        handles[name] = decoding(engines[name], prompts, ticks + 8)
    if "serve" in paths:
        for name, parts in (PARTS if batch <= Linear.PANEL_ROWS else LOOP).items():
            engines[name] = bench.engine(max_batch_size=batch, num_blocks=batch * per_row + 2,
                                         enable_prefix_caching=False, **PATHS["serve"][1])
            without_c_parts(engines[name], *parts)
            handles[name] = decoding(engines[name], prompts, ticks + 8)
    big = torch.ones(READ_FLOATS)
    a, b = torch.randn(GEMM, GEMM), torch.randn(GEMM, GEMM)
    sides = {"read": lambda: big.sum(), "matmul": lambda: torch.mm(a, b)}
    if "hf" in paths:
        sides["hf"] = BareDecoder(model, prompts).step
    with torch.inference_mode():
        times = medians_ms(decode_race(engines, ticks, warmup=2, rows=batch, **sides))
    for name, e in engines.items():
        drain(e, handles[name], close=True)
    times["read_gbs"] = READ_FLOATS * big.element_size() / times.pop("read") / 1e6
    times["gflops"] = 2 * GEMM ** 3 / times.pop("matmul") / 1e6
    return times


def against_floor(batch: int, floor: float, ms: dict[str, float], paths) -> list:
    """A table row: the batch, its floor, then each path's ms and multiple of the floor."""
    return [batch, f"{floor:.1f}", *(f"{ms[p]:.1f} ({ms[p] / floor:.2f}x)" for p in paths)]


@experiment("floor",
            option("--batch", type=at_least(1), nargs="+", default=[1, 8, 32],
                   help="rows decoding, one run each"),
            option("--context", type=at_least(1), default=128, help="tokens of history per row"),
            option("--ticks", type=at_least(1), default=8, help="rounds timed (after 2 of warm-up)"),
            option("--paths", nargs="+", default=[*PATHS, "hf"], choices=[*PATHS, "hf"],
                   help="the decode steps timed"),
            threads=serve_threads(), smallest=("--batch", "1", "--context", "8", "--ticks", "1"))
def floor(bench):
    """A decode step of each path against this machine's floor (memory or matmul bound)."""
    a = bench.args
    model, _ = bench.model()
    floors, steps, rates, parts, loops = [], [], [], [], []
    for B in a.batch:
        t = measure(bench, B, a.context, a.ticks, a.paths)
        cost = step_cost(model, B, a.context)
        f = floor_ms(cost, t["read_gbs"], t["gflops"])
        rates.append((t["read_gbs"], t["gflops"]))
        bound = "memory" if f["bandwidth"] >= f["compute"] else "compute"
        floors.append([B, f"{cost['weights_bytes'] / 1e6:.0f}", f"{cost['kv_bytes'] / 1e6:.0f}",
                       f"{cost['flops'] / 1e9:.2f}", f"{f['bandwidth']:.1f}",
                       f"{f['compute']:.1f}", f"**{f['floor']:.1f}** ({bound})"])
        steps.append(against_floor(B, f["floor"], t, a.paths))
        if "serve-rows" in t:
            parts.append(against_floor(B, f["floor"], t, (*PARTS, "serve")))
        if "serve-loop" in t:
            loops.append([*against_floor(B, f["floor"], t, (*LOOP, "serve")),
                          f"**{t['serve'] / t['serve-loop']:.2f}**"])
        print(floors[-1], steps[-1], *parts[-1:], *loops[-1:], flush=True)
        if B == 1 and "serve" in a.paths:
            bench.record({"floor.batch1_ms": round(f["floor"], 1),
                          "floor.serve_batch1_ratio": round(t["serve"] / f["floor"], 2)},
                         f".venv/bin/minserve bench floor --threads {a.threads}")
    names = {**{p: PATHS[p][0] for p in PATHS}, "hf": "HF static generate's step"}
    read = ", ".join(f"{r:.1f}" for r, _ in rates)
    gemm = ", ".join(f"{g:.0f}" for _, g in rates)
    bench.publish(f"floor-threads{a.threads}", [
        "## The floor: a decode step against what the machine allows", "",
        f"`.venv/bin/minserve bench floor --threads {a.threads}`: the embedded SmolLM2-135M, fp32, "
        f"B rows of {a.context} random tokens each (prefix caching off), {a.ticks} rounds "
        "of pure decode ticks, every path and both of the machine's rates interleaved, "
        f"medians. This machine, at {a.threads} thread(s): read {read} GB/s (a 256 MB "
        f"tensor summed), fp32 matmul {gemm} GFLOP/s (a {GEMM}^3 GEMM), one figure per "
        "batch size's run. floor = max(bytes / read rate, flops / matmul rate).", "",
        *md_table(["batch", "weights read (MB)", "KV read (MB)", "GFLOP", "memory floor (ms)",
                   "compute floor (ms)", "floor (ms)"], floors, "---:"), "",
        *md_table(["batch", "floor (ms)", *(f"{names[p]} (ms, x floor)" for p in a.paths)],
                  steps, "---:"),
        *(["", "The serve path, its C parts added one at a time (the same rounds):", "",
           *md_table(["batch", "floor (ms)", "every matmul in oneDNN, layers in Python (ms, "
                      "x floor)", "+ the matmuls in C", "+ the rest of each layer in C "
                      "(the serve path)"], parts, "---:")] if parts else []),
        *(["", "The serve path at more rows: its matmuls in oneDNN, and between them the "
           "layers' other work in Python or in C (`decode_rows`; the same rounds):", "",
           *md_table(["batch", "floor (ms)", "layers in Python (ms, x floor)", "C between "
                      "the matmuls (the serve path)", "C / Python"], loops, "---:")]
          if loops else [])])
