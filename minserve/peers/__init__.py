"""The other servers, side by side with minserve over HTTP (docs/benchmarks.md, "Side by side").

Not an experiment of the engine but the room around one: other programs started as
processes, driven with the bench's own client, their flags kept honest. An outer layer.

    servers.py       minserve serve, vLLM's CPU build, `transformers serve`: started on a
                     free port, waited for, stopped with their whole process group
    side_by_side.py  `make peers-bench`: one workload at several rates, sent as 32 users and
                     without `user`; capacity under an SLO
    phenomena.py     lessons 03 and 06's phenomena on minserve and vLLM, one flag at a time
    vllm_flags.py    the vLLM flags docs/outgrowing.md names, against vLLM's own --help

Why not `minserve bench`: these need a second virtual environment (vLLM's torch is not
ours, scripts/peers_setup.sh makes it) and run for most of an hour; an experiment of the
engine runs in this process on this install.

May import: the core, the front and `minserve.bench` (the workloads, the HTTP target,
the metrics, the docs-section writer and the timing conditions, so a side-by-side
figure is taken as every other). Imported by nothing in the package.
"""
