"""Disaggregated prefill (SPEC C2): prompts on a worker process of their own, their KV
moved to the decode side at the promotion (C3). An outer layer, like `fast/`: the engine
builds it for `prefill_mode="disaggregated"` and hands it to the scheduler (`remote`);
the core never imports it.

May import: the core, and `fast/` (the worker runs the forward the decode side runs:
the compact one where `model_runner` asks for it).

    connector.py  the decode side: send prompts, poll, splice the KV in, faults, timeouts
    worker.py     the worker process: one forward per prompt over a shared staging pool

Lesson: notebooks/08_disaggregated_prefill.ipynb. Design: docs/backends.md.
"""
