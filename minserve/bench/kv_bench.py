"""KV-cache benchmark: prefix caching, paged vs padded decode, padding waste.

    python -m minserve.bench.kv_bench                 # embedded SmolLM2, fp32, ~3 minutes

1. **TTFT with a shared 500-token system prompt**, prefix cache on vs off. The
   cache is warmed by one request, then `--ttft-requests` requests with the same
   system prompt and different questions run one at a time (so TTFT is pure
   queue-free prefill + first token).
2. **Decode tick time, paged vs padded**, at batch 8 and 32 with mixed prompt
   lengths (16..512 tokens): mean wall time of ticks that only decode.
3. **Bytes of KV per token**, and the **padding waste** of the padded backend:
   the share of its (B, L) KV that is left padding, averaged over decode ticks.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from .docs_report import machine_line, update_section

SYSTEM = ("You are a meticulous assistant for a public library. You answer questions about "
          "opening hours, borrowing rules, late fees, events, study rooms, printing, and the "
          "digital catalogue. Be brief, polite and precise; never invent a policy. ")
QUESTIONS = ["When do you open on Sunday?", "How many books can I borrow?",
             "Is there a fee for printing?", "Can I book a study room?",
             "Do you have e-books?", "What happens if I return a book late?"]


PAGED_NOTE = ("What a paged step does beyond a padded one: every layer gathers each row's "
              "history out of the pool, a whole block at a time (one `index_select` of "
              "block_size x head_dim floats per block and KV head, into a reused buffer, "
              "head-major so it feeds the per-head matmul without a transposing copy), where "
              "the padded backend appends one column in place to a contiguous cache; a fused "
              "PagedAttention kernel would read the blocks in place. Both compute attention "
              "over the longest row (paged: rounded up to whole blocks, masked). Until 2026-12 "
              "the paged tick cost 3.1x (batch 8) and 6.0x (batch 32) a padded one: K/V were "
              "gathered token-major, transposed (a copy) and repeated per query head (GQA, "
              "three more copies), and every large temporary was a fresh allocation; gathering "
              "token by token instead of block by block cost 14.6% of a mixed_batch serving "
              "run (1.6% by blocks, `python -m minserve.bench.tick_profile`). What paging buys "
              "is memory: nothing stored is padding, and equal prefixes share blocks.")


def _engine(model, tok, **cfg):
    from .. import Engine, EngineConfig

    cfg.setdefault("device", "cpu")
    return Engine(EngineConfig(**cfg), model=model, tokenizer=tok)


def ttft_prefix(model, tok, n: int, prefix_caching: bool) -> tuple[list[float], int]:
    from .. import SamplingParams

    sys_ids = tok(SYSTEM * 12, add_special_tokens=False)["input_ids"][:500]
    q = [tok(" Q: " + QUESTIONS[i % len(QUESTIONS)] + " A:", add_special_tokens=False)["input_ids"]
         for i in range(n)]
    engine = _engine(model, tok, max_batch_size=1, enable_prefix_caching=prefix_caching,
                     num_blocks=256)
    engine.generate([sys_ids + q[0]], SamplingParams(max_tokens=1))  # warm the cache
    ttfts, cached = [], 0
    for ids in q:
        out = engine.generate([sys_ids + ids], SamplingParams(max_tokens=1))[0]
        ttfts.append(out.timing["ttft"])
        cached = out.num_cached_tokens
    return ttfts, cached


def decode_ticks(model, tok, batch: int, new_tokens: int) -> tuple[float, float, float]:
    """(padded, paged) median decode-only tick seconds, and the padded KV's padding share.

    Both engines get the same prompts and are prefilled first; then their decode ticks
    alternate, padded, paged, padded, ... so that both see the same machine at the same
    moment (on a shared machine, speed drifts by tens of percent from one minute to the
    next; timing one backend after the other measured the drift, not the backends).
    """
    from .. import SamplingParams

    g = torch.Generator().manual_seed(batch)
    lengths = [int(x) for x in torch.randint(16, 512, (batch,), generator=g)]
    prompts = [[(7 * i + 3 * k) % 20000 + 100 for k in range(n)] for i, n in enumerate(lengths)]
    engines = {}
    for backend in ("padded", "paged"):
        engine = _engine(model, tok, max_batch_size=batch, backend=backend,
                         enable_prefix_caching=False, num_blocks=batch * 40)
        for p in prompts:
            engine.submit(p, SamplingParams(max_tokens=new_tokens + 8, ignore_eos=True))
        while len(engine.scheduler.active) < batch:  # admit + prefill everything
            engine.step()
        engine.step()  # one decode-only tick to warm up
        engines[backend] = engine
    times: dict[str, list[float]] = {"padded": [], "paged": []}
    waste = []
    for _ in range(new_tokens):
        for backend, engine in engines.items():
            rec = engine.step()
            assert len(rec.decode.rows) == batch and not rec.prefill.chunks
            times[backend].append(rec.duration_s)
            if "padding_tokens" in rec.backend:
                waste.append(rec.backend["padding_tokens"] / (batch * rec.backend["width"]))
    return (statistics.median(times["padded"]), statistics.median(times["paged"]),
            statistics.mean(waste) if waste else 0.0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ttft-requests", type=int, default=6)
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--no-docs", action="store_true")
    args = ap.parse_args(argv)
    from ..backends.kv_storage import KVBlockStorage
    from ..models import load_model

    model, tok = load_model(None, "float32", "cpu")
    on, cached = ttft_prefix(model, tok, args.ttft_requests, True)
    off, _ = ttft_prefix(model, tok, args.ttft_requests, False)
    p50_on, p50_off = statistics.median(on), statistics.median(off)
    print(f"TTFT, 500-token shared system prompt: cache on p50 {p50_on * 1e3:.0f} ms "
          f"({cached} tokens cached) | off p50 {p50_off * 1e3:.0f} ms | off/on {p50_off / p50_on:.1f}x")
    rows = []
    for b in args.batch:
        pad_t, pag_t, waste = decode_ticks(model, tok, b, args.new_tokens)
        rows.append((b, pad_t, pag_t, waste))
        print(f"batch {b}: decode tick padded {pad_t * 1e3:.0f} ms | paged {pag_t * 1e3:.0f} ms | "
              f"paged/padded {pag_t / pad_t:.2f} | padded KV that is padding {waste:.0%}")
    bpt = KVBlockStorage.for_model(model, 1, 16).bytes_per_token()
    cfg = model.config
    md = ["## KV cache: prefix caching, paged vs padded", "",
          "`python -m minserve.bench.kv_bench` — embedded SmolLM2-135M, fp32.", "",
          machine_line(), "",
          f"**TTFT with a shared 500-token system prompt** ({args.ttft_requests} requests, one at a "
          "time, after one warm-up request):", "",
          "| prefix cache | TTFT p50 | TTFT max | prompt tokens reused |", "|---|---:|---:|---:|",
          f"| on | {p50_on * 1e3:.0f} ms | {max(on) * 1e3:.0f} ms | {cached} |",
          f"| off | {p50_off * 1e3:.0f} ms | {max(off) * 1e3:.0f} ms | 0 |", "",
          f"Ratio off / on: **{p50_off / p50_on:.1f}x**.", "",
          f"**Decode tick time** (mixed prompt lengths 16–512, median of {args.new_tokens} "
          "decode-only ticks per backend, the two backends' ticks alternating):", "",
          "| batch | padded | paged | paged / padded | padded KV that is padding |",
          "|---:|---:|---:|---:|---:|"]
    md += [f"| {b} | {p * 1e3:.0f} ms | {q * 1e3:.0f} ms | {q / p:.2f} | {w:.0%} |"
           for b, p, q, w in rows]
    md += ["", f"**KV bytes per token**: {bpt:,} B = {cfg.num_hidden_layers} layers × 2 (K, V) × "
           f"{cfg.num_key_value_heads} KV heads × {bpt // (cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 4)}"
           " head dim × 4 B (fp32). GQA (3 KV heads for 9 query heads) already cuts it 3x.",
           "", PAGED_NOTE]
    if not args.no_docs:
        print("wrote", update_section("kv-cache", "\n".join(md)))


if __name__ == "__main__":
    main()
