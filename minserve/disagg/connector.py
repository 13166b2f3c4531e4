"""The decode side's end of disaggregated prefill: send prompt pieces, take their KV back
(SPEC C3, C4, C5, H6, H8).

DistServe (Zhong et al., OSDI 2024) and Splitwise (Patel et al., ISCA 2024) run prompts
and decode steps on different workers, so that a long prompt never stalls a stream:
the decode batch ticks on while the prompt is computed elsewhere, and the prompt's KV
is moved over when it is done. `PrefillWorker` is that "elsewhere" for one engine: a
process (worker.py, started and stopped by process.py) and the decode side's handle on it.

The worker computes what chunked prefill would compute on the decode side, planned the
same way (`send`): each prefilling row's next piece of at most `chunk_tokens`, all
pieces together within half the budget (`max_prefill_tokens`, C5) split max-min fair
between tenants, then sessions, then rows (`shares.split_prompt_tokens`, H6). Those
pieces are ONE forward on the worker (a "batch"); the worker holds at most the batch it
computes and one more queued, so a newcomer's first piece waits behind at most a
budget's worth of others' tokens, never a long prompt's whole prefill or a tenant's
whole backlog:

    T1 admit (unchanged)     T2 (execute.run_remote)               at the promotion (C3)
    ────────────────────     ───────────────────────               ─────────────────────
    reserve, allocate the    poll(): the pieces the worker         splice(req): the staging
    row's decode blocks      finished, posted like chunks here     blocks' KV -> the row's
                             (a final one's first token sampled    decode blocks, block by
                             from the worker's logits)             block; then it decodes
                             send(rows): the next pieces, when
                             the worker has no batch queued

The transport is torch.multiprocessing (docs/backends.md, "Disaggregated prefill"): the
staging pool and a logits buffer live in shared memory (on a GPU: CUDA IPC), handed to
the worker once at its start; each batch is a small message. The decode side owns every
allocation: a row's staging blocks (the whole prompt, taken at its first piece) and the
logits slot of its final piece, freed when its KV has been spliced in, when its row is
gone and the worker has answered for its pieces, or when the worker is gone. So the
worker never writes a block that someone else may hold.

Faults (SPEC H5, H8), each costing as little as it can:
* the worker raises on a piece: that row fails with the worker's error (worker.py runs a
  forward that raised again piece by piece, so its neighbours go on);
* the row's client leaves: its pieces still queued on the worker are dropped there
  ("drop"), at most the forward in progress is spent on it, and its staging blocks are
  freed when the worker has answered for that forward;
* the worker dies, or is silent for `timeout_s` while it holds a forward: it is killed
  and restarted; the KV it already wrote is in the staging pool, which is this side's,
  so every row is sent again from where its KV ends. A row whose piece was in the
  forward being computed is sent again once, alone in its forward (it may be what
  killed the worker); if the worker dies again while computing it, that row fails;
* restarts are limited per window (`RestartBudget`): past it the engine refuses new
  prompts, says until when (`health()`, `/health`), and starts the worker again then.
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import shares
from ..backends.kv_storage import KVBlockStorage
from ..kv_cache import BlockManager, NoFreeBlocksError
from ..request import Request
from .process import RestartBudget, WorkerProcess, make_payload
from .worker import forward_tokens

log = logging.getLogger("minserve.disagg")


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
    """Why a row's remote prefill failed: the worker's error, its deaths, or its budget."""


@dataclass
class Job:
    """One row's prompt on the worker: its staging blocks and how far its KV got.

        prompt   [ cached | computed on the worker | sent, in a batch | not sent yet ]
                 0      start                  computed             sent           prefill_len
    """

    req: Request
    ids: list[int]  # req.prefill_token_ids, once
    table: list[int]  # its blocks in the staging pool: the whole prompt, prefix first
    start: int  # tokens 0..start-1 were cached on the decode side and copied in
    sent_at: float
    bytes_to_worker: int  # the cached prefix's KV, copied into the staging blocks
    sent: int = 0  # prompt[:sent]: cached, or in a batch sent to the worker
    computed: int = 0  # prompt[:computed]: KV in the staging pool
    in_flight: int = 0  # its pieces in batches the worker has not answered for
    compute_s: float = 0.0  # the worker's forwards that carried its pieces
    deaths: int = 0  # times the worker died while computing a piece of it
    abandoned: bool = False  # the row is gone: free its staging once the worker has answered
    first_logits: torch.Tensor | None = None  # (V,) its last token's, once its KV is all in


@dataclass
class Batch:
    """One forward's pieces on the worker: (job, start, end, logits slot or -1)."""

    n: int
    pieces: list[tuple[Job, int, int, int]]
    sent_at: float
    tokens: int  # the forward's size: the pieces' tokens, padded (worker.forward_tokens)
    started: bool = False  # the worker said it is computing it


@dataclass
class PrefillWorker:
    """A prefill worker process and everything the decode side keeps about it.

    `storage`, `block_manager`: the decode side's pool and tables (the rows' blocks);
    `staging_blocks`: the staging pool's size (default: as many as the decode pool, so
    any admitted prompt fits); `max_batch_size`: the engine's rows (a batch carries at
    most one piece of each; the logits buffer has a slot for every final piece of two
    batches); `threads`: the worker's torch threads; `timeout_s`: how long one forward
    may take on the worker; `chunk_tokens`: a row's piece at most; `budget_tokens`
    (`max_prefill_tokens`, C5): the prompt tokens on the worker at once, the forward it
    computes and the one queued behind it, at most half of it each; None: no budget
    beyond the chunk, a forward of at most `chunk_tokens` (`forward_budget`)."""

    model: torch.nn.Module
    storage: KVBlockStorage
    block_manager: BlockManager
    runner_kind: str = "hf"
    max_model_len: int = 2048
    max_batch_size: int = 8
    threads: int = 1
    timeout_s: float = 120.0
    staging_blocks: int | None = None
    chunk_tokens: int = 512
    budget_tokens: int | None = None
    max_restarts: int = 3  # ... in any restart_window_s seconds (RestartBudget)
    restart_window_s: float = 600.0
    jobs: dict[str, Job] = field(default_factory=dict)  # rows with a prompt on the worker
    arrived: dict[str, Job] = field(default_factory=dict)  # KV all in staging, not spliced
    batches: dict[int, Batch] = field(default_factory=dict)  # sent, not answered, in order
    transfers: dict[str, dict[str, Any]] = field(default_factory=dict)  # splices, for the records
    broken: str | None = None  # why this engine takes no new prompts now (restart budget spent)

    def __post_init__(self) -> None:
        s = self.storage
        n = self.staging_blocks or s.num_blocks
        # past the n blocks the decode side hands out: the worker's padding row (worker.py,
        # `forward_tokens`: fewer than 64 tokens of it), written and never read
        pad = -(-64 // s.block_size)
        self.pad_table = list(range(n, n + pad))
        self.staging = KVBlockStorage(n + pad, s.block_size, s.num_layers, s.num_kv_heads,
                                      s.head_dim, s.dtype, s.device).share_memory_()
        self.staging_bm = BlockManager(n, s.block_size, enable_prefix_caching=False)
        vocab = self.model.get_output_embeddings().out_features
        self.max_jobs = 2 * self.max_batch_size  # final pieces in two batches, at most
        self.logits = torch.zeros(self.max_jobs, vocab).share_memory_()  # (slots, V) float32
        self.free_slots = list(range(self.max_jobs))
        self.counters = {"prompts": 0, "prompt_tokens": 0, "bytes_to_worker": 0,
                         "bytes_from_worker": 0, "transfer_s": 0.0, "compute_s": 0.0,
                         "batches": 0, "errors": 0, "deaths": 0, "timeouts": 0, "restarts": 0,
                         "resent_prompts": 0, "abandoned": 0, "dropped_tokens": 0}
        self.budget = RestartBudget(self.max_restarts, self.restart_window_s)
        self.process = WorkerProcess(self.threads)
        self.state = "starting"  # ready | restarting | given_up | closed (health())
        self.ready, self.retry_at, self._seq = False, 0.0, 0
        self.last_heard = time.monotonic()
        self._start()
        ref = weakref.ref(self)  # at exit, before multiprocessing's own hook joins children

        def at_exit() -> None:
            if (me := ref()) is not None:
                me.close()

        self._at_exit = at_exit
        atexit.register(at_exit)

    # ------------------------------------------------------------- the process
    def _start(self) -> None:
        """Start a worker (it loads in the background while the decode side ticks on)."""
        self.process.start(make_payload(self.model, self.runner_kind, self.max_model_len,
                                        self.staging, self.logits, self.pad_table))
        self.ready, self.last_heard = False, time.monotonic()
        self.booted_at = time.perf_counter()  # when this worker was started (lesson 08)

    @property
    def proc(self):
        """The worker's `multiprocessing.Process` (None when there is none)."""
        return self.process.proc

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until the worker has loaded. Raises RuntimeError, naming the cause, as
        soon as it dies first, or after `timeout_s` (default: the start-up allowance)."""
        self.process.wait_first(timeout_s or max(self.timeout_s, self.process.BOOT_S))
        self.ready, self.state, self.last_heard = True, "ready", time.monotonic()

    def _restart(self, why: str) -> list[tuple[str, str]]:
        """The worker is gone (or killed): send its rows again from where their KV ends
        (`_requeue`), start another if the budget allows; else refuse prompts until it does."""
        pid = self.process.pid
        self.process.stop(graceful=False)
        failed = self._requeue(why)
        now = time.monotonic()
        if self.budget.take(now):
            self.counters["restarts"] += 1
            self._start()
            self.state, self.broken = "restarting", None
            log.warning("%s (pid %s); started a new one (restart %d; %d left in any %g s); "
                        "%d prompt(s) sent to it again, %d failed", why, pid,
                        self.counters["restarts"], self.budget.left(now), self.budget.window_s,
                        len(self.jobs), len(failed))
            return failed
        self.retry_at = self.budget.next_at(now)
        self.state = "given_up"
        self.broken = (f"the prefill worker failed {self.budget.max_restarts + 1} times within "
                       f"{self.budget.window_s:g} s (last: {why}); this engine takes no new "
                       f"prompts for {self.retry_at - now:.0f} s, then starts it again")
        failed += [(rid, self.broken) for rid, job in self.jobs.items() if not job.abandoned]
        for job in list(self.jobs.values()):
            self._drop(job)
        log.error("%s (pid %s); %s", why, pid, self.broken)
        return failed

    def _requeue(self, why: str) -> list[tuple[str, str]]:
        """After a death: every batch is void. A row is sent again from `computed` (its KV
        so far is in the staging pool); one whose piece was in the forward being computed
        is blamed once (`deaths`), and fails at its second."""
        for batch in self.batches.values():
            for job, _, _, _ in batch.pieces:
                job.deaths += batch.started
        self.batches.clear()
        self.free_slots = list(range(self.max_jobs))  # no batch holds one now
        failed = []
        for rid, job in list(self.jobs.items()):
            job.in_flight = 0
            if job.abandoned:
                self._drop(job)
            elif job.deaths >= 2:
                failed.append((rid, f"{why}, twice while computing this prompt (it may be what "
                                    "kills the worker): it is not sent again"))
                self._drop(job)
            else:
                self.counters["resent_prompts"] += job.sent > job.computed
                job.sent = job.computed
        return failed

    def close(self) -> None:
        """Stop the worker (idempotent): asked to exit if it is ready and holds no forward,
        else (loading, computing, stopped, hung) killed: nothing of it is worth a wait."""
        atexit.unregister(self._at_exit)
        self.process.stop(graceful=self.ready and not self.batches)
        self.state, self.ready = "closed", False

    # ------------------------------------------------------------- the scheduler's calls
    def holds(self, request_id: str) -> bool:
        """Is this row's prompt on the worker, or its KV waiting to be spliced?"""
        return request_id in self.jobs or request_id in self.arrived

    def busy(self) -> bool:
        """A forward sent and not answered: something to wait for."""
        return bool(self.batches)

    def send(self, rows: list[Request]) -> tuple[dict[str, Any], list[tuple[Request, str]]]:
        """T2's pieces for the prefilling `rows`, sent as one batch when the worker has none
        queued (it computes one and holds at most one more). Returns what happened, for the
        tick's record (`sent`: ids, `pieces`: {id: [start, end]}, `waiting`: {id: why it
        got none}, `forward_tokens`: the forward's padded size), and the rows refused, with
        why. A row's first piece takes its staging blocks and copies its cached prefix in."""
        if self.broken:
            return {}, [(r, self.broken) for r in rows if r.request_id not in self.arrived]
        todo = [r for r in rows if r.request_id not in self.arrived and not r.cancel_requested]
        if not self.ready:
            return {"waiting": {r.request_id: "the prefill worker is starting" for r in todo}}, []
        if self._queued():
            why = "the prefill worker has a forward queued already"
            return {"waiting": {r.request_id: why for r in todo
                                if self._next(r) < r.prefill_len}}, []
        waiting, cands = {}, []
        for r in todo:
            job = self.jobs.get(r.request_id)
            if job is not None and job.req is not r:  # preempted and admitted again
                waiting[r.request_id] = "its earlier prompt is still on the prefill worker"
            elif self._next(r) < r.prefill_len:
                cands.append(r)
        plan = self._plan(cands)
        pieces = []
        for r, k in plan:
            job = self.jobs.get(r.request_id) or self._open(r, waiting)
            if job is None:
                continue
            a, b = job.sent, job.sent + k
            slot = self.free_slots.pop() if b == r.prefill_len else -1
            pieces.append((job, a, b, slot))
            job.sent, job.in_flight = b, job.in_flight + 1
        for r in cands:
            if r.request_id not in waiting and all(p[0].req is not r for p in pieces):
                waiting[r.request_id] = "no prompt tokens for it in this batch (its share was 0)"
        out = {"sent": [job.req.request_id for job, *_ in pieces],
               "pieces": {job.req.request_id: [a, b] for job, a, b, _ in pieces},
               "waiting": waiting}
        if pieces:
            out["forward_tokens"] = self._dispatch(pieces)
        return out, []

    def _queued(self) -> list[Batch]:
        """The batches sent and not started that still carry a live row's piece (one whose
        rows were all abandoned will be skipped there: the next may queue behind it)."""
        return [b for b in self.batches.values()
                if not b.started and any(not j.abandoned for j, *_ in b.pieces)]

    @property
    def forward_budget(self) -> int:
        """One forward's prompt tokens at most: half the budget, since the worker holds two
        (so a newcomer waits for at most a budget's worth of others' tokens, as in a tick
        of chunked prefill, before the forward that carries its first piece); without a
        budget, a chunk."""
        if self.budget_tokens is None:
            return self.chunk_tokens
        return max(1, self.budget_tokens // 2)

    def _next(self, r: Request) -> int:
        job = self.jobs.get(r.request_id)
        return job.sent if job is not None and job.req is r else r.num_computed_prompt_tokens

    def _plan(self, rows: list[Request]) -> list[tuple[Request, int]]:
        """Tokens for each row in the next batch: as `Scheduler._plan_prefill` plans a
        tick's chunks, from where each row's sent prompt ends. A row that was on the worker
        when it died goes alone (if it kills the worker again, it alone fails)."""
        suspect = next((r for r in rows if (j := self.jobs.get(r.request_id)) and j.deaths), None)
        if suspect is not None:
            return [(suspect, min(self.chunk_tokens, suspect.prefill_len - self._next(suspect)))]
        wants = [min(self.chunk_tokens, r.prefill_len - self._next(r)) for r in rows]
        give = shares.split_prompt_tokens(rows, wants, self.forward_budget)
        return [(r, g) for r, g in zip(rows, give) if g > 0]

    def _open(self, req: Request, waiting: dict[str, str]) -> Job | None:
        """The row's first piece: its staging blocks (the whole prompt), its cached prefix
        (req.num_cached_tokens, whole blocks, K1) copied in, so the worker computes the rest."""
        rid, ids = req.request_id, list(req.prefill_token_ids)
        try:
            self.staging_bm.allocate_prompt(rid, ids)
        except NoFreeBlocksError:
            waiting[rid] = (f"the prefill worker's staging pool has "
                            f"{self.staging_bm.num_free_blocks()} free blocks, "
                            f"{self.staging_bm.num_blocks_for(len(ids))} needed")
            return None
        table = self.staging_bm.block_table(rid)
        start = req.num_computed_prompt_tokens
        n = start // self.storage.block_size
        sent = self.staging.copy_blocks(self.storage, self.block_manager.block_table(rid)[:n],
                                        table[:n]) if n else 0
        if n:  # the worker reads these blocks as soon as it takes the batch
            settle(self.staging.device)
        job = Job(req, ids, table, start, time.monotonic(), sent, sent=start, computed=start)
        self.jobs[rid] = job
        self.counters["bytes_to_worker"] += sent
        return job

    def _dispatch(self, pieces: list[tuple[Job, int, int, int]]) -> int:
        if not self.batches:  # an idle worker's silence so far is not a hang
            self.last_heard = time.monotonic()
        n, self._seq = self._seq, self._seq + 1
        tokens = forward_tokens(sum(b - a for _, a, b, _ in pieces), self.forward_budget)
        self.batches[n] = Batch(n, pieces, time.monotonic(), tokens)
        self.counters["batches"] += 1
        self.process.jobs.put(("batch", n, [(j.req.request_id, j.ids[a:b], a, j.table, slot)
                                            for j, a, b, slot in pieces], tokens))
        return tokens

    def poll(self, wait_s: float = 0.0) -> tuple[list[tuple[Request, int, int, Any]],
                                                 list[tuple[str, str]]]:
        """What the worker answered since the last call: ([(row, start, end, its last
        token's logits (V,) if the piece was its prompt's last, else None)], in the order
        computed, and [(request id, why it failed)]). `wait_s` > 0: wait that long for a
        first answer (a decode side with nothing to decode has nothing better to do).
        Then the worker's health: a death or a hang restarts it (`_restart`)."""
        done, failed = [], []
        while (msg := self.process.receive(wait_s)) is not None:
            wait_s = 0.0
            self.last_heard = time.monotonic()
            self._answer(msg, done, failed)
        failed += self._check_health()
        return done, failed

    def _answer(self, msg: tuple, done: list, failed: list) -> None:
        kind = msg[0]
        if kind == "ready":
            self.ready, self.state = True, "ready"
            log.info("the prefill worker is ready (pid %s)", msg[1])
        elif kind in ("alive", "failed"):
            self.process.note(msg)
        elif kind == "start" and msg[1] in self.batches:
            self.batches[msg[1]].started = True
        elif kind == "done" and msg[1] in self.batches:
            batch, (seconds, errors, dropped) = self.batches.pop(msg[1]), msg[2:]
            self.counters["compute_s"] += seconds
            self.counters["dropped_tokens"] += dropped
            for job, a, b, slot in batch.pieces:
                job.in_flight -= 1
                job.compute_s += seconds
                logits = None
                if slot >= 0:
                    logits = self.logits[slot].clone()
                    self.free_slots.append(slot)
                rid = job.req.request_id
                if job.abandoned:
                    if not job.in_flight:
                        self._drop(job)
                elif rid in errors:
                    self.counters["errors"] += 1
                    failed.append((rid, f"the prefill worker raised on this prompt: {errors[rid]}"))
                    self._abandon(job)
                else:
                    job.computed = b
                    done.append((job.req, a, b, logits))
                    if b == job.req.prefill_len:
                        self.arrived[rid] = self.jobs.pop(rid)

    def _check_health(self) -> list[tuple[str, str]]:
        """The worker died, hangs on a forward, or never started: restart it. After the
        budget's window: start it again."""
        now = time.monotonic()
        if self.process.proc is None:
            if self.state == "given_up" and now >= self.retry_at:
                self.counters["restarts"] += 1
                self.budget.take(now)
                self._start()
                self.state, self.broken = "restarting", None
                log.warning("starting the prefill worker again after %g s without one",
                            self.budget.window_s)
            return []
        if not self.process.is_alive():
            self.counters["deaths"] += 1
            return self._restart(f"the prefill worker died (exit code {self.proc.exitcode})")
        # Silent for timeout_s while it holds a forward: that forward took that long, or it
        # hangs (it says "start" and "done" for every forward, so a busy worker is heard).
        hung = self.ready and self.batches and now - self.last_heard > self.timeout_s
        booting = max(self.timeout_s, self.process.BOOT_S)
        if hung or (not self.ready and now - self.process.started_at > booting):
            self.counters["timeouts"] += 1
            return self._restart(f"the prefill worker did not finish a forward within "
                                 f"{self.timeout_s:g} s (timeout_s)" if hung else
                                 f"the prefill worker did not start within {booting:g} s")
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
               "worker_ms": round(job.compute_s * 1e3, 3)}
        self.transfers[req.request_id] = rec
        return rec

    def forget(self, request_id: str) -> None:
        """The row is gone (cancelled, failed, evicted, preempted): free its staging blocks
        now, or, if a batch the worker holds carries a piece of it, tell the worker to drop
        the pieces it has not started and free them when it has answered."""
        self.transfers.pop(request_id, None)
        if request_id in self.arrived:
            self._free(self.arrived.pop(request_id))
        elif (job := self.jobs.get(request_id)) is not None and not job.abandoned:
            self._abandon(job)

    def _abandon(self, job: Job) -> None:
        job.abandoned = True
        self.counters["abandoned"] += 1
        if not job.in_flight:
            self._drop(job)
        elif self.process.proc is not None:
            self.process.jobs.put(("drop", job.req.request_id))

    def _drop(self, job: Job) -> None:
        if self.jobs.get(job.req.request_id) is job:
            del self.jobs[job.req.request_id]
        self._free(job)

    def _free(self, job: Job) -> None:
        if self.staging_bm.has_seq(job.req.request_id):
            self.staging_bm.free(job.req.request_id)

    # ------------------------------------------------------------- inspection
    def health(self) -> dict[str, Any]:
        """For `/health`: plain reads only (no lock, no system call), so it always answers.
        `state`: ready, starting, restarting, given_up (new prompts refused) or closed."""
        now = time.monotonic()
        out = {"state": self.state, "pid": self.process.pid,
               "restarts_left": self.budget.left(now) if self.state != "given_up" else 0,
               "restart_window_s": self.budget.window_s, "max_restarts": self.budget.max_restarts}
        if self.state == "given_up":
            out.update(retry_in_s=round(max(0.0, self.retry_at - now), 1), error=self.broken)
        return out

    def snapshot(self) -> dict[str, Any]:
        """Plain data for records, stats, explain and the stepper: every prompt the worker
        holds (those being abandoned too: their pieces are still in its forwards), the
        batches in flight, the staging pool. (Stats read it without the tick lock: it
        copies what it iterates.)"""
        now = time.monotonic()
        batches = list(self.batches.values())
        computing = {j.req.request_id for b in batches if b.started for j, *_ in b.pieces}
        return {"alive": self.process.proc is not None and self.ready, "ready": self.ready,
                "state": self.state, "pid": self.process.pid,
                "on_worker": [{"request_id": rid, "tokens": len(j.ids) - j.start,
                               "computed": j.computed - j.start, "sent": j.sent - j.start,
                               "started": rid in computing, "abandoned": j.abandoned,
                               "waited_s": round(now - j.sent_at, 3)}
                              for rid, j in list(self.jobs.items())],
                "forwards_in_flight": [{"tokens": sum(b - a for _, a, b, _ in x.pieces),
                                        "padded_to": x.tokens, "rows": len(x.pieces),
                                        "started": x.started} for x in batches],
                "arrived": list(self.arrived),
                "staging_blocks_used": self.staging_bm.num_blocks - self.staging_bm.num_free_blocks(),
                "staging_blocks": self.staging_bm.num_blocks, "broken": self.broken,
                "budget_tokens": self.budget_tokens, **dict(self.counters)}

    def check_invariants(self) -> None:
        """Every logits slot is free or a piece's in flight; every job's pieces in flight
        are counted; start <= computed <= sent <= the prompt; staging per held row."""
        pieces = [p for b in self.batches.values() for p in b.pieces]
        slots = [s for *_, s in pieces if s >= 0] + self.free_slots
        if sorted(slots) != list(range(self.max_jobs)):
            raise AssertionError(f"prefill worker slots {sorted(slots)} != 0..{self.max_jobs - 1}")
        for rid, j in list(self.jobs.items()) + list(self.arrived.items()):
            if j.in_flight != sum(p[0] is j for p in pieces):
                raise AssertionError(f"{rid!r}: {j.in_flight} pieces in flight counted")
            if not j.start <= j.computed <= j.sent <= len(j.ids):
                raise AssertionError(f"{rid!r}: start {j.start}, computed {j.computed}, "
                                     f"sent {j.sent}, prompt {len(j.ids)}")
            if not self.staging_bm.has_seq(rid):
                raise AssertionError(f"{rid!r} has no staging blocks")
        if len(self._queued()) > 1:
            raise AssertionError("more than one live batch queued on the prefill worker")
        self.staging_bm.check_invariants()
