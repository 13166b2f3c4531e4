"""Benchmarks: experiments that measure and print figures; tests check behaviour (never timings).

`minserve bench [EXPERIMENT] [options]` runs one (`--list` names them; the default,
`serving`, replays a workload against minserve and its Hugging Face peers). An outer layer.

    cli.py        the command: the list of experiments, their options, `--list`
    registry.py   what an experiment is (a function with declared options) and the `Bench`
                  it receives: the model loaded once, engines on it, the docs writers
    timing.py     the timing discipline, once: warm-up, interleaving, medians, conditions
    workload.py   the load generator: arrivals (Poisson / gamma / closed loop), lengths, sessions
    targets.py    what a workload is replayed against: the in-process engine, any OpenAI URL
    hf.py         the peers in process: HF static `generate` and continuous batching
    metrics.py    TTFT, ITL, TPOT, e2e, throughput, per session, Jain's index, refusals by gate
    report.py     JSON, plotly HTML, markdown tables, each experiment's docs section

The experiments, one concept per file: serving.py (+ overhead.py), throughput.py,
kv.py, scheduling.py, admission.py, forward.py, attention.py, gpu.py.

    from minserve.bench.workload import make_workload
    from minserve.bench.targets import EngineTarget
    run = EngineTarget(engine).run(make_workload(32, rate=1.0))
    run.summary()["ttft"]["p99"]

May import: the core and its front (it builds Engines), its own modules,
`minserve.fast` (forward.py and attention.py time its parts against the readable
versions), `minserve.chat` (the demo-wait experiment measures the demo's own logic,
not a copy of it) and `minserve.figures` (experiments record the figures the docs
quote); targets.py speaks HTTP to any OpenAI-compatible server through httpx, never
through `minserve.server`. Imported by `minserve.peers` and `minserve.labs`;
never by the core.
"""
