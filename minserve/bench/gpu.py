"""On a GPU: output tokens per second of HF's two ways and minserve's paths, and how busy
the GPU is during one decode tick (SPEC D5; docs/benchmarks.md, "On a GPU").

    minserve bench gpu --device cuda              # both shapes, ~10 min on an H200
    minserve bench gpu --device cpu --quick       # a smoke run of this file, any machine

(`python -m minserve.bench gpu ...` is the same command without the server's imports.)

Random weights of named shapes (the embedded model's GGUF need not travel to the GPU
machine): SmolLM2-135M's and Llama-3.2-1B's, the output head scaled as `models.tiny_llama`
does so greedy choices have clear margins. One workload: `--requests` prompts of 64-512
random tokens, 64-256 output tokens each (EOS ignored), at most `--batch` rows, bfloat16.

    HF static generate        batches of `--batch` in arrival order, left-padded; each
                              batch runs to its longest request (only asked tokens count)
    HF continuous batching    `init_continuous_batching`, what `generate_batch` wraps
    minserve padded           backend="padded", chunks of 512
    minserve paged            backend="paged", mixed_batch
    minserve compact          + model_runner="compact"
    minserve compact+graphs   + cuda_graphs="auto": the decode step replayed per bucket

Then the GPU-busy share of a decode tick at `--batch` rows (`torch.profiler`: device time
over wall time, 20 ticks), for the compact path with graphs and without, and the padded
path: how much of each tick the GPU works, and how many kernel launches and host
synchronisations a tick makes.
"""

from __future__ import annotations

import json
import math
import random
import time
import traceback
from functools import partial
from pathlib import Path

import torch
from torch.autograd import DeviceType

from .registry import at_least, experiment, option
from .report import md_table
from .throughput import hf_generate_s

SHAPES = {
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=8192, rope_theta=100000.0),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=8192, rope_theta=500000.0),
}
PATHS = {
    "minserve padded": dict(backend="padded", prefill_chunk_size=512),
    "minserve paged": dict(backend="paged", prefill_mode="mixed_batch", prefill_chunk_size=512),
    "minserve compact": dict(backend="paged", prefill_mode="mixed_batch", prefill_chunk_size=512,
                             model_runner="compact"),
    "minserve compact+graphs": dict(backend="paged", prefill_mode="mixed_batch",
                                    prefill_chunk_size=512, model_runner="compact",
                                    cuda_graphs="auto"),
}
PROFILED = ("minserve compact+graphs", "minserve compact", "minserve padded")
PROFILE_KEYS = ("wall_ms", "gpu_busy_ms", "gpu_busy_share", "launches_per_tick", "syncs_per_tick")


def model_of(shape: str, dtype: str, device: str, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SHAPES[shape], tie_word_embeddings=False, bos_token_id=None,
                      pad_token_id=None, eos_token_id=None, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(getattr(torch, dtype)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)  # clear margins, as models.tiny_llama
    return model


def workload(vocab: int, n: int, quick: bool, seed: int = 11):
    rng = random.Random(seed)
    lo, hi, outs = (8, 40, (4, 8, 12)) if quick else (64, 512, (64, 96, 128, 192, 256))
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    return prompts, [rng.choice(outs) for _ in range(n)]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hf_static(model, prompts, maxt, batch: int, device: str) -> float:
    """Tokens per second of `generate` over batches in arrival order (only asked tokens)."""
    hf_generate_s(model, prompts[:1], 2, device=device)  # warm-up
    return sum(maxt) / sum(hf_generate_s(model, prompts[s:s + batch], max(maxt[s:s + batch]),
                                         device=device) for s in range(0, len(prompts), batch))


def hf_continuous(model, prompts, maxt, batch: int, device: str) -> float:
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    longest = max(len(p) + m for p, m in zip(prompts, maxt))
    cb = ContinuousBatchingConfig(page_size=32, num_blocks=len(prompts) * math.ceil(longest / 32) + 8,
                                  max_batch_tokens=2048, max_requests_per_batch=batch, seed=0)
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(maxt), eos_token_id=None,
                           pad_token_id=0)
    mgr = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    try:
        mgr.warmup()
        mgr.start()
        _sync(device)
        t = time.perf_counter()
        for j, (p, m) in enumerate(zip(prompts, maxt)):
            mgr.add_request(list(p), request_id=f"r{j}", max_new_tokens=m)
        got = n = 0
        while got < len(prompts):
            r = mgr.get_result(timeout=120)  # a stall must not eat the GPU's lent minutes
            if r is None:
                raise RuntimeError("HF continuous batching returned nothing for 120 s")
            if r.is_finished():
                got, n = got + 1, n + len(r.generated_tokens)
        _sync(device)
        dt = time.perf_counter() - t
    finally:
        # Stopped whatever happened: its generation thread would otherwise go on using the
        # GPU (and the model, which it may have switched to another attention) while
        # minserve's paths run and capture their CUDA graphs.
        mgr.stop(block=True, timeout=30, hard_stop=True)
    return n / dt


def minserve_path(model, prompts, maxt, batch: int, device: str, *, dtype: str, cfg: dict) -> float:
    from .. import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(device=device, dtype=dtype, max_batch_size=batch, **cfg),
                    model=model)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in maxt]
    graphs = getattr(engine.scheduler.backend, "graphs", None)
    if graphs is not None:  # every graph this workload can meet, before the clock starts
        graphs.capture_all(max(len(p) + m for p, m in zip(prompts, maxt)))
    engine.generate(prompts[:batch], params[:batch])  # warm-up
    _sync(device)
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    _sync(device)
    dt = time.perf_counter() - t
    n = sum(len(o.token_ids) for o in outs)
    assert n == sum(maxt), (n, sum(maxt))
    return n / dt


def profile_tick(model, batch: int, device: str, dtype: str, cfg: dict, vocab: int,
                 ticks: int = 20) -> dict:
    """One decode tick at `batch` rows under torch.profiler: wall vs device-busy time, kernel
    launches and host synchronisations per tick."""

    from torch.profiler import ProfilerActivity, profile

    from .. import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(device=device, dtype=dtype, max_batch_size=batch, **cfg),
                    model=model)
    rng = random.Random(1)
    for _ in range(batch):
        engine.submit([rng.randrange(1, vocab) for _ in range(128)],
                      SamplingParams(max_tokens=ticks + 40, ignore_eos=True))
    for _ in range(12):  # prefill done, decode steady (and its graphs captured)
        engine.step()
    assert len(engine.scheduler.active) == batch, "not every row decodes yet"
    on_gpu = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    _sync(device)
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        for _ in range(ticks):
            engine.step()
        _sync(device)
        wall = (time.perf_counter() - t) / ticks
    return tick_figures(prof.events(), ticks, wall, on_gpu) | {
        "tok_per_s_at_batch": round(batch / wall, 1)}


def tick_figures(events, ticks: int, wall_s: float, on_gpu: bool) -> dict:
    """Per tick, from a profile of `ticks` ticks (`prof.events()`): wall time, the time the
    GPU was busy and its share of the wall, CPU-side kernel launches and host syncs.

    Busy time is the union of the device's own events (kernels, copies, memsets) in time,
    so a kernel counts once however it is reported, and two that overlap (two streams)
    count once too. Not a sum of `key_averages()`' `self_device_time_total`: with the
    kineto profiler a CPU operator carries its kernels' device time (`append_kernel` in
    torch/autograd/profiler.py, `_parse_kineto_results`) AND each kernel is an event of
    its own, so that sum counts every kernel at least twice (torch's own table,
    `_build_table` in torch/autograd/profiler_util.py, sums only the device events)."""
    busy = busy_us(device_intervals(events)) / 1e6 / ticks if on_gpu else None
    names = [e.name for e in events if e.device_type == DeviceType.CPU]
    return {"wall_ms": round(wall_s * 1e3, 2),
            "gpu_busy_ms": None if busy is None else round(busy * 1e3, 2),
            "gpu_busy_share": None if busy is None else round(busy / wall_s, 3),
            "launches_per_tick": round(sum(map(is_launch, names)) / ticks, 1),
            "syncs_per_tick": round(sum(map(is_sync, names)) / ticks, 1)}


def device_intervals(events) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every event the device itself ran: not the CPU's
    operators and runtime calls, not user annotations (a `record_function` range shown
    on the GPU's timeline spans its kernels and the gaps between them)."""
    return [(e.time_range.start, e.time_range.end) for e in events
            if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)]


def busy_us(intervals) -> float:
    """Length of the union of (start, end) intervals: the time at least one of them runs."""
    total, reached = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reached:
            total += end - max(start, reached)
            reached = end
    return total


def is_launch(name: str) -> bool:
    """A CPU-side kernel launch, as CUPTI names it: the runtime's `cudaLaunchKernel` (and
    `cudaLaunchKernelExC`), the driver's `cuLaunchKernel` / `cuLaunchKernelEx` (cuBLAS,
    Triton), a graph's one launch (`cudaGraphLaunch`)."""
    return name.startswith("cu") and ("LaunchKernel" in name or "GraphLaunch" in name)


def is_sync(name: str) -> bool:
    """A host wait for the device: `cudaStreamSynchronize` (what `.item()`, `.tolist()`
    and a copy to pageable memory call), `cudaDeviceSynchronize`, `cudaEventSynchronize`."""
    return name.startswith("cu") and "Synchronize" in name


def run(shapes, device: str, dtype: str, requests: int, batch: int, quick: bool) -> dict:
    out = {"device": device, "dtype": dtype, "torch": torch.__version__, "requests": requests,
           "batch": batch, "shapes": {}}
    if device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name(0)
    for shape in shapes:
        model = model_of(shape, dtype, device)
        vocab = model.config.vocab_size
        prompts, maxt = workload(vocab, requests, quick)
        row = out["shapes"][shape] = {}
        for name, fn in (("HF static generate", hf_static), ("HF continuous batching", hf_continuous),
                         *((name, partial(minserve_path, dtype=dtype, cfg=cfg))
                           for name, cfg in PATHS.items())):
            # one path failing (on a lent GPU, a first run) leaves the others' figures
            row[name] = attempt(fn, model, prompts, maxt, batch, device)
            if isinstance(row[name], float):
                row[name] = round(row[name], 1)
            print(f"[{shape}] {name}: {row[name]}", flush=True)
        row["profile"] = {name: attempt(profile_tick, model, batch, device, dtype, PATHS[name],
                                        vocab, ticks=4 if quick else 20) for name in PROFILED}
        print(f"[{shape}] profile: {json.dumps(row['profile'])}", flush=True)
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out


def attempt(fn, *args, **kwargs):
    """fn(*args, **kwargs), or what it raised as a string (its traceback printed)."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        traceback.print_exc()
        return f"error: {type(e).__name__}: {e}"[:200]


def markdown(res: dict) -> str:
    shapes = list(res["shapes"])
    return "\n".join([
        f"{res.get('gpu', res['device'])}, torch {res['torch']}, {res['dtype']}, "
        f"{res['requests']} requests, at most {res['batch']} rows. Output tokens/s:", "",
        *md_table(["", *shapes], [[n, *(res["shapes"][s].get(n) for s in shapes)] for n in
                                  ("HF static generate", "HF continuous batching", *PATHS)]), "",
        f"One decode tick at {res['batch']} rows (torch.profiler, 20 ticks):", "",
        *md_table(["shape", "path", "wall ms", "GPU busy ms", "busy share", "launches",
                   "host syncs"], [[s, n, *((p.get(k) for k in PROFILE_KEYS) if isinstance(p, dict)
                                           else [p])]
                                   for s in shapes for n, p in res["shapes"][s]["profile"].items()])])


@experiment("gpu", option("--device", default="cuda", help="where the models run"),
            option("--dtype", default=None, help="default: bfloat16 on CUDA, float32 elsewhere"),
            option("--shapes", nargs="+", default=None, choices=list(SHAPES),
                   help="model shapes (default: tiny with --quick or --tiny, else "
                        "smollm2-135m and llama-3.2-1b)"),
            option("--requests", type=at_least(1), default=None,
                   help="requests (default: 8 with --quick, else 128)"),
            option("--batch", type=at_least(1), default=None,
                   help="rows at most (default: 4 with --quick, else 64)"),
            option("--quick", action="store_true",
                   help="a smoke run: tiny shape, few tokens (default: the full run)"),
            option("--out", default=None,
                   help="write gpu.json and gpu.md into this folder (default: print only)"),
            smallest=("--device", "cpu", "--quick", "--requests", "2", "--batch", "2"))
def gpu(bench):
    """On a GPU: HF's two ways and minserve's paths, tokens/s, and a decode tick profiled."""
    a = bench.args
    dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    a.quick = a.quick or a.tiny  # its own tiny shape (SHAPES), never the embedded model
    shapes = a.shapes or (["tiny"] if a.quick else ["smollm2-135m", "llama-3.2-1b"])
    res = run(shapes, a.device, dtype, a.requests or (8 if a.quick else 128),
              a.batch or (4 if a.quick else 64), a.quick)
    res["conditions"] = bench.conditions.as_dict()
    md = markdown(res) + "\n\n" + bench.conditions.line()
    print(md)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "gpu.json").write_text(json.dumps(res, indent=1))
        (Path(a.out) / "gpu.md").write_text(md + "\n")
