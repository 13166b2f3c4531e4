"""Decode throughput of the engine vs Hugging Face `generate`, same prompts, one run.

    python -m minserve.bench.decode_throughput            # batch 8 and 32, 64 new tokens

For each batch size B: B prompts of mixed lengths, every one generating exactly
`new_tokens` tokens (EOS ignored on both sides, so the work is identical).

* HF: one `model.generate` call on the B prompts, left-padded (its static batch).
* minserve: `Engine.generate` with max_batch_size=B (padded backend, monolithic
  prefill), i.e. the same batch, but through the scheduler, the per-row
  sampling and the streaming path.

Tokens/s counts generated tokens over wall time, prefill included on both
sides. The ratio minserve/HF is the figure to read; absolute times drift.
"""

from __future__ import annotations

import argparse
import time

import torch

from .docs_report import machine_line, update_section

TEXT = ("The history of computing is a story of layers: transistors become gates, gates become "
        "adders, adders become processors, and processors run the programs that people write. "
        "Each layer hides the one below it, and each new layer makes new things possible. ")


def prompts_for(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """n prompts of mixed lengths (8..~200 tokens), deterministic."""
    g = torch.Generator().manual_seed(seed)
    ids = tokenizer(TEXT * 6, add_special_tokens=False)["input_ids"]
    out = []
    for _ in range(n):
        start = int(torch.randint(0, 40, (1,), generator=g))
        length = int(torch.randint(8, 200, (1,), generator=g))
        out.append(ids[start:start + length])
    return out


@torch.inference_mode()
def hf_generate_tps(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> float:
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    dt = time.perf_counter() - t0
    assert out.shape[1] - width == new_tokens
    return len(prompts) * new_tokens / dt


def engine_tps(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(overall tokens/s, decode-phase tokens/s) through the engine."""
    from .. import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(max_batch_size=len(prompts), enable_prefix_caching=False,
                                 device=str(next(model.parameters()).device)),
                    model=model, tokenizer=tokenizer)
    engine.trace = []
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    dt = time.perf_counter() - t0
    assert all(len(o.token_ids) == new_tokens for o in outs)
    # decode-only: ticks with no prefill work, tokens decoded per second in them
    dec = [r for r in engine.trace if r.decode.rows and not r.prefill.chunks]
    dec_tps = sum(len(r.decode.rows) for r in dec) / sum(r.duration_s for r in dec)
    return len(prompts) * new_tokens / dt, dec_tps


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--no-docs", action="store_true", help="print only; leave docs/ alone")
    args = ap.parse_args(argv)
    from ..models import load_model

    model, tok = load_model(None, "float32", "cpu")
    hf_generate_tps(model, tok, prompts_for(tok, 2), 4)  # warm-up
    rows = []
    for b in args.batch:
        prompts = prompts_for(tok, b, seed=b)
        hf = hf_generate_tps(model, tok, prompts, args.new_tokens)
        ms, ms_dec = engine_tps(model, tok, prompts, args.new_tokens)
        rows.append((b, hf, ms, ms_dec))
        print(f"batch {b:3d}: HF generate {hf:7.1f} tok/s | minserve {ms:7.1f} tok/s "
              f"(decode ticks alone {ms_dec:7.1f}) | ratio minserve/HF {ms / hf:.2f}")
    md = ["## Engine core: decode throughput vs HF `generate`", "",
          "`python -m minserve.bench.decode_throughput` — embedded SmolLM2-135M, fp32, "
          f"{args.new_tokens} new tokens per request (EOS ignored), mixed prompt lengths 8–200, "
          "padded backend, one static batch on both sides, prefill included.", "",
          machine_line(), "",
          "| batch | HF generate tok/s | minserve tok/s | minserve decode ticks tok/s | minserve / HF |",
          "|---:|---:|---:|---:|---:|"]
    md += [f"| {b} | {hf:.1f} | {ms:.1f} | {dec:.1f} | {ms / hf:.2f} |" for b, hf, ms, dec in rows]
    if not args.no_docs:
        print("wrote", update_section("core-throughput", "\n".join(md)))


if __name__ == "__main__":
    main()
