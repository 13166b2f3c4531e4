"""The same math, faster: the parts `minserve serve` runs by default. An outer layer.

Nothing here is needed to read or run the engine. The paged backend computes a
forward with Hugging Face's own model and attends in plain PyTorch, the padded one
keeps HF's own cache (the readable versions); this package offers them drop-in parts
with the same results, which they take as constructor arguments
(`PagedBackend(runner=..., kernel=...)`, `PaddedBackend(decode_layer=...)`), so the
core never imports them:

    compact.py        `model_runner="compact"`: the Llama family's forward written out
                      (fused, prepacked weights; logits only where a token is sampled)
    decode_kernel.py  `decode_attention="kernel"`: a decode step's attention in C
    decode_kernel.c   (each row's blocks read in place), built on first use; a decode
                      step's matmuls on weights packed in panels (compact's `Linear`
                      up to 64 rows), and with both, a step of up to 32 rows with
                      every layer in C (`decode_in_c`)
    in_place_cache.py the padded backend's decode batch grown in place, not copied
                      every step (`PaddedBackend(decode_layer=...)`)
    cuda_graphs.py    `cuda_graphs="auto"`: on a GPU, the compact forward's decode step
                      replayed from CUDA graphs, one per batch-size bucket
                      (`PagedBackend(graphs=...)`; docs/gpu.md)

`"auto"` takes each where it can run and the readable version elsewhere. `Engine`
picks the first two and the fourth from its config (`compact.runner_for`,
`decode_kernel.kernel_for`, `cuda_graphs.graphs_for`) and always gives the padded
backend the third. HF `generate` stays the oracle:
tests/test_compact.py and tests/test_decode_kernel.py check the first two token-exact
against it, tests/test_padded_backend.py the third against HF's own cache layer;
docs/benchmarks.md measures what the first two save.

May import: the core, and `minserve.models` (the cache folder the kernel is built
into). Imported by the engine's front (`engine.py`) and by `minserve.bench`.
"""
