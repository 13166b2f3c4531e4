"""`minserve bench`: replay a workload against minserve and its peers; write JSON + HTML.

    minserve bench                                   # 40 chat-like requests at t=0: minserve,
                                                     #   HF static generate, HF continuous batching
    minserve bench --rate 0.5 --peers none           # open loop, Poisson 0.5 req/s, minserve only
    minserve bench --rate 2 --burstiness 0.5 --sessions alice=3,bob=1 --policy fair
    minserve bench --concurrency 4 --output-len fixed:64 --prompt-len uniform:32:256
    minserve bench --url http://127.0.0.1:8000       # any OpenAI-compatible server
    minserve bench --overhead                        # decode tick vs bare forward
    minserve bench --suite docs                      # the figures of docs/benchmarks.md

Results go to --out-dir (default bench-results/): `<name>.json` (settings,
summaries, every request's token times) and `<name>.html` (plotly report).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

from .report import write_html, write_json
from .runner import (
    build_workload,
    load,
    make_engine,
    payload,
    peer_names,
    print_runs,
    run_targets,
)


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", "-n", type=int, default=40, help="requests in the workload")
    w.add_argument("--rate", type=float, default=math.inf,
                   help="total requests/s, Poisson/gamma arrivals (inf: all at t=0)")
    w.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 = Poisson, < 1 burstier")
    w.add_argument("--concurrency", type=int, default=None,
                   help="closed loop: keep this many requests in flight (ignores --rate)")
    w.add_argument("--prompt-len", default="chat",
                   help="N | fixed:N | uniform:A:B | lognormal:MEDIAN:SIGMA[:LO:HI] | chat")
    w.add_argument("--output-len", default="chat", help="same forms as --prompt-len")
    w.add_argument("--sessions", default=None,
                   help="K (equal sessions) or NAME=WEIGHT,... (requests and rate shared by weight)")
    w.add_argument("--shared-prefix", type=int, default=0,
                   help="every prompt starts with the same N tokens (a system prompt)")
    w.add_argument("--prompts", choices=["text", "ids"], default="text",
                   help="prompt tokens from random words through the tokenizer, or random ids")
    w.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="stop at EOS (default: run every request to its output length)")
    w.add_argument("--seed", type=int, default=0, help="workload seed (same seed, same requests)")
    w.add_argument("--vocab-size", type=int, default=49152,
                   help="--url with --prompts ids and no local model: ids are drawn below this")
    t = p.add_argument_group("targets")
    t.add_argument("--url", default=None,
                   help="benchmark this OpenAI-compatible server instead of the in-process engine")
    t.add_argument("--api", choices=["completions", "chat"], default="completions",
                   help="endpoint used with --url")
    t.add_argument("--target-name", default=None,
                   help="label of the --url target in the report (default: the URL)")
    t.add_argument("--served-model", default=None, help="model name to send (default: the first)")
    t.add_argument("--peers", default=None,
                   help="comma list of static,continuous, or none (default: both in process, "
                        "none with --url)")
    t.add_argument("--model", default=None, help="local folder or hub id (default: embedded SmolLM2)")
    t.add_argument("--tiny", action="store_true", help="a tiny random Llama (smoke runs)")
    t.add_argument("--device", default="cpu", help="in-process engine and peers")
    t.add_argument("--dtype", default="float32", help="model dtype")
    t.add_argument("--max-batch-size", type=int, default=8,
                   help="minserve's batch and the peers' batch")
    t.add_argument("--backend", default="padded", choices=["padded", "paged"],
                   help="minserve backend")
    t.add_argument("--policy", default="fcfs", choices=["fcfs", "fair"],
                   help="minserve policy")
    t.add_argument("--prefill-chunk-size", type=int, default=0,
                   help="0: monolithic prefill")
    t.add_argument("--prefill-mode", default="", choices=["", "monolithic", "chunked", "mixed_batch"],
                   help="'' derives it from --prefill-chunk-size; mixed_batch needs --backend paged")
    t.add_argument("--max-queue-size", type=int, default=256, help="gate G1")
    t.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="turn minserve's prefix cache off")
    o = p.add_argument_group("overhead, output")
    o.add_argument("--overhead", action="store_true",
                   help="also measure a decode tick against a bare batched forward")
    o.add_argument("--overhead-prompt-len", type=int, default=128,
                   help="prompt tokens per row in --overhead")
    o.add_argument("--overhead-ticks", type=int, default=32, help="decode ticks timed in --overhead")
    o.add_argument("--profile", action="store_true", help="print a cProfile of decode ticks")
    o.add_argument("--suite", choices=["docs"], default=None,
                   help="docs: the runs behind docs/benchmarks.md, and update that section")
    o.add_argument("--out-dir", default="bench-results", help="where the JSON and HTML go")
    o.add_argument("--name", default=None, help="file name stem (default: bench-<time>)")
    o.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


# ------------------------------------------------------------------ the command
def bench(args: argparse.Namespace) -> int:
    if args.suite == "docs":
        from .suite import docs_suite

        return docs_suite(args)
    peers = peer_names(args)
    model = tokenizer = engine = None
    if not args.url or peers or args.overhead:
        print("loading the model ...")
        model, tokenizer = load(args)
    elif args.prompts == "text":  # HTTP only: the tokenizer alone, for text prompts
        from transformers import AutoTokenizer

        from ..models import embedded_model_dir

        tokenizer = AutoTokenizer.from_pretrained(args.model or embedded_model_dir())
    if args.prompts == "text" and tokenizer is None:
        args.prompts = "ids"
    if model is not None and not args.url:
        engine = make_engine(args, model, tokenizer)
    vocab = (int(model.config.vocab_size) if model is not None
             else len(tokenizer) if tokenizer is not None else args.vocab_size)
    max_len = engine.max_model_len if engine is not None else None
    workload = build_workload(args, tokenizer, vocab, max_len)
    name = args.name or time.strftime("bench-%Y%m%d-%H%M%S")
    out = Path(args.out_dir)
    runs = run_targets(args, workload, engine, model, tokenizer, peers)
    print_runs("workload", workload, runs)
    extra: dict[str, Any] = {}
    if args.overhead or args.profile:
        from .overhead import measure_overhead, profile_ticks

        engine = engine or make_engine(args, model, tokenizer)
        if args.overhead:
            ov = measure_overhead(engine, args.max_batch_size, args.overhead_prompt_len,
                                  args.overhead_ticks)
            extra["overhead"] = ov
            print(f"\nengine overhead at B={ov['batch_size']}, prompt {ov['prompt_len']}: tick "
                  f"{ov['tick_ms']:.1f} ms vs bare forward {ov['bare_forward_ms']:.1f} ms -> "
                  f"{ov['overhead_pct']:.1f}% (fastest steps: {ov['overhead_pct_min']:.1f}%; "
                  f"outside the forward within the tick: {ov['outside_forward_pct']:.1f}%)")
        if args.profile:
            print(profile_ticks(engine, args.max_batch_size, args.overhead_prompt_len))
    j = write_json(out / f"{name}.json", payload(workload, runs, extra))
    h = write_html(out / f"{name}.html", runs, f"minserve bench: {name}", workload.describe())
    print(f"\nwrote {j} and {h}")
    return 0
