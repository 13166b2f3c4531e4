"""The same math, faster on a CPU: what `minserve serve` runs by default. An outer layer.

Nothing here is needed to read or run the engine. The paged backend computes a
forward with Hugging Face's own model and attends in plain PyTorch (the readable
versions, and the lessons' defaults); this package offers it two drop-in parts with
the same results, which it takes as constructor arguments (`PagedBackend(runner=...,
kernel=...)`), so the core never imports them:

    compact.py        `model_runner="compact"`: the Llama family's forward written out
                      (fused, prepacked weights; logits only where a token is sampled)
    decode_kernel.py  `decode_attention="kernel"`: a decode step's attention in C
    decode_kernel.c   (each row's blocks read in place), built on first use

`"auto"` takes each where it can run and the readable version elsewhere.
`Engine` picks them from its config (`compact.runner_for`, `decode_kernel.kernel_for`).
HF `generate` stays the oracle: tests/test_compact.py and tests/test_decode_kernel.py
check both token-exact against it; docs/benchmarks.md measures what they save.

May import: the core, and `minserve.models` (the cache folder the kernel is built
into). Imported by the engine's front (`engine.py`) and by `minserve.bench`.
"""
