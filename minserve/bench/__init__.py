"""Benchmarks: they measure and print figures; tests check behaviour (never timings).

`minserve bench`: minserve against its peers, one file per concept. An outer layer.

    workload.py   the load generator: arrivals (Poisson / gamma / closed loop), lengths, sessions
    targets.py    what a workload is replayed against: the in-process engine, any OpenAI URL
    peers.py      Hugging Face static `generate` and continuous batching, same model, same process
    metrics.py    TTFT, ITL, TPOT, e2e, throughput, per session, Jain's index, refusals by gate
    overhead.py   a decode tick vs a bare batched forward (the physical floor)
    report.py     JSON, plotly HTML, markdown tables of ratios to minserve
    runner.py     the building blocks of a run (load, engine, workload, replay, print)
    cli.py        the `minserve bench` command; suite.py: the runs behind docs/benchmarks.md

    from minserve.bench.workload import make_workload
    from minserve.bench.targets import EngineTarget
    run = EngineTarget(engine).run(make_workload(32, rate=1.0))
    run.summary()["ttft"]["p99"]

`sched_bench.py` is the scheduling benchmark, `kv_bench.py` the KV-cache one,
`decode_throughput.py` the decode-throughput one; `compact_bench.py` times a decode
tick of the HF model against the compact forward and the weight-matmul floor; `demo_wait.py` times the chat
demo's light user under its flood (docs/demo.md); `docs_report.py` writes each
benchmark's own section of docs/benchmarks.md.

May import: the core and its front (it builds Engines), its own modules,
`minserve.fast` (`attention_bench.py` and `linear_bench.py` time its parts against
the readable versions) and `minserve.chat` (`demo_wait.py` measures the demo's
own logic, not a copy of it); `targets.py` speaks HTTP to any OpenAI-compatible
server (minserve's or another) through httpx, never through `minserve.server`.
Never imported by the core.
"""
