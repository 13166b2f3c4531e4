"""Disaggregated prefill (SPEC C2, C4): prompts on a worker process of their own, their KV
moved to the decode side at the promotion (C3). An outer layer, like `fast/`: the engine
builds it for `prefill_mode="disaggregated"` and hands it to the scheduler (`remote`);
the core never imports it.

May import: the core, and `fast/` (the worker runs the forward the decode side runs:
the compact one where `model_runner` asks for it).

    connector.py  the decode side: T2's pieces shared between tenants (C5, H6), poll,
                  splice the KV in (C3), faults, abandoned prompts, health (H8)
    process.py    the worker's life: a start that cannot hang, restarts per window,
                  the terminal's signals, exit with the parent (H8)
    worker.py     the worker process: one forward per batch of pieces, a shared staging pool

Lesson: notebooks/08_disaggregated_prefill.ipynb. Design: docs/backends.md.
"""
