"""The KV cache: prefix caching's TTFT, paged vs padded decode ticks, bytes per token.

1. TTFT with a shared 500-token system prompt, prefix cache on vs off: one request warms
   the cache, then `--ttft-requests` requests with the same system prompt and different
   questions run one at a time (TTFT is queue-free prefill + first token).
2. Decode tick time, paged vs padded, at each `--batch` with prompts of 16..512 tokens:
   both engines prefilled first, then their decode-only ticks interleaved (timing.py).
3. KV bytes per token, and the padding waste of the padded backend: the share of its
   (B, L) KV that is left padding, averaged over the decode ticks.
"""

from __future__ import annotations

import statistics

from .registry import at_least, experiment, option
from .report import md_table
from .timing import decode_race, decoding

SYSTEM = ("You are a meticulous assistant for a public library. You answer questions about "
          "opening hours, borrowing rules, late fees, events, study rooms, printing, and the "
          "digital catalogue. Be brief, polite and precise; never invent a policy. ")
QUESTIONS = ["When do you open on Sunday?", "How many books can I borrow?",
             "Is there a fee for printing?", "Can I book a study room?",
             "Do you have e-books?", "What happens if I return a book late?"]


def ttft_prefix(bench, n: int, prefix_caching: bool) -> tuple[list[float], int]:
    from .. import SamplingParams

    _, tok = bench.model()
    sys_ids = tok(SYSTEM * 12, add_special_tokens=False)["input_ids"][:500]
    qs = [tok(" Q: " + QUESTIONS[i % len(QUESTIONS)] + " A:", add_special_tokens=False)["input_ids"]
          for i in range(n)]
    engine = bench.engine(max_batch_size=1, enable_prefix_caching=prefix_caching, num_blocks=256)
    engine.generate([sys_ids + qs[0]], SamplingParams(max_tokens=1))  # warm the cache
    outs = [engine.generate([sys_ids + q], SamplingParams(max_tokens=1))[0] for q in qs]
    return [o.timing["ttft"] for o in outs], outs[-1].num_cached_tokens


def decode_ticks(bench, batch: int, ticks: int) -> tuple[float, float, float]:
    """(padded, paged) median decode-only tick seconds, and the padded KV's padding share."""
    import torch

    g = torch.Generator().manual_seed(batch)
    lengths = [int(x) for x in torch.randint(16, 512, (batch,), generator=g)]
    prompts = [[(7 * i + 3 * k) % 20000 + 100 for k in range(n)] for i, n in enumerate(lengths)]
    engines, waste = {}, []
    for backend in ("padded", "paged"):
        engines[backend] = bench.engine(max_batch_size=batch, backend=backend,
                                        enable_prefix_caching=False, num_blocks=batch * 40)
        decoding(engines[backend], prompts, ticks + 8)  # admit + prefill everything

    def seen(_, rec) -> None:
        if "padding_tokens" in rec.backend:
            waste.append(rec.backend["padding_tokens"] / (batch * rec.backend["width"]))

    times = decode_race(engines, ticks, rows=batch, seen=seen)
    return (statistics.median(times["padded"]), statistics.median(times["paged"]),
            statistics.mean(waste) if waste else 0.0)


@experiment("kv-cache", option("--ttft-requests", type=at_least(1), default=6,
                               help="requests timed with the shared system prompt"),
            option("--batch", type=at_least(1), nargs="+", default=[8, 32],
                   help="decode batch sizes, paged against padded"),
            option("--new-tokens", type=at_least(1), default=16,
                   help="decode ticks timed per backend"),
            smallest=("--ttft-requests", "1", "--batch", "1", "--new-tokens", "1"))
def kv_cache(bench):
    """Prefix caching's TTFT; paged vs padded decode ticks; KV bytes per token."""
    from ..backends.kv_storage import KVBlockStorage

    a = bench.args
    on, cached = ttft_prefix(bench, a.ttft_requests, True)
    off, _ = ttft_prefix(bench, a.ttft_requests, False)
    p50_on, p50_off = statistics.median(on), statistics.median(off)
    rows = []
    for b in a.batch:
        pad, paged, waste = decode_ticks(bench, b, a.new_tokens)
        rows.append([b, f"{pad * 1e3:.0f} ms", f"{paged * 1e3:.0f} ms", f"{paged / pad:.2f}",
                     f"{waste:.0%}"])
        print(rows[-1], flush=True)
    model, _ = bench.model()
    bpt, cfg = KVBlockStorage.for_model(model, 1, 16).bytes_per_token(), model.config
    head_dim = bpt // (cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 4)
    bench.publish("kv-cache", [
        "## KV cache: prefix caching, paged vs padded", "",
        "`minserve bench kv-cache` — embedded SmolLM2-135M, fp32.", "",
        f"**TTFT with a shared 500-token system prompt** ({a.ttft_requests} requests, one at a "
        "time, after one warm-up request):", "",
        *md_table(["prefix cache", "TTFT p50", "TTFT max", "prompt tokens reused"],
                  [["on", f"{p50_on * 1e3:.0f} ms", f"{max(on) * 1e3:.0f} ms", cached],
                   ["off", f"{p50_off * 1e3:.0f} ms", f"{max(off) * 1e3:.0f} ms", 0]], "---:"),
        "", f"Ratio off / on: **{p50_off / p50_on:.1f}x**.", "",
        f"**Decode tick time** (mixed prompt lengths 16–512, median of {a.new_tokens} "
        "decode-only ticks per backend, the two backends' ticks interleaved):", "",
        *md_table(["batch", "padded", "paged", "paged / padded", "padded KV that is padding"],
                  rows, "---:"), "",
        f"**KV bytes per token**: {bpt:,} B = {cfg.num_hidden_layers} layers × 2 (K, V) × "
        f"{cfg.num_key_value_heads} KV heads × {head_dim} head dim × 4 B (fp32). GQA (3 KV "
        "heads for 9 query heads) already cuts it 3x."])
