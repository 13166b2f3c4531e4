"""The prefill worker: a process of its own that computes prompts' KV (SPEC C2, disaggregated).

This function is the whole worker. It runs in a child process started by
`connector.PrefillWorker` (torch.multiprocessing, "spawn": a fresh interpreter, its own
torch threads), and loops over jobs:

    decode process                               this process
    ──────────────                               ────────────
    jobs.put(("prefill", rid, ids, start,   ──►  ("start", rid)   ──► results
              table, slot, chunk))               forwards of ids[start:], `chunk` tokens
                                                 each, over the staging pool, at the
                                                 blocks `table` names
                                                 logits of the last token -> logits[slot]
                                         ◄──     ("done", rid, seconds)  or ("error", rid, why)

Two planes, as in every KV connector (vLLM's NIXL, SGLang's Mooncake):
* control: small messages (ids, block numbers, strings) on two multiprocessing queues;
* data: tensors this process received once, at its start, and writes in place: the
  staging pool (`KVBlockStorage`, in shared memory) and the logits buffer (slots, V).
  No KV ever goes through a queue.

The decode side owns the staging pool's allocation: it names the blocks of each job and
has already copied the prompt's cached prefix (tokens 0..start-1) into the first of them,
so this worker needs no cache and no block manager: one job, its forwards, the staging
blocks written, the logits parked. A job that raises is answered with its error alone;
the worker goes on with the next. `None` on the job queue ends it.
"""

from __future__ import annotations

import os
import time
import traceback


def serve_prefills(model, runner_kind: str, max_model_len: int, staging, logits, jobs, results,
                   threads: int) -> None:
    """The worker's main loop (module-level: "spawn" imports it by name)."""
    import signal

    import torch

    from ..backends.paged import PagedForward, install_paged_attention, run_paged

    # Ctrl-C is for the process that started us: a terminal (or Jupyter's "interrupt the
    # kernel") signals the whole process group, and a worker that died of it would fail
    # the prompts it held and use up a restart. The decode side stops it (`close`).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from ..fast import compact

    torch.set_num_threads(threads)  # its own share of the cores, whatever the parent uses
    runner = compact.runner_for(runner_kind, model, max_model_len)
    if runner is None:
        install_paged_attention(model)  # the registry is per process: register it here too
    results.put(("ready", os.getpid()))
    while (job := jobs.get()) is not None:
        _, rid, ids, start, table, slot, chunk = job
        results.put(("start", rid))
        t0 = time.perf_counter()
        try:
            dev = staging.device
            # The prompt in pieces of `chunk` tokens, one forward each, every piece attending
            # over the KV the earlier ones wrote (chunked prefill, here where no stream waits
            # for it: on a CPU a 3,500-token prompt's attention costs more in one forward).
            for a in range(start, len(ids), chunk):
                b = min(a + chunk, len(ids))
                ctx = PagedForward.build_rows(staging, [(table, a, b - a)])  # one row
                out = run_paged(model, runner, torch.tensor([ids[a:b]], device=dev),
                                torch.arange(a, b, device=dev)[None], ctx, 1)  # (1, 1, V)
            logits[slot].copy_(out[0, -1])
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)  # the KV is in the pool before "done" is read
            results.put(("done", rid, time.perf_counter() - t0))
        except Exception as e:  # this prompt alone: the worker takes the next job
            line = traceback.format_exception_only(type(e), e)[-1].strip()
            results.put(("error", rid, line))
