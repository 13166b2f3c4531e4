"""minserve beside its peers: what a user would run instead, and the runs that compare them.

What minserve is measured against rather than a part of the engine (docs/benchmarks.md):
Hugging Face serving the same model in this process, other programs started as
processes, their flags kept honest, and the runs that put minserve beside them, driven
with the bench's own registry, workloads and driver. An outer layer.

    hf.py            the peers in process: HF static `generate` and continuous batching
    openai_target.py any OpenAI-compatible server as a target, over streaming HTTP
    serving.py       `minserve bench` (its default experiment, `serving`): one workload
                     against minserve and the HF peers, or against any OpenAI URL
    served.py        `minserve bench served-token`: where a streamed token's time goes in
                     `minserve serve` (its spans), with side_by_side's client and workload
    run_report.py    that run's files: JSON per request, the plotly HTML report
    servers.py       minserve serve, vLLM's CPU build, `transformers serve`: started on a
                     free port, waited for, stopped with their whole process group
    side_by_side.py  `make peers-bench`: one workload at several rates, sent as 32 users and
                     without `user`; capacity under an SLO
    phenomena.py     lessons 03 and 06's phenomena on minserve and vLLM, one flag at a time
    vllm_flags.py    the vLLM flags docs/outgrowing.md names, against vLLM's own --help

Why `make peers-bench` is not an experiment of `minserve bench`: it needs a second
virtual environment (vLLM's torch is not ours, scripts/peers_setup.sh makes it) and runs
far longer (the README says how long); `serving` runs in this process on this install.

May import: the core, the front and `minserve.bench` (the registry, the workloads, the
targets, the metrics, the docs-section writer and the timing conditions, so a figure
beside a peer is taken as every other); never `minserve.server`: openai_target.py speaks
HTTP to any server through httpx. Imported by bench's command alone (cli.py lists
`serving` and `served-token`), which imports nothing else of this layer.
"""
