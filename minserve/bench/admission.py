"""Reserve or preempt: one workload, the same KV budget, both admission settings (P6).

    minserve bench admission            # embedded SmolLM2, ~3 min on 2 cores

`admission="reserve"` admits a request only when prompt + max_tokens of KV is free,
so a running row never runs out, but every row holds room for its *longest possible*
reply. `admission="preempt"` admits on what the prompt needs now and, when KV runs
out mid-decode, preempts a row and recomputes it later. The difference shows when
replies stop long before max_tokens (chat: EOS), which is what this workload does:
chat questions through the model's template, max_tokens 192, EOS honoured, all sent
at t=0, a pool of 48 blocks x 16 tokens (768 tokens of KV), batch 8, paged backend.

Per setting: rows running side by side (mean, max), KV held over time (the share of
the pool holding real tokens), output throughput, TTFT and end-to-end percentiles,
preemptions and tokens recomputed. `run_admission` returns the per-tick series too;
notebook 07 draws them.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from .registry import at_least, experiment, option
from .report import md_table
from .timing import drain

QUESTIONS = [
    "What is 2 + 2? Answer with the number only.", "Name a primary colour. One word.",
    "Write a short poem about the sea.", "What is the capital of Japan? One word.",
    "Explain in a few sentences how a bicycle stays upright.", "Say hello.",
    "List five fruits, one per line.", "Describe your ideal weekend in detail.",
    "Is water wet? Answer yes or no.", "Tell me a story about a robot who learns to paint.",
    "What colour is the sky on a clear day? One word.",
    "Give three tips for learning a language, with a sentence on each.",
    "Translate 'thank you' into French.", "Why do leaves change colour in autumn?",
    "What is the opposite of hot? One word.", "Write a limerick about a cat.",
]


def held_tokens(scheduler) -> int:
    """Tokens of KV the running rows hold right now (prefill progress + decoded)."""
    return (sum(r.num_computed_prompt_tokens for r in scheduler.prefilling)
            + sum(r.num_tokens - 1 for r in scheduler.active))


def run_admission(model, tokenizer, prompts: list, params, admission: str,
                  max_ticks: int = 100_000, **cfg) -> dict[str, Any]:
    """Run `prompts` (all at t=0) to the end under one admission setting; the per-tick
    series (rows running, KV held, time) and per-request results."""
    from .. import Engine, EngineConfig

    engine = Engine(EngineConfig(admission=admission, device="cpu", **cfg), model=model,
                    tokenizer=tokenizer)
    s = engine.scheduler
    capacity = (engine.num_blocks * engine.config.block_size if engine.config.backend == "paged"
                else s.kv_budget_tokens)
    handles = [engine.submit(p, params) for p in prompts]
    series = {"tick": [], "t_s": [], "rows": [], "kv_held": [], "preempted": []}
    first_tick: dict[int, int] = {}  # request index -> tick of its first token
    done_tick: dict[int, int] = {}
    t0 = time.perf_counter()
    while s.has_work() and s.tick_count < max_ticks:
        rec = engine.step()
        for i, h in enumerate(handles):
            if i not in first_tick and h.events:
                first_tick[i] = rec.tick
            if i not in done_tick and h.finished:
                done_tick[i] = rec.tick
        series["tick"].append(rec.tick)
        series["t_s"].append(time.perf_counter() - t0)
        series["rows"].append(len(rec.decode.rows) + len(s.prefilling))
        series["kv_held"].append(held_tokens(s))
        series["preempted"].append([p["request_id"] for p in rec.decode.preempted])
    wall = time.perf_counter() - t0
    outs = [h.output for h in handles]
    ttft = [o.timing["ttft"] for o in outs]
    e2e = [o.timing["e2e"] for o in outs]
    stats = engine.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    drain(engine, handles, close=True)  # (past max_ticks: the rest cancelled)
    return {"admission": admission, "ticks": s.tick_count, "wall_s": wall,
            "output_tokens": tokens, "tok_per_s": tokens / wall, "capacity": capacity,
            "rows_mean": statistics.mean(series["rows"]), "rows_max": max(series["rows"]),
            "kv_used_mean": statistics.mean(series["kv_held"]) / capacity,
            "ttft_p50": _pct(ttft, 50), "ttft_p90": _pct(ttft, 90),
            "e2e_p50": _pct(e2e, 50), "e2e_p90": _pct(e2e, 90),
            "ttft_ticks_p50": _pct(list(first_tick.values()), 50),
            "ttft_ticks_p90": _pct(list(first_tick.values()), 90),
            "e2e_ticks_p50": _pct(list(done_tick.values()), 50),
            "e2e_ticks_p90": _pct(list(done_tick.values()), 90),
            "preemptions": stats["preemptions"], "recomputed_tokens": stats["recomputed_tokens"],
            "prompt_tokens_computed": stats["prompt_tokens_computed"],
            "token_ids": [o.token_ids for o in outs], "series": series}


def _pct(xs: list[float], q: float) -> float:
    """The order statistic nearest to q (no interpolation: a tick is a whole tick)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def chat_prompts(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(n)]


def table(runs: list[dict[str, Any]]) -> list[str]:
    return md_table(["admission", "rows side by side, mean / max", "KV pool holding tokens, mean",
                     "output tok/s", "TTFT p50 / p90", "e2e p50 / p90", "preemptions",
                     "tokens recomputed"],
                    [[f"`{r['admission']}`", f"{r['rows_mean']:.1f} / {r['rows_max']}",
                      f"{100 * r['kv_used_mean']:.0f}%", f"{r['tok_per_s']:.1f}",
                      f"{r['ttft_p50']:.1f} / {r['ttft_p90']:.1f} s",
                      f"{r['e2e_p50']:.1f} / {r['e2e_p90']:.1f} s", r["preemptions"],
                      r["recomputed_tokens"]] for r in runs])


@experiment("admission", option("-n", type=at_least(1), default=16, help="requests"),
            option("--num-blocks", type=at_least(1), default=48,
                   help="the KV pool, in blocks of 16 tokens"),
            option("--max-tokens", type=at_least(1), default=192, help="each request's max_tokens"),
            smallest=("-n", "2", "--num-blocks", "8", "--max-tokens", "4"))
def admission(bench):
    """Reserve or preempt (P6): one workload, the same KV budget, both admission settings."""
    from .. import SamplingParams

    a = bench.args
    model, tokenizer = bench.model()
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    cfg = dict(backend="paged", max_batch_size=8, num_blocks=a.num_blocks, block_size=16,
               prefill_chunk_size=256)
    runs = [run_admission(model, tokenizer, chat_prompts(a.n), params, mode, **cfg)
            for mode in ("reserve", "preempt")]
    same = runs[0]["token_ids"] == runs[1]["token_ids"]
    pre = runs[1]
    bench.publish("admission", [
        "## Reserve or preempt (P6)", "",
        f"`minserve bench admission`: {a.n} chat questions (short answers and long ones, EOS "
        f"honoured, max_tokens {a.max_tokens}) sent at t=0, the embedded SmolLM2, paged backend, "
        f"batch 8, chunks of 256, a pool of {a.num_blocks} blocks x 16 = {a.num_blocks * 16} "
        "tokens of KV; one run each.", "", *table(runs), "",
        f"Output throughput preempt / reserve: **{pre['tok_per_s'] / runs[0]['tok_per_s']:.2f}x**; "
        f"the replies are {'token for token the same' if same else 'NOT the same (a bug)'} under "
        f"both. Reserve holds room for {a.max_tokens} tokens per row that most replies never "
        "use, so it runs fewer rows side by side and the pool holds fewer real tokens; preempt "
        "fills the pool"
        + (f" and paid with {pre['preemptions']} preemption{'s' if pre['preemptions'] != 1 else ''}"
           f" ({pre['recomputed_tokens']} tokens recomputed) when long replies outgrew it"
           if pre["preemptions"] else "; on this run no reply outgrew the pool, so nothing was "
           "preempted") + ". Notebook 07 draws both settings tick by tick on a small model. "
        "Absolute rates drop under load; compare the ratio."])
