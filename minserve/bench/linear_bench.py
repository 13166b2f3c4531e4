"""Linear layers: PyTorch's `F.linear` against the compact forward's prepacked `Linear`.

    python -m minserve.bench.linear_bench                 # batch 1..64, 1 thread; ~1 min
    python -m minserve.bench.linear_bench --threads 2 --no-docs

Every weight matmul of one SmolLM2-135M decode forward at batch B (each layer's fused
qkv, o, gate_up and down, and the output head), done two ways on the same weights:
`F.linear` (PyTorch's default CPU matmul, what HF's `nn.Linear` calls) and
`compact.Linear` (oneDNN's linear op on a weight reordered once into its blocked
layout). Interleaved, medians of `--rounds`; the ratio is the figure to quote. This is
the floor under a decode tick: the compact forward spends the rest on attention and
elementwise work (`compact_bench`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from .docs_report import machine_line, publish


def weight_pairs(runner) -> list[tuple[torch.Tensor, object]]:
    """(plain weight, prepacked Linear) for every linear layer of one forward."""
    plain = []
    for w in runner.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            plain.append(w[name])
    plain.append(runner.head)
    # the prepacked Linear drops its plain copy; rebuild it from the packed one
    return [(lin.packed.to_dense() if lin.packed is not None else lin.weight, lin)
            for lin in plain]


@torch.inference_mode()
def measure(runner, B: int, rounds: int) -> dict[str, float]:
    pairs = weight_pairs(runner)
    inputs = {shape[1]: torch.randn(B, shape[1]) for shape in (lin.shape for _, lin in pairs)}

    def plain() -> None:
        for w, lin in pairs:
            F.linear(inputs[lin.shape[1]], w)

    def packed() -> None:
        for _, lin in pairs:
            lin(inputs[lin.shape[1]])

    times: dict[str, list[float]] = {"F.linear": [], "prepacked": []}
    for k in range(rounds + 1):
        for name, fn in (("F.linear", plain), ("prepacked", packed))[::1 if k % 2 else -1]:
            t = time.perf_counter()
            fn()
            if k:  # the first round warms both up
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) * 1e3 for name, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--no-docs", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from ..fast.compact import CompactLlama
    from ..models import load_model

    model, _ = load_model(None, "float32", "cpu")
    runner = CompactLlama(model, max_model_len=64)
    rows = ["| batch | `F.linear` (ms) | prepacked `compact.Linear` (ms) | F.linear / prepacked |",
            "|---|---|---|---|"]
    for B in args.batch:
        r = measure(runner, B, args.rounds)
        rows.append(f"| {B} | {r['F.linear']:.1f} | {r['prepacked']:.1f} | "
                    f"{r['F.linear'] / r['prepacked']:.2f}x |")
        print(rows[-1], flush=True)
    md = "\n".join([
        "## Linear layers: `F.linear` vs prepacked oneDNN", "",
        f"`python -m minserve.bench.linear_bench --threads {args.threads}`: every weight "
        "matmul of one SmolLM2-135M decode forward at batch B (30 layers' fused qkv, o, "
        "gate_up, down, and the output head; fp32), done with PyTorch's `F.linear` and "
        "with the compact forward's `Linear` (oneDNN, weight reordered once), interleaved, "
        f"medians of {args.rounds} rounds. The compact forward runs the second; HF's model "
        "runs the first.", "", *rows, "", machine_line()])
    publish(f"linear-layers-threads{args.threads}", md, write=not args.no_docs)


if __name__ == "__main__":
    main()
