"""The scheduler: three queues and a tick of four phases (SPEC Q, T, R).

    submit ─G1─► pending (the policy) ─T1 admit─► prefilling ─T2 last chunk─► active
                                                                   │              │
                                                      T3 evict ◄───┴──────────────┘  T4 decode: all
                                                                                    active rows, one
                                                                                    token each

One tick = `admit_pending` → `advance_prefill_chunk` → `evict_finished` →
`decode_step`, in this order (T5):

* admit before prefill, so a request admitted this tick is prefilled (and, in
  monolithic mode, streams its first token) in the same tick;
* evict before decode, so a row that finished (EOS, stop, max_tokens, cancel)
  is never decoded again.

Each phase is a public method that returns a record of what it did
(records.py); `step()` runs all four. The worker thread (engine.py) holds
`self.lock` for a whole tick; `submit` and `cancel` only take the small
`queue_lock`, so a client is answered at once even while a long prefill runs.

Three choices are objects the scheduler is given, each readable on its own:

    who runs next           self.policy      policies.py, fair.py  (P)
    how much KV it takes    self.admission   admission.py: reserve or preempt (R1, P6)
    where its KV grows      self.backend     backends/: `kv_grows_in_pool` (B1)

Two concerns have files of their own, so that this one reads as the tick:

    run the planned forwards, post their tokens    execute.py   (nano-vllm's run, postprocess)
    a fault ends only the rows it touched          failures.py  (H5)

The load-bearing invariant (R1):

    active_kv_reserved == sum(r.reserved_tokens for r in prefilling + active)

`_admit` adds `admission.reserve(req)`; a decode step adds `admission.per_decode`
per row; `_release` is the one subtractor: eviction (finish, cancel), preemption and
every failure go through it. `check_invariants()` verifies R1 and that every
request sits in exactly one queue; the tests call it after every phase.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

from . import execute, failures, gates, records, shares
from .admission import MODES
from .backends.base import Backend
from .config import EngineConfig, PrefillMode
from .execute import Piece
from .policies import Policy
from .records import AdmitRecord, DecodeRecord, EvictRecord, PrefillRecord, TickRecord
from .request import FinishReason, Rejection, Request, RequestOutput, RequestStatus
from .sampling import Sampler


class Scheduler:
    """The queues, the tick, the reservation. What a lab or a test may swap on one
    scheduler (each is read at the time of use): `policy`, `admission`, `backend`,
    `block_manager`, `gates` (the gate functions), `next_chunk` (T2's schedule) and
    `_promote_to_decode` (the C3 seam)."""

    RECENT = 1024  # finished requests `explain` still knows about

    def __init__(self, config: EngineConfig, backend: Backend, policy: Policy,
                 kv_budget_tokens: int, block_manager=None) -> None:
        self.config = config
        self.backend = backend
        self.policy = policy  # IS the pending queue (Q1)
        self.admission = MODES[config.admission]()  # reserve or preempt (admission.py)
        self.block_manager = block_manager  # KV blocks + prefix cache (kv_cache.py), or None
        self.kv_budget_tokens = kv_budget_tokens
        self.sampler = Sampler()
        # The gate functions (gates.py). An attribute, not the module global, so that a lab
        # can plug a student's gates into one engine without touching any other.
        self.gates = gates
        self.prefilling: list[Request] = []  # Q2, in admission order
        self.active: list[Request] = []  # Q3, the decode batch
        self.requests: dict[str, Request] = {}  # every request not yet finished
        self.active_kv_reserved = 0  # R1
        self.tick_count = 0
        # end_tick copies the state after each tick into its record (T6). A serving worker
        # that keeps no trace turns it off (Engine.step): nobody reads that copy, and at
        # 2,048 blocks it cost ~2 ms a tick.
        self.snapshot_ticks = True
        self.lock = threading.RLock()  # the backend lock: held for a whole tick
        self.queue_lock = threading.RLock()  # guards the policy (pending) and `requests`
        # counters for stats (G5)
        self.kv_admit_blocked = {"G1": 0, "G2": 0, "G3": 0, "batch": 0}
        if config.shares != "off":
            self.kv_admit_blocked["share"] = 0  # holds by a share (H6, shares.py)
        self.rejected = {"G1": 0, "G2": 0, "G3": 0}
        self.finished_count = 0
        self.failed_rows = 0  # rows ended by an error of their own (failure isolation)
        self.hook_errors = 0  # policy cleanup hooks that raised (the request still ended)
        self.last_error: str | None = None  # one line, no traceback (that goes to the log)
        self.kv_length_metric = 0  # the backend's kv_length after the last decode step
        self.tokens_generated = 0
        self.prompt_tokens_computed = 0
        self.preemptions = 0  # rows sent back to pending (admission="preempt", or taken back)
        self.reclaimed_rows = 0  # of those, borrowed rows taken back for a unit owed a row (H6)
        self.recomputed_tokens = 0  # tokens whose KV was computed again after a preemption
        # what `explain` says about the newest finished requests (request id -> summary)
        self.recent_finished: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.forwards: list[int] = []  # tokens in each model forward of the tick in progress
        self._planned: list[tuple[Request, dict[str, Any]]] = []  # mixed_batch: T2 -> T4
        self._planned_record = PrefillRecord()  # ... and the T2 record those chunks are in
        # prefill_mode="disaggregated": the prefill worker's handle (disagg/connector.py),
        # set by the engine. T2 sends prompts to it and polls it instead of computing them.
        self.remote = None
        # where a served token's time goes (spans.py, set by the engine when MINSERVE_SPANS
        # asks): each tick's phases timed. None: off, one `is None` check per phase.
        self.spans = None

    # ================================================================= entry points
    def submit(self, req: Request) -> Rejection | None:
        """Gate G1 then enqueue. Returns the rejection (and finishes the request) if refused.
        With shares (H6) G1 is per tenant: a full queue refuses a tenant at its share of
        it, and makes room for one under its share by refusing the newest waiting request
        of the tenant with the most waiting (`shares.queue_place`)."""
        with self.queue_lock:
            refused = req
            if self.config.shares == "off":
                rejection = self.gates.check_queue_capacity(len(self.policy),
                                                            self.config.max_queue_size)
            else:  # None, or the refusal of `req` or of a request it pushes out
                rejection, refused = shares.queue_place(list(self.policy), self.prefilling
                                                        + self.active, req, self.config.max_queue_size)
            if rejection is not None:
                self.kv_admit_blocked["G1"] += 1
                self.rejected["G1"] += 1
                if refused is not req:
                    self.policy.remove(refused)
                self._finish(refused, FinishReason.ERROR, rejection=rejection)
                if refused is req:
                    return rejection
            req.status = RequestStatus.PENDING
            self.requests[req.request_id] = req
            try:
                self.policy.on_request_arrived(req)
            except Exception as e:  # the policy refused to take it: it never entered Q1
                if any(r is req for r in self.policy):
                    self.policy.remove(req)
                failures.note_row_error(self, req, "enqueue", e)
                self._finish(req, FinishReason.ERROR, error=req.error)
                raise
        return None

    def cancel(self, request_id: str) -> bool:
        """Cancel a request in any queue. Pending: dropped now. Running: evicted in T3."""
        with self.queue_lock:
            req = self.requests.get(request_id)
            if req is None or req.is_finished:
                return False
            req.cancel_requested = True
            if req.status is RequestStatus.PENDING:
                self.policy.remove(req)
                self._finish(req, FinishReason.CANCELLED)
        return True

    # ================================================================= the tick
    def step(self) -> TickRecord:
        """One tick: the four phases in SPEC order (T5), under the backend lock."""
        with self.lock:
            t0 = time.perf_counter()
            if self.spans is not None:
                self.spans.tick_started()
            admit = self.admit_pending()
            self._mark("admit")
            prefill = self.advance_prefill_chunk()
            self._mark("prefill")
            evict = self.evict_finished()
            self._mark("evict")
            decode = self.decode_step()  # marks its parts (execute.run_decode)
            rec = self.end_tick(admit, prefill, evict, decode, time.perf_counter() - t0)
            if self.spans is not None:
                self.spans.mark("record")
                self.spans.tick_ended(len(decode.rows), sum(rec.forwards))
            return rec

    def _mark(self, phase: str) -> None:
        """`phase` of this tick ends now, for `spans` when they are on."""
        if self.spans is not None:
            self.spans.mark(phase)

    def end_tick(self, admit: AdmitRecord, prefill: PrefillRecord, evict: EvictRecord,
                 decode: DecodeRecord, duration_s: float = 0.0) -> TickRecord:
        """Close a tick whose phases ran (by `step`, or one by one in step mode): count
        it and return its record. With `snapshot_ticks` off, the phase records only,
        without the copy of the queues, block pool and policy after the tick."""
        self.tick_count += 1
        if self.snapshot_ticks:
            rec = records.snapshot(self, admit, prefill, evict, decode, duration_s,
                                   tick=self.tick_count)
        else:
            rec = TickRecord(self.tick_count, admit, prefill, evict, decode,
                             active_kv_reserved=self.active_kv_reserved, duration_s=duration_s)
        rec.forwards, self.forwards = self.forwards, []
        return rec

    # ---------------------------------------------------------------- T1
    def admit_pending(self) -> AdmitRecord:
        """T1: move requests from `pending` to `prefilling` while the gates allow.

        Peek the policy's head; `admission.choose` runs the gates on it (a batch row,
        G2's KV and G3's blocks, with the numbers the mode states) and, when its session
        or tenant already holds its share (shares.py, or the fixed caps), takes the first
        waiting request of another session instead. Pass -> pick it, reserve its KV
        (`admission.reserve`, R1), allocate its blocks (cached prefix reused, K2) and open
        its staging row. Soft hold -> if its tenant (session) is owed a row and others
        hold borrowed rows, take them back (`admission.reclaim`: preempted, newest first,
        H6) and look again; else stop, the head keeping its place (G4). Hard reject ->
        finish it with the gate's reason (G6) and look at the next. A row taken back is
        not admitted again in the same tick (so taking back can never loop).

        After: R1 holds; every admitted request is PREFILLING with
        num_computed_prompt_tokens == num_cached_tokens; no row within its unit's share
        was taken back.
        """
        rec = AdmitRecord()
        taken_back: set[str] = set()  # rows reclaimed this tick: they wait for the next
        with self.lock, self.queue_lock:
            while (head := failures.policy_call(self, "peek_next")) is not None:
                # head, or another's; never a row taken back this tick
                req, rejection = self.admission.choose(self, head, skip=taken_back)
                if req is not head and "share" in self.kv_admit_blocked:
                    self.kv_admit_blocked["share"] += 1  # a share held the head back (H6)
                if rejection is not None and not rejection.hard:
                    reclaimed = self.admission.reclaim(self, req, rejection)  # H6
                    if reclaimed:
                        rec.reclaimed += reclaimed
                        taken_back.update(p["request_id"] for p in reclaimed)
                        continue  # look again: `req` (or one ahead of it) fits now
                if rejection is not None and not rejection.hard:  # G4: it keeps its place
                    self.kv_admit_blocked[rejection.gate] += 1
                    rec.held = {"request_id": req.request_id, "rejection": rejection.to_dict()}
                    break
                try:
                    if req is head:
                        self.policy.pick_next()
                    else:
                        self.policy.pick(req)
                except Exception as e:  # the policy failed to hand it over (SPEC H5)
                    failures.note_hook_error(self, "pick", e)
                    if any(r is req for r in self.policy):
                        break  # it keeps its place: next tick tries again; running rows go on
                    failures.note_row_error(self, req, "the policy's pick", e)  # taken out, not admitted
                    self._finish(req, FinishReason.ERROR, error=req.error)
                    rec.failed.append({"request_id": req.request_id, "error": req.error})
                    continue
                if rejection is not None:  # hard: it can never fit on this engine
                    self.kv_admit_blocked[rejection.gate] += 1
                    self.rejected[rejection.gate] += 1
                    self._finish(req, FinishReason.ERROR, rejection=rejection)
                    rec.rejected.append({"request_id": req.request_id, "rejection": rejection.to_dict()})
                    continue
                req.policy_running = True  # it runs: `_finish` tells the policy it stopped
                if self._admit(req):
                    rec.admitted.append({"request_id": req.request_id,
                                         "reserved": req.reserved_tokens,
                                         "cached_tokens": req.num_cached_tokens,
                                         "recompute": len(req.recompute_token_ids)})
                else:
                    rec.failed.append({"request_id": req.request_id, "error": req.error})
        return rec

    def _admit(self, req: Request) -> bool:
        """Reserve, allocate, open the staging row. All or nothing: if any step raises,
        what was taken is given back and the request fails alone (returns False)."""
        req.status = RequestStatus.PREFILLING
        req.reserved_tokens = self.admission.reserve(req)
        self.active_kv_reserved += req.reserved_tokens  # R1: admit adds
        req.timing.admitted = time.perf_counter()
        self.prefilling.append(req)  # first, so that a failure below is released like any row
        try:
            if self.block_manager is not None:
                req.num_cached_tokens = self.block_manager.allocate_prompt(
                    req.request_id, req.prefill_token_ids, salt=req.tenant)
            req.num_computed_prompt_tokens = req.num_cached_tokens
            self.backend.begin_prefill(req)
        except Exception as e:
            failures.fail_row(self, req, "admission", e)
            return False
        return True

    # ---------------------------------------------------------------- T2
    def advance_prefill_chunk(self) -> PrefillRecord:
        """T2: push prompt tokens of `prefilling` rows through the model. Plan, then run.

        Plan (`_plan_prefill`): each prefilling row's piece for this tick, `next_chunk`:
        monolithic, its whole remaining prompt; chunked (Version A, SPEC C1) and
        mixed_batch, its next `prefill_chunk_size` tokens. So a giant prompt never
        freezes the decode batch for more than one chunk, and never holds back a short
        prompt admitted after it: each row's prefill takes ceil(remaining / chunk) ticks
        whoever else is prefilling. A tick's prompt work is at most (rows prefilling) x
        chunk, and rows are at most `max_batch_size` (Q3).

        Run (`execute.run_pieces`): monolithic and chunked push all the pieces through
        ONE forward (`prefill_together`; paged: flattened, padded: left-padded side by
        side), beside the decode forward. mixed_batch (Version B) runs nothing here
        (`execute.defer_to_decode`): T4 carries the planned pieces in the decode
        forward, one forward per tick in all; their records (`in_decode_forward`) get
        `first_token` when T4 has run.

        disaggregated (`execute.run_remote`): nothing is computed here. Rows whose KV the
        prefill worker has finished are promoted (the KV spliced in at `_promote_to_decode`,
        their first token sampled from the worker's logits); rows not yet on the worker
        are sent to it. The decode batch never waits for a prompt.

        On a row's final piece: promote it through `_promote_to_decode`, register its
        now-computed blocks (K3), sample its first token and stream it.
        After (monolithic, chunked): rows in `prefilling` have 0 < remaining prompt tokens.
        """
        rec = PrefillRecord()
        with self.lock:
            self._planned, self._planned_record = [], rec
            if self.remote is not None:  # disaggregated: the prefill worker computes them
                execute.run_remote(self, rec)
                return rec
            pieces = self._plan_prefill()
            if self.config.prefill is PrefillMode.MIXED_BATCH:
                execute.defer_to_decode(self, pieces, rec)  # T4 runs them, in its forward
            else:
                execute.run_pieces(self, pieces, rec)  # now, beside the decode forward
        return rec

    def _plan_prefill(self) -> list[Piece]:
        """This tick's piece of every prefilling row, in admission order (a cancelled row
        gets none: T3 evicts it). With `max_prefill_tokens`, the pieces together stay
        within it, split max-min fair between tenants, then rows (`shares.split_prompt_tokens`);
        a row given nothing this tick gets no piece."""
        size = self.config.prefill_chunk_size or None  # None: the whole rest at once
        if self.config.prefill is PrefillMode.MONOLITHIC:
            size = None
        pieces = [(req, *self.next_chunk(req, size))
                  for req in list(self.prefilling) if not req.cancel_requested]
        budget = self.config.max_prefill_tokens
        if budget is None:
            return pieces
        give = shares.split_prompt_tokens([r for r, _, _ in pieces],
                                          [end - start for _, start, end in pieces], budget)
        return [(r, start, start + g) for (r, start, _), g in zip(pieces, give) if g > 0]

    @staticmethod
    def next_chunk(req: Request, chunk_size: int | None) -> tuple[int, int]:
        """This tick's piece of `req`'s prompt, `(start, end)`: it starts where the row's
        KV ends and takes at most `chunk_size` tokens (None: the whole rest). A seam:
        a lab plugs a student's schedule in by setting it on one scheduler. (After a
        preemption the "prompt" to prefill is `prefill_token_ids`: prompt + outputs.)"""
        start = req.num_computed_prompt_tokens
        end = req.prefill_len if chunk_size is None else min(req.prefill_len, start + chunk_size)
        return start, end

    def _promote_to_decode(self, req: Request) -> None:
        """The one seam through which every completed prefill enters the decode
        batch (SPEC C3). Under P/D disaggregation the KV transfer from the prefill
        worker happens here (`remote.splice`: its staging blocks into the row's own
        blocks); nothing else changes."""
        if self.remote is not None:
            self.remote.splice(req, self.backend)
        self.backend.promote(req)  # first: if it raises, the row is still in `prefilling`
        self.prefilling.remove(req)
        req.status = RequestStatus.ACTIVE
        self.active.append(req)

    # ---------------------------------------------------------------- T3
    def evict_finished(self) -> EvictRecord:
        """T3: remove finished or cancelled rows from `active` (and cancelled ones
        from `prefilling`): drop their KV row, free their blocks, subtract their
        reservation (R1), tell the policy, finish the client's response.

        After: every row in `active` has no finish reason, so T4 never decodes a
        finished row (T5).
        """
        rec = EvictRecord()
        with self.lock:
            for queue, name in ((self.prefilling, "prefilling"), (self.active, "active")):
                for req in list(queue):
                    if req.cancel_requested and req.finish_reason is None:
                        req.finish_reason = FinishReason.CANCELLED
                    if req.finish_reason is None:
                        continue
                    released = self._release(req)
                    queue.remove(req)
                    rec.evicted.append({"request_id": req.request_id, "from_queue": name,
                                        "finish_reason": req.finish_reason.value,
                                        "released_tokens": released})
                    self._finish(req, req.finish_reason)
        return rec

    def _release(self, req: Request, drop_row: bool = True) -> int:
        """Give back everything a running request holds. The ONLY subtractor of R1:
        eviction, preemption and every failure path (failures.py) come here.

        Idempotent, accounting first: if freeing the blocks or dropping the row raises,
        the reservation is already back, and a second call only retries what is left.
        `drop_row=False` (fail_all) leaves the backend's row to `backend.reset()`."""
        released, req.reserved_tokens = req.reserved_tokens, 0
        self.active_kv_reserved -= released
        if self.remote is not None:  # its prompt on the prefill worker: dropped there too
            self.remote.forget(req.request_id)
        if self.block_manager is not None:
            self.block_manager.free(req.request_id)
        if drop_row:
            self.backend.remove_row(req)
        return released

    # ---------------------------------------------------------------- T4
    def decode_step(self) -> DecodeRecord:
        """T4: one batched forward for all active rows; one new token each,
        streamed at once. A row that hits EOS / stop / max_tokens gets its
        finish reason here and is evicted by the next tick's T3. First the admission
        mode makes room for the step's new KV (preempt: P6), and each row's
        reservation grows by `admission.per_decode` (R1). In mixed_batch prefill the
        same forward carries the pieces T2 planned (Version B); a row whose final
        piece ran gets its first token and is promoted (C3), and decodes from the
        next tick.

        Before: T3 ran, so no row in `active` is finished (T5); a finished row
        here raises instead of being skipped, so a reordered tick cannot pass
        unnoticed. After: every active row has exactly one more output token.
        """
        rec = DecodeRecord()
        with self.lock:
            finished = [r.request_id for r in self.active if r.finish_reason is not None]
            if finished:  # T5 broken: no silent skip, or a reordered tick would go unnoticed
                raise RuntimeError(
                    f"T5: decode_step found finished rows {finished} in `active`; run "
                    "evict_finished before decode_step (a finished row is never decoded again)")
            rec.preempted = self.admission.make_room(self)
            rows = list(self.active)
            # mixed_batch: the pieces T2 planned, minus rows T3 evicted or preempted
            planned = [(r, c) for r, c in self._planned if r in self.prefilling]
            self._planned = []
            if rows or planned:
                execute.run_decode(self, rows, planned, rec)
            rec.kv_length = self.kv_length_metric = self.backend.kv_length
        return rec

    # ================================================================= a request's end
    def _finish(self, req: Request, reason: FinishReason, rejection: Rejection | None = None,
                error: str | None = None) -> None:
        """Mark finished and send the client's final event."""
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.rejection = rejection or req.rejection
        req.error = error or req.error
        req.timing.finished = time.perf_counter()
        with self.queue_lock:
            self.requests.pop(req.request_id, None)
            self.recent_finished[req.request_id] = records.finished_summary(req)
            while len(self.recent_finished) > self.RECENT:
                self.recent_finished.popitem(last=False)
            try:
                if req.policy_running:  # the policy picked it: tell it it stopped
                    req.policy_running = False
                    self.policy.on_request_finished(req)
            except Exception as e:  # the policy's cleanup failed: the client still gets its end
                failures.note_hook_error(self, "on_request_finished", e)
        self.finished_count += 1
        if req.handle is not None:
            out = RequestOutput.from_request(req, req.handle.text)
            req.handle._finish(out, reason.value,
                               rejection=rejection.to_dict() if rejection else None, error=req.error)

    def fail_all(self, error: str) -> int:
        """A tick raised outside any one row: end every running request with `error`,
        giving back what it held (R1/R2 hold after). Never raises (failures.py)."""
        return failures.fail_all(self, error)

    def abort_all(self, error: str) -> int:
        """Shutting down: end every request, running or waiting (R2 after; failures.py)."""
        return failures.abort_all(self, error)

    # ================================================================= inspection
    @property
    def pending(self) -> list[Request]:
        with self.queue_lock:
            return list(self.policy)

    def has_work(self) -> bool:
        return bool(len(self.policy) or self.prefilling or self.active)

    def check_invariants(self) -> None:
        """R1 + queue membership (Q) + backend bookkeeping (R3). Tests call this after every phase."""
        with self.lock, self.queue_lock:
            pending = list(self.policy)
            expect = sum(r.reserved_tokens for r in self.prefilling + self.active)
            assert self.active_kv_reserved == expect, f"R1: reserved {self.active_kv_reserved} != {expect}"
            self.admission.check_rows(self)  # each row's reservation, as its mode says
            ids = [r.request_id for r in pending + self.prefilling + self.active]
            assert len(ids) == len(set(ids)), "a request sits in two queues"
            assert set(ids) == set(self.requests), "Q: tracked requests != queued requests"
            assert all(r.status is RequestStatus.PENDING for r in pending)
            assert all(r.status is RequestStatus.PREFILLING for r in self.prefilling)
            assert all(r.status is RequestStatus.ACTIVE for r in self.active)
            assert all(0 <= r.num_computed_prompt_tokens < r.prefill_len for r in self.prefilling)
            assert len(self.prefilling) + len(self.active) <= self.config.max_batch_size
            assert self.backend.num_rows == len(self.active), "backend rows != active"
            self.backend.check_invariants()
            if self.remote is not None:
                self.remote.check_invariants()
                prefilling = {r.request_id for r in self.prefilling}
                assert set(self.remote.arrived) <= prefilling, "KV arrived for a row not prefilling"
            if self.block_manager is not None:
                self.block_manager.check_invariants()
                for r in self.prefilling + self.active:
                    assert self.block_manager.has_seq(r.request_id)

    def is_drained(self) -> bool:
        """R2: nothing queued, nothing reserved, no block referenced."""
        with self.lock, self.queue_lock:
            blocks_idle = True
            if self.block_manager is not None:
                blocks_idle = self.block_manager.stats()["used"] == 0
            return (not self.has_work() and self.active_kv_reserved == 0 and blocks_idle
                    and self.backend.num_rows == 0 and not self.requests)

    def stats(self) -> dict[str, Any]:
        """SPEC G5: queues, reservation, gate counters, KV pressure, policy counters
        (`records.stats`)."""
        return records.stats(self)

