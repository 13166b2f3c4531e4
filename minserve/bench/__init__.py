"""Benchmarks: they measure and print figures; tests check behaviour (never timings).

`minserve bench` (issue 8) -- minserve against its peers, one file per concept:

    workload.py   the load generator: arrivals (Poisson / gamma / closed loop), lengths, sessions
    targets.py    what a workload is replayed against: the in-process engine, any OpenAI URL
    peers.py      Hugging Face static `generate` and continuous batching, same model, same process
    metrics.py    TTFT, ITL, TPOT, e2e, throughput, per session, Jain's index, refusals by gate
    overhead.py   a decode tick vs a bare batched forward (the physical floor)
    report.py     JSON, plotly HTML, markdown tables of ratios to minserve
    cli.py        the `minserve bench` command; suite.py: the runs behind docs/benchmarks.md

    from minserve.bench.workload import make_workload
    from minserve.bench.targets import EngineTarget
    run = EngineTarget(engine).run(make_workload(32, rate=1.0))
    run.summary()["ttft"]["p99"]

`sched_bench.py` (issue 4) is the scheduling benchmark; `docs_report.py` writes
each benchmark's own section of docs/benchmarks.md.
"""
