"""minserve and HF `generate` on a busy machine: what other processes on the cores cost.

    python -m minserve.bench.busy               # ~4 min on 2 cores; writes docs/benchmarks.md
    python -m minserve.bench.busy --hogs 0 6    # quiet, then six CPU-bound processes beside it

The same small workload (16 requests, 64-token prompts, 32 new tokens each, EOS
ignored, batch 8) through minserve's engine (step mode, padded, monolithic) and
through Hugging Face `generate` in two static batches of 8, with `--hogs` busy-loop
processes running beside them, and torch's intra-op threads at 2 (the default here:
one per core) and at 1.

Why threads matter under load: each of the hundreds of small ops in a decode tick is a
parallel region whose threads meet at a barrier. When other processes hold the cores,
one of the two threads is often descheduled, and the other waits (spinning, then
sleeping) for a scheduler time slice at every barrier. A tick of many small ops pays
that wait hundreds of times; one big batched call pays it less. With one thread there
is no barrier to wait at.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

from .docs_report import machine_line, publish


def _hog(stop) -> None:  # a CPU-bound neighbour
    os.nice(0)
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def _run(model, tokenizer, threads: int) -> dict:
    import torch

    from .. import Engine, EngineConfig, SamplingParams

    torch.set_num_threads(threads)
    prompts = [[(13 * i + 7 * k) % 20000 + 100 for k in range(64)] for i in range(16)]
    engine = Engine(EngineConfig(device="cpu", max_batch_size=8, enable_prefix_caching=False),
                    model=model, tokenizer=tokenizer)
    t = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    ms = time.perf_counter() - t
    t = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, 16, 8):  # two static batches of 8 (equal lengths: no padding)
            model.generate(torch.tensor(prompts[i:i + 8]), max_new_tokens=32, min_new_tokens=32,
                           do_sample=False, pad_token_id=0)
    hf = time.perf_counter() - t
    return {"threads": threads, "minserve_tok_s": 16 * 32 / ms, "hf_tok_s": 16 * 32 / hf}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hogs", type=int, nargs="+", default=[0, 6],
                   help="busy-loop processes to run beside the measurement")
    p.add_argument("--threads", type=int, nargs="+", default=[2, 1], help="torch threads")
    p.add_argument("--no-docs", action="store_true", help="print only; leave docs/benchmarks.md")
    args = p.parse_args(argv)
    import torch

    from ..models import load_model

    model, tokenizer = load_model(None, "float32", "cpu")
    default_threads = torch.get_num_threads()
    _run(model, tokenizer, 2)  # warm-up
    rows = ["| busy neighbours | torch threads | minserve tok/s | HF generate tok/s | minserve / HF |",
            "|---|---|---|---|---|"]
    for hogs in args.hogs:
        stop = mp.Event()
        procs = [mp.Process(target=_hog, args=(stop,), daemon=True) for _ in range(hogs)]
        for pr in procs:
            pr.start()
        try:
            for threads in args.threads:
                r = _run(model, tokenizer, threads)
                rows.append(f"| {hogs} | {threads} | {r['minserve_tok_s']:.1f} | "
                            f"{r['hf_tok_s']:.1f} | **{r['minserve_tok_s'] / r['hf_tok_s']:.2f}x** |")
                print(rows[-1], flush=True)
        finally:
            stop.set()
            for pr in procs:
                pr.join(5)
    torch.set_num_threads(default_threads)  # the machine line reports the default
    md = "\n".join([
        "### On a busy machine: torch threads", "",
        "16 requests (64-token prompts, 32 new tokens, EOS ignored), batch 8: minserve "
        "(padded, monolithic, step mode) and HF `generate` in two static batches, with "
        "CPU-bound busy-loop processes beside them. `python -m minserve.bench.busy` "
        "(one run each):", "", *rows, "", machine_line()])
    publish("busy-machine", md, write=not args.no_docs)


if __name__ == "__main__":
    main()
