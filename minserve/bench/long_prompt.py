"""One long prompt, one user already streaming: how long does the stream stall?

    python -m minserve.bench.long_prompt             # ~2 min on 2 cores; writes docs/benchmarks.md
    python -m minserve.bench.long_prompt --prompt-tokens 2000 --no-docs

The embedded SmolLM2, fp32, batch 8. A short chat streams 48 tokens; two ticks in,
a document of `--prompt-tokens` tokens arrives. For each prefill setting we record
the stream's worst gap between two tokens (the stall: the tick that carries the
prefill), how long its 48 tokens took, and the long request's time to first token. Monolithic
prefill pushes the whole document in one tick; chunked prefill (C1) pushes one
chunk per tick, so the stall is one chunk's worth whatever the document's length,
and the document's first token comes a little later. This is why `minserve serve`
and the chat demo default to chunked prefill (`SERVING_DEFAULTS`).
"""

from __future__ import annotations

import argparse
import time

from .docs_report import machine_line, publish

STREAM = [{"role": "user", "content": "Count slowly from one to fifty, one number per line."}]


def stall(model, tokenizer, prefill_chunk_size: int, prompt_tokens: int,
          mixed: bool = False) -> dict:
    """Step the engine by hand (no worker thread), timing every token of the stream.
    `mixed`: Version B (`mixed_batch` on the paged backend), else Version A / monolithic
    on the padded backend."""
    from .. import Engine, EngineConfig, SamplingParams

    extra = {"backend": "paged", "prefill_mode": "mixed_batch"} if mixed else {}
    engine = Engine(EngineConfig(device="cpu", max_batch_size=8, max_model_len=8192,
                                 prefill_chunk_size=prefill_chunk_size,
                                 enable_prefix_caching=False, **extra),
                    model=model, tokenizer=tokenizer)
    doc_ids = [(37 * k) % 4000 + 100 for k in range(prompt_tokens)]  # no chat template
    stream = engine.submit(STREAM, SamplingParams(max_tokens=48, ignore_eos=True))
    long = None
    seen, stamps, long_t0, long_ttft = 0, [], 0.0, None
    while not (stream.finished and (long is None or long.finished)):
        if long is None and len(stamps) >= 2:
            long = engine.submit(doc_ids, SamplingParams(max_tokens=4, ignore_eos=True))
            long_t0 = time.perf_counter()
        engine.step()
        now = time.perf_counter()
        n = sum(ev.token_id is not None for ev in stream.events)
        stamps += [now] * (n - seen)
        seen = n
        if long is not None and long_ttft is None and long.events:
            long_ttft = now - long_t0
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"chunk": prefill_chunk_size, "mixed": mixed, "max_gap_s": max(gaps),
            "stream_s": stamps[-1] - stamps[0], "long_ttft_s": long_ttft}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=6000, help="the long prompt's length")
    p.add_argument("--chunks", type=int, nargs="+", default=[0, 512, 256, 128],
                   help="prefill_chunk_size values to compare (0: monolithic), padded backend")
    p.add_argument("--mixed-chunks", type=int, nargs="*", default=[256],
                   help="chunk sizes to run as mixed_batch (Version B) on the paged backend")
    p.add_argument("--no-docs", action="store_true", help="print only; leave docs/benchmarks.md")
    args = p.parse_args(argv)
    import torch

    from ..models import load_model

    torch.manual_seed(0)
    model, tokenizer = load_model(None, "float32", "cpu")
    runs = [stall(model, tokenizer, c, args.prompt_tokens) for c in args.chunks]
    runs += [stall(model, tokenizer, c, args.prompt_tokens, mixed=True) for c in args.mixed_chunks]
    rows = ["| prefill | stream's worst gap | stream's 48 tokens took | long prompt's first token |",
            "|---|---|---|---|"]
    for r in runs:
        name = ("monolithic" if r["chunk"] == 0 else
                f"mixed_batch (paged), {r['chunk']} tokens" if r["mixed"] else
                f"chunked, {r['chunk']} tokens")
        rows.append(f"| {name} | **{r['max_gap_s']:.2f} s** | {r['stream_s']:.1f} s | "
                    f"{r['long_ttft_s']:.1f} s |")
    md = "\n".join([
        "### One long prompt beside a streaming user",
        "",
        f"A chat streams 48 tokens; two tokens in, a {args.prompt_tokens:,}-token document "
        "arrives (embedded SmolLM2, fp32, batch 8, stepped by hand). The stream's worst gap "
        "between two tokens is the stall the document's prefill causes; its first token "
        "is timed from its arrival. "
        f"`python -m minserve.bench.long_prompt --prompt-tokens {args.prompt_tokens}` "
        "(one run each):", "", *rows, "", machine_line()])
    publish("long-prompt-stall", md, write=not args.no_docs)
    if not args.no_docs:  # the figures other pages quote (docs/http_api.md), in one place
        from .figures import record

        record({(f"long_prompt.{'mixed' if r['mixed'] else 'chunked'}_{r['chunk']}_gap_s"
                 if r["chunk"] else "long_prompt.monolithic_gap_s"): round(r["max_gap_s"], 2)
                for r in runs},
               source=f"python -m minserve.bench.long_prompt --prompt-tokens {args.prompt_tokens}")


if __name__ == "__main__":
    main()
