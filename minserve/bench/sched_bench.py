"""Scheduling benchmark: chunked vs monolithic prefill, FCFS vs VTC.

    python -m minserve.bench.sched_bench          # embedded SmolLM2, fp32, a few minutes

Both parts replay a fixed arrival trace in step mode (arrivals are pinned to
ticks, so both variants see exactly the same trace) and time it with the wall
clock.

1. **Chunked vs monolithic prefill.** Four chat streams are decoding when a
   2,000-token prompt arrives. Monolithic prefill pushes it through in one
   forward: every stream freezes for that whole pass. Chunked (128 tokens a
   tick) interleaves it with decode. Reported: max and p99 inter-token gap of
   the running streams, and the long prompt's TTFT (the price of chunking).
2. **FCFS vs VTC.** One heavy session floods the queue, three light sessions
   send a request now and then. Reported: per-session TTFT p50/p99 and Jain's
   fairness index J = (Σx)² / (n·Σx²) of x = the share of each session's
   requested output tokens streamed 8 ticks after the last light request arrives
   (J = 1: every session got the same share of what it asked for).
"""

from __future__ import annotations

import argparse

from .docs_report import machine_line, update_section


def _engine(model, tok, **cfg):
    from .. import Engine, EngineConfig

    return Engine(EngineConfig(device="cpu", **cfg), model=model, tokenizer=tok)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else 0.0


def run_trace(engine, arrivals: dict[int, list[tuple]]) -> list:
    """arrivals: tick -> [(prompt_ids, SamplingParams, session)]. Returns the handles."""
    handles, tick = [], 0
    while tick <= max(arrivals) or engine.scheduler.has_work():
        for ids, sp, session in arrivals.get(tick, []):
            h = engine.submit(ids, sp, session_id=session)
            h.session = session
            handles.append(h)
        engine.step()
        tick += 1
    return handles


def chunked_vs_monolithic(model, tok, chunk: int, long_len: int) -> dict[str, dict]:
    from .. import SamplingParams

    chat = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                    tokenize=True) for q in
            ("Tell me about rivers.", "Describe a forest.", "What is a star?", "Explain rain.")]
    chat = [c["input_ids"] if hasattr(c, "keys") else c for c in chat]
    long = [(13 * k) % 30000 + 200 for k in range(long_len)]
    arrivals = {0: [(c, SamplingParams(max_tokens=48, ignore_eos=True), f"s{i}")
                    for i, c in enumerate(chat)],
                6: [(long, SamplingParams(max_tokens=4, ignore_eos=True), "long")]}
    out = {}
    for name, c in (("monolithic", 0), (f"chunked {chunk}", chunk)):
        engine = _engine(model, tok, max_batch_size=8, prefill_chunk_size=c, max_model_len=4096,
                         enable_prefix_caching=False, num_blocks=400)
        hs = run_trace(engine, arrivals)
        gaps = []
        for h in hs:
            if h.session != "long":
                times = [e.time for e in h.events if e.token_id is not None]
                gaps += [b - a for a, b in zip(times, times[1:])]
        long_h = next(h for h in hs if h.session == "long")
        out[name] = {"max_gap": max(gaps), "p99_gap": percentile(gaps, 99),
                     "p50_gap": percentile(gaps, 50), "long_ttft": long_h.output.timing["ttft"]}
    return out


def fcfs_vs_vtc(model, tok) -> dict[str, dict]:
    from .. import SamplingParams

    heavy = [(list(range(300 + i, 400 + i)), SamplingParams(max_tokens=24, ignore_eos=True), "heavy")
             for i in range(12)]
    arrivals: dict[int, list] = {0: heavy}
    for k, t in enumerate((3, 10, 18)):
        for j in range(3):
            arrivals.setdefault(t + j, []).append(
                (list(range(50 + 10 * j + k, 70 + 10 * j + k)),
                 SamplingParams(max_tokens=12, ignore_eos=True), f"light{j}"))
    cutoff_tick = max(arrivals)
    out = {}
    for policy in ("fcfs", "fair"):
        engine = _engine(model, tok, max_batch_size=4, policy=policy, enable_prefix_caching=False)
        served: dict[str, int] = {}  # output tokens streamed by the cutoff
        asked: dict[str, int] = {}  # output tokens asked for
        handles, tick = [], 0
        while tick <= cutoff_tick or engine.scheduler.has_work():
            for ids, sp, s in arrivals.get(tick, []):
                h = engine.submit(ids, sp, session_id=s)
                h.session = s
                handles.append(h)
                asked[s] = asked.get(s, 0) + sp.max_tokens
            if tick == cutoff_tick + 8:  # a few ticks after the last arrival: who got what share
                for h in handles:
                    served[h.session] = served.get(h.session, 0) + sum(
                        e.token_id is not None for e in h.events)
            engine.step()
            tick += 1
        sessions = sorted(asked)
        ttft = {s: [h.output.timing["ttft"] for h in handles if h.session == s] for s in sessions}
        light = [t for s in sessions if s != "heavy" for t in ttft[s]]
        out[policy] = {"light_p50": percentile(light, 50), "light_p99": percentile(light, 99),
                       "heavy_p50": percentile(ttft["heavy"], 50),
                       "heavy_p99": percentile(ttft["heavy"], 99),
                       "jain": jain([served.get(s, 0) / asked[s] for s in sessions])}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--long", type=int, default=2000)
    ap.add_argument("--no-docs", action="store_true")
    args = ap.parse_args(argv)
    from ..models import load_model

    model, tok = load_model(None, "float32", "cpu")
    cm = chunked_vs_monolithic(model, tok, args.chunk, args.long)
    for name, r in cm.items():
        print(f"{name:>12}: stream gap max {r['max_gap']:.2f} s, p99 {r['p99_gap']:.2f} s, "
              f"p50 {r['p50_gap']:.3f} s | long prompt TTFT {r['long_ttft']:.2f} s")
    fv = fcfs_vs_vtc(model, tok)
    for name, r in fv.items():
        print(f"{name:>5}: light TTFT p50 {r['light_p50']:.2f} s p99 {r['light_p99']:.2f} s | heavy "
              f"p50 {r['heavy_p50']:.2f} s p99 {r['heavy_p99']:.2f} s | Jain {r['jain']:.3f}")
    mono, chk = cm["monolithic"], cm[f"chunked {args.chunk}"]
    md = ["## Scheduling: chunked prefill and fairness", "",
          "`python -m minserve.bench.sched_bench` — embedded SmolLM2-135M, fp32, step mode on a "
          "fixed arrival trace (arrivals pinned to ticks), wall-clock times.", "", machine_line(), "",
          f"**Chunked vs monolithic prefill**: 4 chat streams decoding (48 tokens each) when a "
          f"{args.long}-token prompt arrives at tick 6.", "",
          "| prefill | stream gap max | stream gap p99 | stream gap p50 | long prompt TTFT |",
          "|---|---:|---:|---:|---:|"]
    md += [f"| {n} | {r['max_gap']:.2f} s | {r['p99_gap']:.2f} s | {r['p50_gap']:.3f} s | "
           f"{r['long_ttft']:.2f} s |" for n, r in cm.items()]
    md += ["", f"Max gap monolithic / chunked: **{mono['max_gap'] / chk['max_gap']:.1f}x**; "
           f"the long prompt's TTFT costs {chk['long_ttft'] / mono['long_ttft']:.2f}x.", "",
           "**FCFS vs VTC**: one heavy session sends 12 requests (100-token prompts, 24 new "
           "tokens) at tick 0; three light sessions each send 3 requests (20-token prompts, 12 "
           "new tokens) around ticks 3, 10 and 18; max_batch_size 4.", "",
           "| policy | light TTFT p50 | light TTFT p99 | heavy TTFT p50 | heavy TTFT p99 | "
           "Jain (share of demand served) |", "|---|---:|---:|---:|---:|---:|"]
    md += [f"| {n} | {r['light_p50']:.2f} s | {r['light_p99']:.2f} s | {r['heavy_p50']:.2f} s | "
           f"{r['heavy_p99']:.2f} s | {r['jain']:.3f} |" for n, r in fv.items()]
    if not args.no_docs:
        print("wrote", update_section("scheduling", "\n".join(md)))


if __name__ == "__main__":
    main()
