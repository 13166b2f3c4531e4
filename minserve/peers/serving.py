"""`minserve bench` (the default experiment): replay a workload against minserve and its peers.

    minserve bench                                   # 40 chat-like requests at t=0: minserve,
                                                     #   HF static generate, HF continuous batching
    minserve bench --rate 0.5 --peers none           # open loop, Poisson 0.5 req/s, minserve only
    minserve bench --rate 2 --burstiness 0.5 --sessions alice=3,bob=1 --policy fair
    minserve bench --concurrency 4 --output-len fixed:64 --prompt-len uniform:32:256
    minserve bench --url http://127.0.0.1:8000       # any OpenAI-compatible server
    minserve bench --overhead                        # decode tick vs bare forward
    minserve bench --suite docs                      # the figures of docs/benchmarks.md

Results go to --out-dir (default bench-results/): `<name>.json` (settings, summaries,
every request's token times, the run's conditions) and `<name>.html` (plotly report).

`--suite docs`, the runs behind the first section of docs/benchmarks.md (about five
minutes on 2 cores): 1. throughput on the mixed-length workload, all at t=0, against both
peers; 2. latency at Poisson arrivals at half the request rate minserve sustained in 1
(or --rate); 3. engine overhead, a decode tick against a bare batched forward (bench/overhead.py).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

from ..bench.registry import at_least, experiment, option
from ..bench.report import comparison, markdown_table
from ..bench.targets import RunResult
from ..bench.workload import BenchRequest, Workload, make_workload
from ..config import PrefillMode
from .run_report import session_table, write_html, write_json

PEERS = ("static", "continuous")
OPTIONS = (
    option("--num-requests", "-n", type=at_least(1), default=40, help="requests in the workload"),
    option("--rate", type=float, default=math.inf,
           help="total requests/s, Poisson/gamma arrivals (inf: all at t=0)"),
    option("--burstiness", type=float, default=1.0,
           help="gamma shape of the gaps: 1 = Poisson, < 1 burstier"),
    option("--concurrency", type=at_least(1), default=None,
           help="closed loop: keep this many requests in flight, ignoring --rate (default: "
                "open loop, arrivals at --rate)"),
    option("--prompt-len", default="chat",
           help="N | fixed:N | uniform:A:B | lognormal:MEDIAN:SIGMA[:LO:HI] | chat"),
    option("--output-len", default="chat", help="same forms as --prompt-len"),
    option("--sessions", default=None,
           help="K (equal sessions) or NAME=WEIGHT,... (requests and rate shared by weight; "
                "default: one session)"),
    option("--shared-prefix", type=at_least(0), default=0,
           help="every prompt starts with the same N tokens (a system prompt)"),
    option("--prompts", choices=["text", "ids"], default="text",
           help="prompt tokens from random words through the tokenizer, or random ids"),
    option("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
           help="run every request to its output length; --no-ignore-eos stops at EOS"),
    option("--seed", type=int, default=0, help="workload seed (same seed, same requests)"),
    option("--vocab-size", type=at_least(2), default=49152,
           help="--url with --prompts ids and no local model: ids are drawn below this"),
    option("--url", default=None,
           help="benchmark this OpenAI-compatible server (default: the in-process engine)"),
    option("--api", choices=["completions", "chat"], default="completions",
           help="endpoint used with --url"),
    option("--target-name", default=None, help="label of the --url target (default: the URL)"),
    option("--served-model", default=None, help="model name to send (default: the first)"),
    option("--peers", default=None, help="comma list of static,continuous, or none (default: "
                                         "both in process, none with --url)"),
    option("--model", default=None, help="local folder or hub id (default: embedded SmolLM2)"),
    option("--device", default="cpu", help="in-process engine and peers"),
    option("--dtype", default="float32", help="model dtype"),
    option("--max-batch-size", type=at_least(1), default=8, help="minserve's batch and the peers' batch"),
    option("--backend", default="padded", choices=["padded", "paged"], help="minserve backend"),
    option("--policy", default="fcfs", choices=["fcfs", "fair"], help="minserve policy"),
    option("--prefill-chunk-size", type=at_least(0), default=0, help="0: monolithic prefill"),
    option("--prefill-mode", default="", choices=["", *(m.value for m in PrefillMode)],
           help="'' derives it from --prefill-chunk-size; mixed_batch and disaggregated need --backend paged"),
    option("--max-queue-size", type=at_least(1), default=256, help="gate G1"),
    option("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
           help="minserve's prefix cache"),
    option("--overhead", action="store_true",
           help="also measure a decode tick against a bare batched forward (default: not)"),
    option("--overhead-prompt-len", type=at_least(1), default=128, help="prompt tokens per row"),
    option("--overhead-ticks", type=at_least(1), default=32, help="decode ticks timed in --overhead"),
    option("--profile", action="store_true",
           help="print a cProfile of decode ticks (default: no profile)"),
    option("--suite", choices=["docs"], default=None,
           help="docs: the runs behind docs/benchmarks.md, and update that section "
                "(default: the one run the other options describe)"),
    option("--out-dir", default="bench-results", help="where the JSON and HTML go"),
    option("--name", default=None, help="file name stem (default: bench-<time>)"),
    option("--progress", action=argparse.BooleanOptionalAction, default=True,
           help="a progress bar while the workload runs"),
)


def engine_for(bench):
    a = bench.args
    return bench.engine(model=a.model, dtype=a.dtype, max_batch_size=a.max_batch_size,
                        backend=a.backend, policy=a.policy, prefill_chunk_size=a.prefill_chunk_size,
                        prefill_mode=a.prefill_mode, max_queue_size=a.max_queue_size,
                        enable_prefix_caching=a.prefix_caching)


def build_workload(args, tokenizer, vocab_size: int, max_model_len: int | None = None,
                   **override) -> Workload:
    kw = dict(rate=args.rate, burstiness=args.burstiness, concurrency=args.concurrency,
              prompt_len=args.prompt_len, output_len=args.output_len, sessions=args.sessions,
              seed=args.seed, shared_prefix=args.shared_prefix, max_model_len=max_model_len,
              tokenizer=tokenizer if args.prompts == "text" else None,
              vocab=(min(100, vocab_size // 4), vocab_size))
    n = override.pop("num_requests", args.num_requests)
    return make_workload(n, **{**kw, **override})


def run_targets(args, workload: Workload, engine, model, tokenizer,
                peers: list[str]) -> list[RunResult]:
    """minserve (or --url) first, then each peer; every target warmed up off the record."""
    from ..bench.targets import EngineTarget
    from .hf import HFContinuousTarget, HFStaticTarget
    from .openai_target import OpenAITarget

    if args.url:
        targets = [OpenAITarget(args.url, args.served_model, args.api, args.ignore_eos,
                                tokenizer, name=args.target_name or args.url)]
    else:
        targets = [EngineTarget(engine, args.ignore_eos)]
    for peer in peers:
        cls = HFStaticTarget if peer == "static" else HFContinuousTarget
        targets.append(cls(model, args.max_batch_size, args.ignore_eos))
    first = workload.requests[0]  # the warm-up: two short requests cut from the first
    warmup = Workload([BenchRequest(i, first.session, None, first.prompt_ids[:16], 4)
                       for i in range(2)], concurrency=2)
    runs = []
    for k, target in enumerate(targets):
        try:
            target.run(warmup, progress=False)
            runs.append(target.run(workload, args.progress))
        except Exception as e:
            if k == 0:  # the target under test itself failed: that is the answer
                raise
            print(f"peer {target.name} failed and is left out: {type(e).__name__}: {e}")
    return runs


def peer_names(args, default: str = ",".join(PEERS)) -> list[str]:
    spec = args.peers if args.peers is not None else ("none" if args.url else default)
    peers = [] if spec in ("", "none") else [s.strip() for s in spec.split(",")]
    bad = [p for p in peers if p not in PEERS]
    if bad:
        raise SystemExit(f"--peers: unknown {bad}; use {','.join(PEERS)} or none")
    return peers


def report(bench, stem: str, title: str, workload: Workload, runs: list[RunResult],
           extra: dict | None = None) -> dict[str, dict[str, Any]]:
    """Print the runs' table; write `<stem>.json` and `<stem>.html`; return the comparison."""
    print(f"\n== {title}: {workload.describe()}")
    print(markdown_table(runs))
    for run in runs:
        if run.summary()["refusals_by_gate"]:
            print(f"{run.target}: refused by gate {run.summary()['refusals_by_gate']}")
    if len(workload.settings.get("sessions", {})) > 1:
        print(session_table(runs[0], workload.settings["sessions"]))
    comp = comparison(runs)
    out = Path(bench.args.out_dir)
    j = write_json(out / f"{stem}.json", {
        "workload": workload.settings, "describe": workload.describe(), "comparison": comp,
        "runs": [r.to_dict() for r in runs], "conditions": bench.conditions.as_dict(),
        **(extra or {})})
    h = write_html(out / f"{stem}.html", runs, title, workload.describe())
    print(f"wrote {j} and {h}")
    return comp


def overhead_line(ov: dict) -> str:
    return (f"engine overhead at B={ov['batch_size']}, prompt {ov['prompt_len']}: tick "
            f"{ov['tick_ms']:.1f} ms vs bare forward {ov['bare_forward_ms']:.1f} ms -> "
            f"{ov['overhead_pct']:.1f}% (fastest steps: {ov['overhead_pct_min']:.1f}%; "
            f"outside the forward within the tick: {ov['outside_forward_pct']:.1f}%)")


@experiment("serving", *OPTIONS, smallest=("-n", "2", "--prompt-len", "8", "--output-len", "3",
                                          "--peers", "static", "--no-progress"))
def serving(bench):
    """minserve against HF `generate` and HF continuous batching on one replayed workload."""
    a = bench.args
    if a.suite == "docs":
        return docs_suite(bench)
    peers = peer_names(a)
    model = tokenizer = engine = None
    if not a.url or peers or a.overhead or a.profile:
        print("loading the model ...")
        model, tokenizer = bench.model()
    elif a.prompts == "text":  # HTTP only: the tokenizer alone, for text prompts
        from transformers import AutoTokenizer

        from ..models import embedded_model_dir

        tokenizer = AutoTokenizer.from_pretrained(a.model or embedded_model_dir())
    if a.prompts == "text" and tokenizer is None:
        a.prompts = "ids"
    if model is not None and not a.url:
        engine = engine_for(bench)
    vocab = (int(model.config.vocab_size) if model is not None
             else len(tokenizer) if tokenizer is not None else a.vocab_size)
    workload = build_workload(a, tokenizer, vocab, engine.max_model_len if engine else None)
    runs = run_targets(a, workload, engine, model, tokenizer, peers)
    extra: dict[str, Any] = {}
    if a.overhead or a.profile:
        from ..bench.overhead import measure_overhead, profile_ticks

        engine = engine or engine_for(bench)
        if a.overhead:
            extra["overhead"] = measure_overhead(engine, a.max_batch_size, a.overhead_prompt_len,
                                                 a.overhead_ticks)
            print(overhead_line(extra["overhead"]))
        if a.profile:
            print(profile_ticks(engine, a.max_batch_size, a.overhead_prompt_len))
    report(bench, a.name or time.strftime("bench-%Y%m%d-%H%M%S"), "workload", workload, runs, extra)
    print(bench.conditions.line())
    return 0


def docs_suite(bench) -> int:
    """The three runs behind docs/benchmarks.md's first section, and that section."""
    from ..bench.overhead import measure_overhead

    a = bench.args
    if a.url:
        raise SystemExit("--suite docs runs in process; drop --url")
    t_suite = time.perf_counter()
    print("loading the model ...")
    model, tok = bench.model()
    if tok is None:
        a.prompts = "ids"
    engine = engine_for(bench)
    vocab = int(model.config.vocab_size)
    mixed = build_workload(a, tok, vocab, engine.max_model_len, rate=math.inf, concurrency=None)
    runs1 = run_targets(a, mixed, engine, model, tok, peer_names(a))
    c1 = report(bench, "docs-mixed", "mixed-length workload, all at t=0", mixed, runs1)
    # 2. a moderate arrival rate: half of what minserve sustained above
    rate = a.rate if not math.isinf(a.rate) else float(f"{0.5 * c1['minserve']['requests_per_s']:.2g}")
    moderate = build_workload(a, tok, vocab, engine.max_model_len, rate=rate, concurrency=None,
                              num_requests=max(8, (3 * a.num_requests) // 5), seed=a.seed + 1)
    runs2 = run_targets(a, moderate, engine, model, tok, peer_names(a, "none"))
    report(bench, "docs-rate", f"Poisson arrivals at {rate:g} req/s", moderate, runs2)
    ov = measure_overhead(engine, a.max_batch_size, a.overhead_prompt_len, a.overhead_ticks)
    write_json(Path(a.out_dir) / "docs-overhead.json", ov)
    print(overhead_line(ov))
    m2, ib = runs2[0].summary(), a.max_batch_size
    speed = ", ".join(f"**{c1[p]['speedup']:.2f}x** {p}" for p in c1 if p != "minserve"
                      and c1[p].get("speedup"))
    cmd = ".venv/bin/minserve bench --suite docs" + (f" -n {a.num_requests}" if a.num_requests != 40 else "")
    bench.publish("serving-vs-peers", [f"""## minserve against its peers (`minserve bench`)

Command: `{cmd}` (took {(time.perf_counter() - t_suite) / 60:.1f} min; JSON and plotly HTML
reports in `{a.out_dir}/docs-*`).

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
hits both parts alike. Target: under 10%."""])
    return 0
