"""What each tick phase did, as plain data (SPEC T6).

Every phase method returns one of these records. They are the single source
for stats, traces, figures and replay: a figure is drawn from records, never
from the scheduler's private state, so a saved trace can be replayed without a
model. Everything here is JSON-friendly (`to_dict`). `snapshot(scheduler)` is the
engine *now* as a TickRecord (what `end_tick` returns, and a tick drawn half-way), and
`stats(scheduler)` its counters (G5): both read a scheduler, change nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from . import shares


@dataclass
class AdmitRecord:
    """T1: who entered `prefilling`, who is held at the head (and by which gate), who was refused."""

    admitted: list[dict[str, Any]] = field(default_factory=list)  # {request_id, cached_tokens, reserved}
    held: dict[str, Any] | None = None  # {request_id, rejection} of the soft-held head, if any
    rejected: list[dict[str, Any]] = field(default_factory=list)  # {request_id, rejection}
    cancelled: list[str] = field(default_factory=list)  # dropped from pending after a cancel
    failed: list[dict[str, Any]] = field(default_factory=list)  # {request_id, error}: admission raised
    # shares (H6): borrowed rows taken back (preempted) so that a request owed a row fits;
    # each as DecodeRecord.preempted's, plus {for: the request it made room for, from_unit}
    reclaimed: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class PrefillRecord:
    """T2: prompt chunks pushed through the model this tick."""

    chunks: list[dict[str, Any]] = field(default_factory=list)
    # each: {request_id, start, end, final, first_token (on the final chunk)}
    promoted: list[str] = field(default_factory=list)  # rows that entered `active`
    failed: list[dict[str, Any]] = field(default_factory=list)  # {request_id, error}: its piece raised
    # prefill_mode="disaggregated": {sent: [ids], pieces: {id: [start, end]} sent,
    # forward_tokens: their forward's padded size, waiting: {id: why not sent},
    # on_worker: [ids], transfers: {id: {blocks, bytes, ms, bytes_to_worker, worker_ms}}};
    # `chunks` holds the pieces the worker finished (`on_worker: True`)
    remote: dict[str, Any] = field(default_factory=dict)


@dataclass
class EvictRecord:
    """T3: rows that left, why, and the reservation each gave back (R1)."""

    evicted: list[dict[str, Any]] = field(default_factory=list)
    # each: {request_id, finish_reason, released_tokens, from_queue}


@dataclass
class DecodeRecord:
    """T4: one batched forward; one token per row."""

    rows: list[str] = field(default_factory=list)  # request ids in the batch
    tokens: dict[str, int] = field(default_factory=dict)
    positions: dict[str, int] = field(default_factory=dict)  # position id each new token was fed at
    finished: dict[str, str] = field(default_factory=dict)  # request_id -> finish reason (evicted next tick)
    kv_length: int = 0  # backend metric after the step
    failed: list[dict[str, Any]] = field(default_factory=list)  # {request_id, error}: forward or sampling raised
    # admission="preempt": rows sent back to `pending` before the forward, to make room
    preempted: list[dict[str, Any]] = field(default_factory=list)
    # each: {request_id, from_queue, released_tokens, released_blocks, tokens_so_far, why}


@dataclass
class TickRecord:
    """One whole tick: the four phase records plus the queues afterwards."""

    tick: int
    admit: AdmitRecord
    prefill: PrefillRecord
    evict: EvictRecord
    decode: DecodeRecord
    queues: dict[str, list[str]] = field(default_factory=dict)  # pending/prefilling/active ids
    active_kv_reserved: int = 0
    duration_s: float = 0.0
    requests: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> small card (viz)
    backend: dict[str, Any] = field(default_factory=dict)  # backend.snapshot() after the tick
    blocks: list[dict[str, Any]] | None = None  # block manager snapshot, when there is one
    policy: dict[str, Any] = field(default_factory=dict)  # policy.stats() after the tick
    forwards: list[int] = field(default_factory=list)  # tokens in each model forward it ran

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ================================================================ the scheduler as data
def card(req) -> dict[str, Any]:
    """The small per-request summary a TickRecord keeps (for queue figures)."""
    return {"session": req.session_id, "priority": req.priority, "prompt_len": req.prompt_len,
            "computed": req.num_computed_prompt_tokens, "cached": req.num_cached_tokens,
            "output_len": len(req.output_token_ids), "max_tokens": req.max_tokens,
            "status": req.status.value, "preemptions": req.num_preemptions,
            "recompute": len(req.recompute_token_ids)}


def finished_summary(req) -> dict[str, Any]:
    """A finished request in a few fields: what the scheduler keeps of its newest finished
    requests (`recent_finished`), for `explain` to answer about them."""
    out = {"request_id": req.request_id, "state": "finished", "session": req.session_id,
           "finish_reason": req.finish_reason.value if req.finish_reason else None,
           "tokens_so_far": len(req.output_token_ids), "preemptions": req.num_preemptions}
    if req.rejection is not None:
        out["rejection"] = req.rejection.to_dict()
    if req.error:
        out["error"] = req.error
    return out


def snapshot(s, admit: AdmitRecord | None = None, prefill: PrefillRecord | None = None,
             evict: EvictRecord | None = None, decode: DecodeRecord | None = None,
             duration_s: float = 0.0, tick: int | None = None) -> TickRecord:
    """The engine *now* as a TickRecord: the phase records given so far, empty ones
    for phases not run yet (to draw a tick half-way). `tick` defaults to the tick in
    progress."""
    with s.queue_lock:
        pending, policy = list(s.policy), s.policy.stats()
    reqs = pending + s.prefilling + s.active
    return TickRecord(
        tick=s.tick_count + 1 if tick is None else tick,
        admit=admit or AdmitRecord(), prefill=prefill or PrefillRecord(),
        evict=evict or EvictRecord(), decode=decode or DecodeRecord(),
        queues={"pending": [r.request_id for r in pending],
                "prefilling": [r.request_id for r in s.prefilling],
                "active": [r.request_id for r in s.active]},
        active_kv_reserved=s.active_kv_reserved, duration_s=duration_s,
        requests={r.request_id: card(r) for r in reqs},
        backend={**s.backend.snapshot(), **({"prefill_worker": s.remote.snapshot()}
                                            if s.remote is not None else {})}, policy=policy,
        blocks=s.block_manager.snapshot() if s.block_manager is not None else None)


def stats(s) -> dict[str, Any]:
    """SPEC G5: queues, reservation, gate counters, KV pressure, policy counters."""
    with s.queue_lock:
        pending, policy = len(s.policy), s.policy.stats()
        book = s.admission.book(s)  # shares (H6), None when off
        if book is not None:
            held = {n for n, r in book.first.items()
                    if len(n) == 1 and shares.holds(book, r, s.admission.need) is not None}
    out: dict[str, Any] = {
        "ticks": s.tick_count,
        "queues": {"pending": pending, "prefilling": len(s.prefilling),
                   "active": len(s.active)},
        "max_queue_size": s.config.max_queue_size,
        "max_batch_size": s.config.max_batch_size,
        "active_kv_reserved": s.active_kv_reserved,
        "kv_budget_tokens": s.kv_budget_tokens,
        "kv_admit_blocked": dict(s.kv_admit_blocked),
        "rejected": dict(s.rejected),
        "finished": s.finished_count,
        "failed_rows": s.failed_rows,
        "tokens_generated": s.tokens_generated,
        "prompt_tokens_computed": s.prompt_tokens_computed,
        "admission": s.config.admission,
        "preemptions": s.preemptions,
        "reclaimed_rows": s.reclaimed_rows,  # of those, borrowed rows taken back (H6)
        "recomputed_tokens": s.recomputed_tokens,
        "kv_length": s.kv_length_metric,  # read under the tick lock, by T4
        "backend": s.backend.name,
        "prefill_mode": s.config.prefill_mode,
        "policy": policy,
    }
    if s.remote is not None:  # disaggregated: the prefill worker and its transfers
        out["prefill_worker"] = s.remote.snapshot()
    if book is not None:  # per tenant (sessions): holds, share now, borrowing, held back
        out["shares"] = shares.table(book, held)
    if s.block_manager is not None:
        b = s.block_manager.stats()
        out["blocks"] = b
        out["kv_pressure"] = b["kv_pressure"]
    else:
        out["kv_pressure"] = s.active_kv_reserved / s.kv_budget_tokens
    return out
