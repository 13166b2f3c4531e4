"""`minserve bench --suite docs`: the runs behind the "minserve vs its peers" section
of docs/benchmarks.md, on the embedded SmolLM2, fp32, in one process.

1. Throughput on a mixed-length workload: N chat-like requests, all at t=0,
   max batch 8: minserve, HF static `generate`, HF continuous batching.
2. Latency at a moderate arrival rate: Poisson at half of the request rate
   minserve sustained in (1) (or --rate), TTFT and ITL p50/p99.
3. Engine overhead: a decode tick vs a bare batched forward, B = 8.

About five minutes on 2 cores with the defaults; --num-requests scales it.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

from .docs_report import machine_line, update_section
from .report import comparison, markdown_table, write_html, write_json
from .runner import build_workload, load, make_engine, payload, peer_names, print_runs, run_targets

SECTION = "serving-vs-peers"


def docs_suite(args) -> int:
    if args.url:
        raise SystemExit("--suite docs runs in process; drop --url")
    t_suite, load0 = time.perf_counter(), os.getloadavg()[0]
    print("loading the model ...")
    model, tok = load(args)
    if tok is None:
        args.prompts = "ids"
    engine = make_engine(args, model, tok)
    vocab, out = int(model.config.vocab_size), Path(args.out_dir)
    peers = peer_names(args) if args.peers is not None else ["static", "continuous"]

    # 1. mixed-length throughput, everything at t=0
    mixed = build_workload(args, tok, vocab, engine.max_model_len, rate=math.inf,
                           concurrency=None)
    runs1 = run_targets(args, mixed, engine, model, tok, peers)
    print_runs("mixed-length throughput", mixed, runs1)
    write_json(out / "docs-mixed.json", payload(mixed, runs1))
    write_html(out / "docs-mixed.html", runs1, "mixed-length workload, all at t=0",
               mixed.describe())
    comp1 = comparison(runs1)

    # 2. moderate arrival rate: half of what minserve sustained above
    sustained = comp1["minserve"]["requests_per_s"]
    rate = args.rate if not math.isinf(args.rate) else float(f"{0.5 * sustained:.2g}")
    n2 = max(8, (3 * args.num_requests) // 5)
    moderate = build_workload(args, tok, vocab, engine.max_model_len, rate=rate,
                              concurrency=None, num_requests=n2, seed=args.seed + 1)
    peers2 = peer_names(args) if args.peers is not None else []
    runs2 = run_targets(args, moderate, engine, model, tok, peers2)
    print_runs(f"moderate rate ({rate:g} req/s)", moderate, runs2)
    write_json(out / "docs-rate.json", payload(moderate, runs2))
    write_html(out / "docs-rate.html", runs2, f"Poisson arrivals at {rate:g} req/s",
               moderate.describe())

    # 3. engine overhead
    from .overhead import measure_overhead

    ov = measure_overhead(engine, args.max_batch_size, args.overhead_prompt_len,
                          args.overhead_ticks)
    write_json(out / "docs-overhead.json", ov)
    print(f"\noverhead: tick {ov['tick_ms']:.1f} ms, bare {ov['bare_forward_ms']:.1f} ms, "
          f"{ov['overhead_pct']:.1f}% (fastest: {ov['overhead_pct_min']:.1f}%; outside the "
          f"forward: {ov['outside_forward_pct']:.1f}%)")

    # the docs section
    m2 = runs2[0].summary()
    c1 = comp1
    speed = ", ".join(f"**{c1[p]['speedup']:.2f}x** {p}" for p in c1 if p != "minserve"
                      and c1[p].get("speedup"))
    cmd = "minserve bench --suite docs" + (f" -n {args.num_requests}"
                                          if args.num_requests != 40 else "")
    ib = args.max_batch_size
    minutes = (time.perf_counter() - t_suite) / 60
    md = f"""## minserve against its peers (`minserve bench`)

{machine_line()}. Command: `{cmd}` (took {minutes:.1f} min; JSON and plotly HTML
reports in `{args.out_dir}/docs-*`).

Setup: embedded SmolLM2-135M, fp32, greedy, max batch {ib}; every request runs to its
output length (EOS ignored), so every target does the same work. minserve: padded
backend, {engine.config.prefill_mode} prefill, FCFS, prefix caching on, serving mode
(worker thread; requests submitted at their arrival times). Peers, in the same process
on the same workload and the same model object: Hugging Face `generate` in static
batches of up to {ib} (left-padded; a batch takes whatever has arrived when the
previous one ends), and Hugging Face continuous batching (the
`ContinuousBatchingManager` behind `model.generate_batch`, at most {ib} requests per
forward, KV pool sized to the workload). Each ratio comes from one run; absolute
tok/s drift with the load of this shared machine (see the load average below).

**1. Throughput on a mixed-length workload** ({mixed.describe()}). minserve's output
throughput relative to each peer: {speed}.

{markdown_table(runs1)}

**2. Latency at a moderate rate**: Poisson arrivals at {rate:g} req/s, half the request
rate minserve sustained in 1 ({moderate.describe()}). minserve: TTFT p50
{m2['ttft']['p50']:.2f} s, p99 {m2['ttft']['p99']:.2f} s; ITL p50
{m2['itl']['p50'] * 1e3:.0f} ms, p99 {m2['itl']['p99'] * 1e3:.0f} ms; TPOT mean
{m2['tpot']['mean'] * 1e3:.0f} ms.

{markdown_table(runs2)}

Reading the ITL tail: with monolithic prefill a new prompt's whole prefill runs
between two decode steps of every active stream, so ITL p99 is about the prefill time
of the longest prompts; chunked prefill (`--prefill-chunk-size 128`) trades TTFT for it
(see the scheduling section).

**3. Engine overhead.** A pure decode tick at B = {ov['batch_size']} over prompts of
{ov['prompt_len']} tokens against a bare batched forward + argmax of the same model over
a `DynamicCache` of the same shape, {ov['ticks']} interleaved pairs:

| reading | tick (ms) | bare forward (ms) | overhead |
|---|---|---|---|
| medians | {ov['tick_ms']:.1f} | {ov['bare_forward_ms']:.1f} | **{ov['overhead_pct']:.1f}%** |
| fastest step of each (least disturbed) | {ov['tick_ms_min']:.1f} | \
{ov['bare_forward_ms_min']:.1f} | **{ov['overhead_pct_min']:.1f}%** |
| time outside the model's forward, within each tick (median) | \
{ov['outside_forward_ms']:.1f} ms of the tick | – | **{ov['outside_forward_pct']:.1f}%** |

The last reading times the forward inside the tick with hooks, so the machine's noise
hits both parts alike. Target: under 10%.

Load average (1 min) at the start / end of the suite: {load0:.1f} / {os.getloadavg()[0]:.1f},
on {os.cpu_count()} cores.
"""
    print("\nwrote", update_section(SECTION, md))
    return 0
