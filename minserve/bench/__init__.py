"""Benchmarks: experiments that measure and print figures; tests check behaviour (never timings).

`minserve bench [EXPERIMENT] [options]` runs one (`--list` names them; the default,
`serving`, replays a workload against minserve and its Hugging Face peers and is
declared in minserve/peers/serving.py, beside those peers). An outer layer.

    cli.py        the command: the list of experiments, their options, `--list`
    registry.py   what an experiment is (a function with declared options) and the `Bench`
                  it receives: the model loaded once, engines on it, the docs writers
    timing.py     the timing discipline, once: warm-up, interleaving, medians, conditions
    workload.py   the load generator: arrivals (Poisson / gamma / closed loop), lengths, sessions
    targets.py    what a workload is replayed against: the in-process engine, through the
                  driver that peers/'s HTTP target shares
    metrics.py    TTFT, ITL, TPOT, e2e, throughput, per session, Jain's index, refusals by gate
    report.py     markdown tables, each experiment's docs section
    health.py     waiting for a `minserve serve` subprocess to answer /health (shares.py,
                  and the scripts that drive a server from outside)

The experiments of the engine, one concept per file: throughput.py, kv.py,
scheduling.py, admission.py, forward.py, attention.py, gpu.py, overhead.py (a decode
tick against a bare forward, which `serving` reports).

    from minserve.bench.workload import make_workload
    from minserve.bench.targets import EngineTarget
    run = EngineTarget(engine).run(make_workload(32, rate=1.0))
    run.summary()["ttft"]["p99"]

May import: the core and its front (it builds Engines), its own modules,
`minserve.fast` (forward.py and attention.py time its parts against the readable
versions), `minserve.chat` (the demo-wait experiment measures the demo's own logic,
not a copy of it) and `minserve.figures` (experiments record the figures the docs
quote); never `minserve.server`. Not `minserve.peers` either, which builds on this
layer: only the command (cli.py), which lists every experiment, imports the one peers/
declares (`serving`). Imported by `minserve.peers` and `minserve.labs`; never by the core.
"""
