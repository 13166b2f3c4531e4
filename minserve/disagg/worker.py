"""The prefill worker: a process of its own that computes prompts' KV (SPEC C4, H8).

`serve_prefills` is the whole worker. It runs in a child process started by
`process.WorkerProcess` (torch.multiprocessing, "spawn": a fresh interpreter, its own
torch threads), and computes what the decode side's T2 sends it: the prompt pieces of one
tick, as chunked prefill computes them on the decode side (one forward for all of them),
only here, a tick or two ahead of the stream:

    decode process (connector.py)                this process
    ─────────────────────────────                ────────────
    pipe: the payload (model, pools)        ──►  ("alive", pid) ... ("ready", pid)
    ("batch", n, [(rid, ids, start,         ──►  ("start", n); ONE forward of the pieces
                   table, slot), ...],           over the staging pool, at the blocks each
            tokens)                              `table` names, padded to `tokens`; a final
                                                 piece (slot >= 0): its last token's
                                                 logits -> logits[slot]
                                            ◄──  ("done", n, seconds, errors, dropped)
    ("drop", rid)                           ──►  the row's pieces still queued here are
                                                 skipped (its client left)
    None                                    ──►  exit

Two planes, as in every KV connector (vLLM's NIXL, SGLang's Mooncake):
* control: small messages (ids, block numbers, strings): a queue here, a pipe back;
* data: tensors this process received once, at its start, and writes in place: the
  staging pool (`KVBlockStorage`, in shared memory) and the logits buffer (slots, V).
  No KV ever goes through a queue.

The decode side owns the staging pool's allocation: it names the blocks of each row and
has already copied the prompt's cached prefix into the first of them, so this worker
needs no cache and no block manager. A forward that raises is run again piece by piece,
and only the pieces that raise alone are answered with an error.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import traceback
from collections import deque


def serve_prefills(load, jobs, results, threads: int) -> None:
    """The worker's main loop (module-level: "spawn" imports it by name). `load`: the read
    end of the pipe the payload comes down; `jobs`: the queue of this side's messages;
    `results`: the write end of the pipe for ours (each sent at once, no feeder thread)."""
    import signal

    # The terminal's signals are for the process that started us: Ctrl-C (or Jupyter's
    # "interrupt the kernel") and a hangup go to the whole process group, and a worker
    # that died of one would cost a restart. They were blocked while we started
    # (process.terminal_signals_blocked): ignore them, then let others through.
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGHUP})
    _exit_with_parent()
    results.send(("alive", os.getpid()))
    try:
        from multiprocessing.reduction import ForkingPickler

        import torch

        from ..backends.paged import install_paged_attention
        from ..fast import compact

        torch.set_num_threads(threads)  # its own share of the cores, whatever the parent uses
        model, runner_kind, max_model_len, staging, logits, pad_table = \
            ForkingPickler.loads(load.recv_bytes())
        load.close()
        runner = compact.runner_for(runner_kind, model, max_model_len)
        if runner is None:
            install_paged_attention(model)  # the registry is per process: register it here too
    except Exception as e:  # say why before dying: the engine's constructor raises with it
        results.send(("failed", traceback.format_exception_only(type(e), e)[-1].strip()))
        raise
    results.send(("ready", os.getpid()))
    waiting: deque = deque()  # batches read off the queue, not yet computed
    while True:
        # Read everything the decode side sent since the last forward, so that a "drop"
        # reaches the pieces queued before it (the queue is first in, first out); wait
        # while there is no batch (a "drop" alone is not one).
        try:
            while True:
                msg = jobs.get(block=not waiting)
                if msg is None:
                    return
                if msg[0] == "drop":
                    for *_, dropped in waiting:
                        dropped.add(msg[1])
                else:
                    waiting.append((*msg[1:], set()))  # (n, pieces, tokens, its dropped rids)
        except queue.Empty:
            pass
        n, pieces, tokens, dropped = waiting.popleft()
        keep = [p for p in pieces if p[0] not in dropped]
        results.send(("start", n))
        t0 = time.perf_counter()
        pad = (0, [], 0, pad_table, -1)  # a row of padding: pad blocks only, no logits
        errors = compute(model, runner, staging, logits, keep, pad, tokens)
        if staging.device.type == "cuda":
            torch.cuda.synchronize(staging.device)  # the KV is in the pool before "done" is read
        results.send(("done", n, time.perf_counter() - t0, errors,
                     sum(len(p[1]) for p in pieces if p[0] in dropped)))


def forward_tokens(n: int, cap: int) -> int:
    """The tokens a forward of `n` prompt tokens is padded to: a power of two up to 64,
    then a multiple of 64, never past `cap` (a full budget's forward is not padded).

    Why pad at all. The compact forward's linear layers (fast/compact.py, oneDNN with
    prepacked weights) keep what they build for every new number of rows, and prompt
    pieces come in every size: a worker whose forwards had any of 2,000 token counts
    grew from 268 to 747 MiB of private memory over 400 prompts on the tiny model (its
    decode side, few shapes, stayed flat). With these shapes there are at most
    7 + cap / 64 of them, and its memory stays flat once each has been seen."""
    padded = 1 << (n - 1).bit_length() if n <= 64 else -(-n // 64) * 64
    return max(n, min(padded, cap))


def compute(model, runner, staging, logits, pieces, pad, tokens) -> dict[str, str]:
    """The pieces in ONE forward (as `PagedBackend.forward_mixed` runs a tick's chunks),
    padded to `tokens` with a row of `pad` (its own blocks, its KV never read); if it
    raises, each piece alone, so that only a piece that fails alone is answered with an
    error: {request id: the error's line}. Writing a piece's KV twice writes the same
    floats: the forward that raised leaves nothing the retry can read wrong."""
    if not pieces:
        return {}
    n = sum(len(p[1]) for p in pieces)
    padding = [(pad[0], [0] * (tokens - n), *pad[2:])] if tokens > n else []
    try:
        forward_pieces(model, runner, staging, logits, pieces + padding)
        return {}
    except Exception as e:
        if len(pieces) == 1:
            return {pieces[0][0]: traceback.format_exception_only(type(e), e)[-1].strip()}
    errors = {}
    for p in pieces:
        errors.update(compute(model, runner, staging, logits, [p], pad,
                              forward_tokens(len(p[1]), len(p[1]))))
    return errors


def forward_pieces(model, runner, staging, logits, pieces) -> None:
    """One forward over pieces `(rid, ids, start, table, slot)`, flattened:

        flat tokens   [ p0 p1 ... p6 | q0 ... q6 | r0 ... r31 ]    equal lengths side by
        positions     [ 0  1  ... 6  | 96 ... 102| 0  ...  31 ]    side: one RowGroup

    Each piece attends over its own row's staging blocks, causally. The last token's
    logits of every final piece (slot >= 0) go to `logits[slot]`."""
    import torch

    from ..backends.paged import PagedForward, run_paged

    dev = staging.device
    order = sorted(pieces, key=lambda p: len(p[1]))  # equal lengths consecutive (RowGroups)
    rows, ids, positions, last = [], [], [], []
    for _, toks, start, table, _ in order:
        rows.append((table, start, len(toks)))
        ids.extend(toks)
        positions.extend(range(start, start + len(toks)))
        last.append(len(ids) - 1)
    finals = [(k, p[4]) for k, p in enumerate(order) if p[4] >= 0]
    ctx = PagedForward.build_rows(staging, rows)
    ids_t = torch.tensor([ids], device=dev)  # (1, N)
    pos_t = torch.tensor([positions], device=dev)  # (1, N)
    if len(ctx.groups) == 1:  # a plain batch of B rows x T tokens: run it as (B, T)
        g = ctx.groups[0]
        out = run_paged(model, runner, ids_t.view(g.B, g.T),
                        pos_t.view(g.B, g.T), ctx, 1)[:, -1]  # (B, V)
        at = {k: k for k, _ in finals}
    else:  # flat (1, N): only the final pieces' last tokens go through the output head
        keep = torch.tensor([last[k] for k, _ in finals] or [len(ids) - 1], device=dev)
        out = run_paged(model, runner, ids_t, pos_t, ctx, keep)[0]  # (len(finals) or 1, V)
        at = {k: j for j, (k, _) in enumerate(finals)}
    for k, slot in finals:
        logits[slot].copy_(out[at[k]])


def _exit_with_parent() -> None:
    """A thread that ends this process when its parent is gone, however it went (kill -9
    included): multiprocessing's parent sentinel becomes readable then. The worker holds
    shared memory as large as the decode side's KV pool; an orphan would keep it."""
    import multiprocessing
    from multiprocessing.connection import wait

    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="minserve-prefill-watchdog", daemon=True).start()
