"""The engine against Hugging Face `generate` on one static batch: quiet, then busy.

`decode-throughput`: for each batch size B, B prompts of mixed lengths, each generating
exactly `--new-tokens` tokens (EOS ignored on both sides, so the work is identical):
one `model.generate` call (left-padded, HF's static batch) against `Engine.generate`
with max_batch_size=B (padded backend, monolithic prefill), i.e. the same batch through
the scheduler, the per-row sampling and the streaming path. Tokens/s count generated
tokens over wall time, prefill included on both sides, each side's best of `--rounds`
interleaved rounds; the ratio is the figure to read.

`busy`: the same comparison on a small workload with `--hogs` CPU-bound processes
beside it, at 2 torch threads and at 1. Each of a tick's hundreds of small operators is
a parallel region whose threads meet at a barrier; when other processes hold the cores
one thread is often descheduled and the other waits at every barrier. With one thread
there is no barrier to wait at.
"""

from __future__ import annotations

import multiprocessing as mp
import time

from .registry import at_least, experiment, option
from .report import md_table

TEXT = ("The history of computing is a story of layers: transistors become gates, gates become "
        "adders, adders become processors, and processors run the programs that people write. "
        "Each layer hides the one below it, and each new layer makes new things possible. ")


def prompts_for(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """n prompts of mixed lengths (8..~200 tokens), deterministic."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = tokenizer(TEXT * 6, add_special_tokens=False)["input_ids"]
    out = []
    for _ in range(n):
        start = int(torch.randint(0, 40, (1,), generator=g))
        out.append(ids[start:start + int(torch.randint(8, 200, (1,), generator=g))])
    return out


def hf_generate_s(model, prompts: list[list[int]], new_tokens: int, pad: int = 0,
                  device: str = "cpu") -> float:
    """Seconds of one left-padded `generate` call running every prompt to `new_tokens`."""
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # (B, L)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    assert out.shape[1] - width == new_tokens
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


class TickTimes(list):
    """An `Engine.trace` for a timed run: per tick (decode rows, prefilled?, seconds), not
    the record. A record in step mode carries a copy of the queues and of every block of
    the pool (T6); kept for every tick of a 32-row batch (2,048 blocks), those copies made
    the run slower than `minserve serve`, which keeps none."""

    def append(self, rec) -> None:
        super().append((len(rec.decode.rows), bool(rec.prefill.chunks), rec.duration_s))


# what each path of decode-throughput runs (EngineConfig fields beside max_batch_size)
THROUGHPUT_PATHS = {
    "readable": ("padded backend (the default)", {}),
    "serve": ("paged + compact + C decode kernel (minserve serve's)",
              {"backend": "paged", "model_runner": "compact", "decode_attention": "kernel"}),
}


@experiment("decode-throughput",
            option("--batch", type=at_least(1), nargs="+", default=[8, 32],
                   help="batch sizes, one static batch each"),
            option("--new-tokens", type=at_least(3, "the first is the prefill's, and at least "
                                                  "one tick must decode alone"), default=64,
                   help="tokens each request generates"),
            option("--paths", nargs="+", default=list(THROUGHPUT_PATHS),
                   choices=list(THROUGHPUT_PATHS), help="engine paths, each beside HF"),
            option("--rounds", type=at_least(1), default=3,
                   help="rounds of HF and every path, interleaved; each side's best counts"),
            smallest=("--batch", "1", "--new-tokens", "3", "--rounds", "1"))
def decode_throughput(bench):
    """Decode throughput of the engine vs HF `generate`, one static batch each."""
    from .. import SamplingParams

    model, tok = bench.model()
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    n = bench.args.new_tokens
    hf_generate_s(model, prompts_for(tok, 2), 4, pad)  # warm-up

    def engine_run(path: str, prompts: list[list[int]]) -> tuple[float, str]:
        """(tok/s over the whole batch, tok/s of its decode-only ticks) of one run."""
        engine = bench.engine(max_batch_size=len(prompts), enable_prefix_caching=False,
                              **THROUGHPUT_PATHS[path][1])
        engine.trace = TickTimes()
        t0 = time.perf_counter()
        outs = engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
        tok_s = len(prompts) * n / (time.perf_counter() - t0)
        assert all(len(o.token_ids) == n for o in outs)
        if hasattr(engine.scheduler.backend, "close"):
            engine.scheduler.backend.close()
        dec = [(rows, s) for rows, prefilled, s in engine.trace if rows and not prefilled]
        return tok_s, (f"{sum(r for r, _ in dec) / sum(s for _, s in dec):.1f}"  # decode only
                       if dec else "–")  # (--new-tokens >= 3 leaves one; a gate could still not)

    rows = []
    for b in bench.args.batch:
        prompts = prompts_for(tok, b, seed=b)
        # Rounds of HF then every path, interleaved so that the machine's drift falls on
        # all of them; each side's best round counts (on a quiet machine one round's
        # ratio moved by up to 15 % from the next).
        best: dict[str, tuple[float, str]] = {}
        for _ in range(bench.args.rounds):
            runs = {"hf": (b * n / hf_generate_s(model, prompts, n, pad), "")}
            runs.update({path: engine_run(path, prompts) for path in bench.args.paths})
            best = {k: max(v, best.get(k, v), key=lambda r: r[0]) for k, v in runs.items()}
        hf = best["hf"][0]
        row = [b, f"{hf:.1f}"]
        for path in bench.args.paths:
            tok_s, dec = best[path]
            row += [f"{tok_s:.1f}", dec, f"**{tok_s / hf:.2f}**"]
        rows.append(row)
        print(rows[-1], flush=True)
    threads = f" --threads {bench.args.threads}" if bench.args.threads else ""
    paths = "; ".join(f"{p}: {THROUGHPUT_PATHS[p][0]}" for p in bench.args.paths)
    bench.publish("core-throughput", [
        "## Engine core: decode throughput vs HF `generate`", "",
        f"`.venv/bin/minserve bench decode-throughput{threads}` — embedded SmolLM2-135M, fp32, {n} new "
        "tokens per request (EOS ignored), mixed prompt lengths 8–200, monolithic prefill, "
        f"one static batch on both sides, prefill included, the best of "
        f"{bench.args.rounds} interleaved round(s) each. Paths: {paths}.", "",
        *md_table(["batch", "HF generate tok/s", *(h for p in bench.args.paths for h in (
            f"{p} tok/s", f"{p} decode ticks tok/s", f"{p} / HF"))], rows, "---:")])


def _hog(stop) -> None:  # a CPU-bound neighbour
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


@experiment("busy", option("--hogs", type=at_least(0), nargs="+", default=[0, 6],
                           help="busy-loop processes to run beside the measurement"),
            option("--thread-counts", type=at_least(1), nargs="+", default=[2, 1],
                   help="torch threads"),
            smallest=("--hogs", "0", "--thread-counts", "1"))
def busy(bench):
    """minserve and HF `generate` with CPU-bound neighbours, at 2 and 1 torch threads."""
    import torch

    from .. import SamplingParams

    model, _ = bench.model()
    prompts = [[(13 * i + 7 * k) % 20000 + 100 for k in range(64)] for i in range(16)]

    def tok_s(threads: int) -> tuple[float, float]:
        torch.set_num_threads(threads)
        engine = bench.engine(max_batch_size=8, enable_prefix_caching=False)
        t = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
        ms = time.perf_counter() - t
        hf = sum(hf_generate_s(model, prompts[i:i + 8], 32) for i in (0, 8))  # 2 batches of 8
        return 16 * 32 / ms, 16 * 32 / hf

    tok_s(bench.args.thread_counts[0])  # warm-up
    rows = []
    for hogs in bench.args.hogs:
        stop = mp.Event()
        procs = [mp.Process(target=_hog, args=(stop,), daemon=True) for _ in range(hogs)]
        for p in procs:
            p.start()
        try:
            for threads in bench.args.thread_counts:
                ms, hf = tok_s(threads)
                rows.append([hogs, threads, f"{ms:.1f}", f"{hf:.1f}", f"**{ms / hf:.2f}x**"])
                print(rows[-1], flush=True)
        finally:
            stop.set()
            for p in procs:
                p.join(5)
    torch.set_num_threads(bench.conditions.threads)  # the conditions line reports the default
    bench.publish("busy-machine", [
        "### On a busy machine: torch threads", "",
        "16 requests (64-token prompts, 32 new tokens, EOS ignored), batch 8: minserve "
        "(padded, monolithic, step mode) and HF `generate` in two static batches, with "
        "CPU-bound busy-loop processes beside them. `minserve bench busy` (one run each):", "",
        *md_table(["busy neighbours", "torch threads", "minserve tok/s", "HF generate tok/s",
                   "minserve / HF"], rows)])
