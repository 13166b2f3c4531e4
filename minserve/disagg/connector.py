"""The decode side's end of disaggregated prefill: send prompts, take their KV back (SPEC C2, C3).

DistServe (Zhong et al., OSDI 2024) and Splitwise (Patel et al., ISCA 2024) run prompts
and decode steps on different workers, so that a long prompt never stalls a stream:
the decode batch ticks on while the prompt is computed elsewhere, and the prompt's KV
is moved over when it is done. `PrefillWorker` is that "elsewhere" for one engine: a
process (worker.py) with its own torch threads, and the decode side's handle on it.

    T1 admit (unchanged)     T2 (execute.run_remote)               at the promotion (C3)
    ────────────────────     ───────────────────────               ─────────────────────
    reserve, allocate the    send(req): staging blocks for the     splice(req): the staging
    row's decode blocks,     prompt, its cached prefix copied in,  blocks' KV -> the row's
    open its staging row     a job on the queue                    decode blocks, block by
                             poll(): the rows whose KV is ready    block; then it decodes
                             (their first token is sampled here,
                             from the worker's logits)

The transport is torch.multiprocessing (docs/backends.md, "Disaggregated prefill"): the
staging pool and a logits buffer live in shared memory (on a GPU: CUDA IPC), handed to
the worker once at its start; each job is a small message. The decode side owns every
allocation: it picks a job's staging blocks and logits slot and frees them when it has
spliced the KV in, when the row is gone and the worker has answered, or when the
worker is gone. So the worker never writes a block that someone else may hold.

Faults, each ending only the rows they touch (SPEC H5):
* the worker raises on one prompt: that row fails with the worker's error;
* the worker dies: the rows it held fail ("the prefill worker died"); it is restarted,
  up to `MAX_RESTARTS` times, after which this engine refuses new prompts, saying so;
* the worker holds prompts and says nothing for `timeout_s` (it reports the start and
  the end of every prompt: so one prompt took that long, or it hangs), or it does not
  start within `BOOT_S`: it is killed and restarted, the rows it held fail. Nothing
  waits forever.
"""

from __future__ import annotations

import os
import pickle
import queue
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..backends.kv_storage import KVBlockStorage
from ..kv_cache import BlockManager, NoFreeBlocksError
from ..request import Request


def settle(device: torch.device) -> None:
    """Wait until the copies this process queued on `device` are done, before another
    process is told it may use that memory. On a GPU, a copy is only queued when
    `copy_blocks` returns; the worker (another process, its own CUDA context and streams,
    the staging pool shared through CUDA IPC) does not wait for this process's queue, so
    without this it could read a prefix block not yet written, or write a staging block
    this side is still reading. The worker does the same before it answers (worker.py).
    On a CPU every copy is done when it returns: nothing to wait for."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class RemotePrefillError(RuntimeError):
    """Why a row's remote prefill failed: the worker's error, its death, or a timeout."""


@dataclass
class Job:
    """One prompt on (or on its way to) the worker."""

    req: Request
    table: list[int]  # its blocks in the staging pool: the whole prompt, prefix first
    slot: int  # its row of the logits buffer
    start: int  # tokens 0..start-1 were cached on the decode side and copied in
    sent_at: float
    bytes_to_worker: int  # the cached prefix's KV, copied into the staging blocks
    started_at: float | None = None  # the worker took it: being computed
    compute_s: float | None = None  # the worker's forward, once done
    abandoned: bool = False  # the row is gone: free the job's memory when the worker is done


@dataclass
class PrefillWorker:
    """A prefill worker process and everything the decode side keeps about it.

    `storage`, `block_manager`: the decode side's pool and tables (the rows' blocks);
    `staging_blocks`: the staging pool's size (default: as many as the decode pool, so
    any admitted prompt fits); `max_jobs`: prompts on the worker at once (the logits
    buffer's rows); `threads`: the worker's torch threads; `timeout_s`: how long one
    prompt may take on the worker."""

    MAX_RESTARTS = 3
    BOOT_S = 120.0  # how long a worker may take to start (spawn, import torch, load): a
    # loaded 2-core machine needs tens of seconds, far more than a short prefill timeout

    model: torch.nn.Module
    storage: KVBlockStorage
    block_manager: BlockManager
    runner_kind: str = "hf"
    max_model_len: int = 2048
    max_jobs: int = 8
    threads: int = 1
    timeout_s: float = 120.0
    staging_blocks: int | None = None
    chunk_tokens: int = 512  # the worker computes a prompt in forwards of this many tokens
    jobs: dict[str, Job] = field(default_factory=dict)  # sent, not yet answered
    arrived: dict[str, Job] = field(default_factory=dict)  # KV ready in staging, not spliced
    transfers: dict[str, dict[str, Any]] = field(default_factory=dict)  # splices, for the records
    broken: str | None = None  # why this engine takes no more prompts (worker died too often)

    def __post_init__(self) -> None:
        s = self.storage
        n = self.staging_blocks or s.num_blocks
        self.staging = KVBlockStorage(n, s.block_size, s.num_layers, s.num_kv_heads, s.head_dim,
                                      s.dtype, s.device).share_memory_()
        self.staging_bm = BlockManager(n, s.block_size, enable_prefix_caching=False)
        vocab = self.model.get_output_embeddings().out_features
        self.logits = torch.zeros(self.max_jobs, vocab).share_memory_()  # (slots, V) float32
        self.free_slots = list(range(self.max_jobs))
        self.counters = {"prompts": 0, "prompt_tokens": 0, "bytes_to_worker": 0,
                         "bytes_from_worker": 0, "transfer_s": 0.0, "compute_s": 0.0,
                         "errors": 0, "deaths": 0, "timeouts": 0, "restarts": 0}
        self.proc = None
        self._start()

    # ------------------------------------------------------------- the process
    def _start(self) -> None:
        """Start a worker (asynchronously: it loads in the background while the decode
        side ticks on; jobs sent meanwhile wait on its queue)."""
        import torch.multiprocessing as mp

        from .worker import serve_prefills

        ctx = mp.get_context("spawn")  # a fresh interpreter: no fork of this process's threads
        self._jobs, self._results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=serve_prefills, name="minserve-prefill", daemon=True,
                                args=(self.model, self.runner_kind, self.max_model_len,
                                      self.staging, self.logits, self._jobs, self._results,
                                      self.threads))
        # The worker's OpenMP threads wait passively (sleep, not spin) between parallel
        # regions, so that they give a core the decode side needs back at once: with them
        # spinning, a stream beside a 3,500-token prompt had gaps of 2.3x its TPOT, with
        # them asleep 1.6x (`minserve bench disaggregated`). Read by OpenMP when the child
        # loads torch, so it is in the environment the child starts with, and only there.
        saved = os.environ.get("OMP_WAIT_POLICY")
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        try:
            self.proc.start()  # pickles the model for the child: a patched one may refuse
        except (AttributeError, TypeError, pickle.PicklingError) as e:
            raise ValueError(f"the model cannot be sent to the prefill worker process "
                             f"({type(e).__name__}: {e}); prefill_mode='disaggregated' needs "
                             "a model that pickles (no local functions patched into it)") from e
        finally:
            if saved is None:
                os.environ.pop("OMP_WAIT_POLICY", None)
        self.booted_at, self.ready = time.perf_counter(), False
        self.last_heard = self.booted_at

    def _restart(self, why: str) -> list[tuple[str, str]]:
        """The worker is gone (or killed): fail the rows it held, free what they held in
        staging, start another (or stop taking prompts after MAX_RESTARTS)."""
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.join(5)
        failed = [(rid, why) for rid, job in self.jobs.items() if not job.abandoned]
        for job in list(self.jobs.values()):
            self._free(job)
        self.jobs.clear()
        if self.counters["restarts"] >= self.MAX_RESTARTS:
            self.broken = (f"the prefill worker failed {self.counters['restarts'] + 1} times "
                           f"(last: {why}); this engine takes no new prompts: restart it")
            self.proc = None
            return failed
        self.counters["restarts"] += 1
        self._start()
        return failed

    def close(self) -> None:
        """Stop the worker (idempotent)."""
        if self.proc is not None and self.proc.is_alive():
            try:
                self._jobs.put(None)
                self.proc.join(5)
            finally:
                if self.proc.is_alive():
                    self.proc.kill()
                    self.proc.join(5)
        self.proc = None

    # ------------------------------------------------------------- the scheduler's calls
    def holds(self, request_id: str) -> bool:
        """Is this row's prompt on the worker, or its KV waiting to be spliced?"""
        return request_id in self.jobs or request_id in self.arrived

    def send(self, req: Request) -> str | None:
        """Put the row's prompt on the worker's queue. Returns None when sent, else why it
        waits (no staging blocks or logits slot free yet: it is sent in a later tick).
        The cached prefix (req.num_cached_tokens) is copied into the first staging blocks,
        so the worker computes only the rest."""
        if self.broken:
            raise RemotePrefillError(self.broken)
        if self.proc is None:
            self._start()
        rid, ids = req.request_id, list(req.prefill_token_ids)
        if not self.free_slots:
            return f"the prefill worker holds {self.max_jobs} prompts (its logits slots)"
        try:
            self.staging_bm.allocate_prompt(rid, ids)
        except NoFreeBlocksError:
            return (f"the prefill worker's staging pool has {self.staging_bm.num_free_blocks()} "
                    f"free blocks, {self.staging_bm.num_blocks_for(len(ids))} needed")
        table = self.staging_bm.block_table(rid)
        start = req.num_computed_prompt_tokens  # the cached prefix: whole blocks (K1)
        n = start // self.storage.block_size
        sent = self.staging.copy_blocks(self.storage, self.block_manager.block_table(rid)[:n],
                                        table[:n]) if n else 0
        if n:  # the worker reads these blocks as soon as it takes the job
            settle(self.staging.device)
        if not self.jobs:  # an idle worker's silence so far is not a hang
            self.last_heard = time.perf_counter()
        job = Job(req, table, self.free_slots.pop(), start, time.perf_counter(), sent)
        self.jobs[rid] = job
        self._jobs.put(("prefill", rid, ids, start, table, job.slot, self.chunk_tokens))
        self.counters["bytes_to_worker"] += sent
        return None

    def wait_ready(self) -> bool:
        """Wait (at most `timeout_s`) until the worker has loaded; False if it has not."""
        while not self.ready and self.proc is not None and self.proc.is_alive():
            if time.perf_counter() - self.booted_at > max(self.timeout_s, self.BOOT_S):
                return False
            try:
                msg = self._results.get(timeout=0.1)
            except queue.Empty:
                continue
            self.ready = self.ready or msg[0] == "ready"
        return self.ready

    def poll(self, wait_s: float = 0.0) -> tuple[list[tuple[Request, torch.Tensor]],
                                                 list[tuple[str, str]]]:
        """What the worker answered since the last call: ([(row, its last token's logits
        (V,))], [(request id, why it failed)]). `wait_s` > 0: wait that long for a first
        answer (a decode side with nothing to decode has nothing better to do)."""
        done, failed = [], []
        while True:
            try:
                if wait_s > 0 and not done and not failed:
                    msg, wait_s = self._results.get(timeout=wait_s), 0.0
                else:
                    msg = self._results.get_nowait()
            except (queue.Empty, OSError, EOFError):
                break
            self.last_heard = time.perf_counter()
            kind, rid = msg[0], msg[1]
            job = self.jobs.get(rid) if kind != "ready" else None
            if kind == "ready":
                self.ready = True
            elif job is None:
                continue  # an answer for a job a restart already failed
            elif kind == "start":
                job.started_at = time.perf_counter()
            elif kind == "done":
                job.compute_s = msg[2]
                del self.jobs[rid]
                self.counters["compute_s"] += msg[2]
                if job.abandoned:
                    self._free(job)
                else:
                    self.arrived[rid] = job
                    done.append((job.req, self.logits[job.slot].clone()))
            else:  # "error": this prompt alone
                del self.jobs[rid]
                self._free(job)
                self.counters["errors"] += 1
                if not job.abandoned:
                    failed.append((rid, f"the prefill worker raised on this prompt: {msg[2]}"))
        failed += self._check_health()
        return done, failed

    def _check_health(self) -> list[tuple[str, str]]:
        """The worker died, hangs on a prompt, or never started: restart it."""
        if self.proc is None:
            return []
        now = time.perf_counter()
        if not self.proc.is_alive():
            self.counters["deaths"] += 1
            return self._restart(f"the prefill worker died (exit code {self.proc.exitcode}) "
                                 "while it held this prompt")
        # Silent for timeout_s while it holds prompts: one prompt took that long, or it
        # hangs (it says "start" and "done" for every prompt, so a busy worker is heard).
        hung = self.ready and self.jobs and now - self.last_heard > self.timeout_s
        if hung or (not self.ready and now - self.booted_at > max(self.timeout_s, self.BOOT_S)):
            self.counters["timeouts"] += 1
            return self._restart(f"the prefill worker did not finish a prompt within "
                                 f"{self.timeout_s:g} s (timeout_s); it was restarted")
        return []

    def splice(self, req: Request, backend) -> dict[str, Any]:
        """At the promotion (C3): copy the KV the worker computed, tokens start..end of the
        prompt, from its staging blocks into the row's own decode blocks, block by block,
        and tell the backend the row holds its whole prompt. Returns the transfer's record."""
        job = self.arrived.pop(req.request_id)
        t0 = time.perf_counter()
        try:
            bs = self.storage.block_size
            first = job.start // bs  # the cached prefix's blocks are already the row's
            moved = self.storage.copy_blocks(self.staging, job.table[first:],
                                             self.block_manager.block_table(req.request_id)[first:])
            settle(self.storage.device)  # read before the staging blocks are freed below
            backend.kv_written(req, req.prefill_len)
        finally:
            self._free(job)
        ms = (time.perf_counter() - t0) * 1e3
        c = self.counters
        c["prompts"] += 1
        c["prompt_tokens"] += req.prefill_len - job.start
        c["bytes_from_worker"] += moved
        c["transfer_s"] += ms / 1e3
        rec = {"blocks": len(job.table) - first, "bytes": moved, "ms": round(ms, 3),
               "bytes_to_worker": job.bytes_to_worker,
               "worker_ms": round((job.compute_s or 0) * 1e3, 3)}
        self.transfers[req.request_id] = rec
        return rec

    def forget(self, request_id: str) -> None:
        """The row is gone (cancelled, failed, evicted): free its staging blocks and slot
        now, or when the worker answers for a prompt it still holds."""
        self.transfers.pop(request_id, None)
        if request_id in self.arrived:
            self._free(self.arrived.pop(request_id))
        elif request_id in self.jobs:
            self.jobs[request_id].abandoned = True

    def _free(self, job: Job) -> None:
        if self.staging_bm.has_seq(job.req.request_id):
            self.staging_bm.free(job.req.request_id)
        self.free_slots.append(job.slot)

    # ------------------------------------------------------------- inspection
    def snapshot(self) -> dict[str, Any]:
        """Plain data for records, stats, explain and the stepper. (Stats read it without
        the tick lock: it copies what it iterates.)"""
        now = time.perf_counter()
        return {"alive": self.proc is not None and self.proc.is_alive(), "ready": self.ready,
                "pid": None if self.proc is None else self.proc.pid,
                "on_worker": [{"request_id": rid, "tokens": len(j.req.prefill_token_ids) - j.start,
                               "started": j.started_at is not None,
                               "waited_s": round(now - j.sent_at, 3)}
                              for rid, j in list(self.jobs.items()) if not j.abandoned],
                "arrived": list(self.arrived),
                "staging_blocks_used": self.staging_bm.num_blocks - self.staging_bm.num_free_blocks(),
                "staging_blocks": self.staging_bm.num_blocks, "broken": self.broken,
                **dict(self.counters)}

    def check_invariants(self) -> None:
        """Every slot and staging table belongs to exactly one job (or is free)."""
        held = list(self.jobs.values()) + list(self.arrived.values())
        slots = [j.slot for j in held] + self.free_slots
        if sorted(slots) != list(range(self.max_jobs)):
            raise AssertionError(f"prefill worker slots {sorted(slots)} != 0..{self.max_jobs - 1}")
        for j in held:
            if not self.staging_bm.has_seq(j.req.request_id):
                raise AssertionError(f"{j.req.request_id!r} has no staging blocks")
        self.staging_bm.check_invariants()
