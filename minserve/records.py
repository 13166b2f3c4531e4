"""What each tick phase did, as plain data (SPEC T6).

Every phase method returns one of these records. They are the single source
for stats, traces, figures and replay: a figure is drawn from records, never
from the scheduler's private state, so a saved trace can be replayed without a
model. Everything here is JSON-friendly (`to_dict`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class AdmitRecord:
    """T1: who entered `prefilling`, who is held at the head (and by which gate), who was refused."""

    admitted: list[dict[str, Any]] = field(default_factory=list)  # {request_id, cached_tokens, reserved}
    held: dict[str, Any] | None = None  # {request_id, rejection} of the soft-held head, if any
    rejected: list[dict[str, Any]] = field(default_factory=list)  # {request_id, rejection}
    cancelled: list[str] = field(default_factory=list)  # dropped from pending after a cancel
    failed: list[dict[str, Any]] = field(default_factory=list)  # {request_id, error}: admission raised


@dataclass
class PrefillRecord:
    """T2: prompt chunks pushed through the model this tick."""

    chunks: list[dict[str, Any]] = field(default_factory=list)
    # each: {request_id, start, end, final, first_token (on the final chunk)}
    promoted: list[str] = field(default_factory=list)  # rows that entered `active`
    failed: list[dict[str, Any]] = field(default_factory=list)  # {request_id, error}: its piece raised


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
