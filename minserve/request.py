"""A request's life, as explicit state.

    submit ──G1──> PENDING ──admit (G2,G3)──> PREFILLING ──last chunk──> ACTIVE ──> FINISHED
                     │  ▲ soft-hold                │                       │
                     │  └──────┘                   └── cancel ─────────────┴──> FINISHED
                     └── hard-reject / cancel ────────────────────────────────> FINISHED

Every request is in exactly one of the scheduler's queues (pending, prefilling,
active) or finished (SPEC Q). `status` says which; the scheduler's
`check_invariants()` verifies that the queues agree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import torch

from .sampling import SamplingParams


class RequestStatus(str, Enum):
    PENDING = "pending"  # Q1: waiting for admission
    PREFILLING = "prefilling"  # Q2: prompt going through the model, chunk by chunk
    ACTIVE = "active"  # Q3: a row of the decode batch
    FINISHED = "finished"  # left the engine; finish_reason says why


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # the client went away or called cancel()
    ERROR = "error"  # rejected by a gate (see `rejection`) or a failure in the engine


class Sink(Protocol):
    """Where the tick posts a request's tokens and its end (execute.py, `Scheduler._finish`).
    The engine's front gives every request a `streaming.RequestHandle`, which detokenizes
    and streams; the core knows only these three members of it."""

    @property
    def text(self) -> str: ...  # the text so far, for the final RequestOutput

    def _on_token(self, index: int, token_id: int) -> bool: ...  # True: a stop string ended it

    def _finish(self, output: RequestOutput, finish_reason: str,
                rejection: dict[str, Any] | None = None, error: str | None = None) -> None: ...


@dataclass(frozen=True)
class Rejection:
    """Why a gate refused a request (SPEC G6): the gate, a reason code, the numbers.

    `gate` is "G1" (queue capacity), "G2" (active-KV budget) or "G3" (block pool).
    `hard` is False for a soft hold (retried next tick) and True for a refusal.
    """

    gate: str
    reason: str  # machine-readable: queue_full, kv_budget, kv_budget_exceeded, ...
    message: str  # for people
    numbers: dict[str, Any] = field(default_factory=dict)
    hard: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"gate": self.gate, "reason": self.reason, "message": self.message,
                "numbers": dict(self.numbers), "hard": self.hard}


@dataclass
class RequestTiming:
    """Wall-clock stamps (time.perf_counter) and counts: where a request's time went."""

    arrival: float = 0.0
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    prefill_chunks: int = 0

    def to_dict(self) -> dict[str, Any]:
        def since(t: float | None) -> float | None:
            return None if t is None else round(t - self.arrival, 6)

        return {"queue_time": since(self.admitted), "ttft": since(self.first_token),
                "e2e": since(self.finished), "prefill_chunks": self.prefill_chunks}


@dataclass
class Request:
    """One request inside the engine. Mutated only by the scheduler's tick."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_seq: int  # global order of arrival: the FCFS tie-break (P1)
    session_id: str = "default"  # the fair policy's session (P2)
    # H5: the tenant whose key sent it (None: no tenants, as in a notebook). It salts the
    # prefix cache's hashes, and the fair policy counts per tenant.
    tenant: str | None = None
    priority: int = 0  # higher runs first, for every policy
    eos_token_ids: tuple[int, ...] = ()

    status: RequestStatus = RequestStatus.PENDING
    output_token_ids: list[int] = field(default_factory=list)
    # tokens of `prefill_token_ids` whose KV exists (cached + prefilled); the prompt's, until
    # a preemption makes the prefill sequence prompt + output so far
    num_computed_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # of those, taken from the prefix cache instead of computed
    reserved_tokens: int = 0  # this row's part of active_kv_reserved (R1); 0 when none held
    # --- preemption (admission="preempt") ---
    recompute_token_ids: list[int] = field(default_factory=list)  # outputs to recompute
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0  # prompt or output tokens whose KV was computed again
    kv_high_water: int = 0  # most tokens of KV it ever held: beyond it nothing is recomputed
    policy_running: bool = False  # the policy picked it and has not been told it stopped
    finish_reason: FinishReason | None = None
    rejection: Rejection | None = None
    error: str | None = None
    cancel_requested: bool = False
    generator: torch.Generator | None = None  # per-request RNG (sampling.py)
    timing: RequestTiming = field(default_factory=RequestTiming)
    handle: Sink | None = None  # where tokens are streamed (a streaming.RequestHandle)

    def __post_init__(self) -> None:
        assert len(self.prompt_token_ids) >= 1, "a request needs at least one prompt token"
        if not self.timing.arrival:
            self.timing.arrival = time.perf_counter()

    # --- sizes -----------------------------------------------------------------------
    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens

    @property
    def kv_need(self) -> int:
        """Tokens of KV this request may ever hold: what G2 reserves (R1)."""
        return self.prompt_len + self.max_tokens

    @property
    def prefill_token_ids(self) -> list[int]:
        """The tokens admission must (re)compute the KV of: the prompt, and after a
        preemption also the output tokens produced so far. Its last token is what the
        final prefill chunk samples after, so the stream continues where it stopped."""
        return self.prompt_token_ids + self.recompute_token_ids

    @property
    def prefill_len(self) -> int:
        return self.prompt_len + len(self.recompute_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens so far."""
        return self.prompt_len + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    # --- stopping ---------------------------------------------------------------------------
    def stop_reason_after(self, token_id: int) -> FinishReason | None:
        """Whether the token just appended ends the request (A1), by ids alone.

        Stop *strings* are checked on text by the handle's detokenizer (streaming.py).
        """
        p = self.sampling
        if not p.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.STOP
        if token_id in p.stop_token_ids:
            return FinishReason.STOP
        if len(self.output_token_ids) >= p.max_tokens:
            return FinishReason.LENGTH
        return None


@dataclass
class RequestOutput:
    """What `Engine.generate` returns for one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    rejection: dict[str, Any] | None = None
    num_cached_tokens: int = 0
    timing: dict[str, Any] = field(default_factory=dict)
    num_preemptions: int = 0  # what it cost beyond one pass: a server's usage per tenant
    num_recomputed_tokens: int = 0
    # prompt tokens whose KV was computed or found in the prefix cache: all of them once
    # it ran, 0 for a request that ended (cancelled, refused) before admission
    num_prompt_tokens_processed: int = 0

    @classmethod
    def from_request(cls, req: Request, text: str) -> RequestOutput:
        return cls(request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids),
                   token_ids=list(req.output_token_ids), text=text,
                   finish_reason=req.finish_reason.value if req.finish_reason else None,
                   rejection=req.rejection.to_dict() if req.rejection else None,
                   num_cached_tokens=req.num_cached_tokens, timing=req.timing.to_dict(),
                   num_preemptions=req.num_preemptions,
                   num_recomputed_tokens=req.num_recomputed_tokens,
                   num_prompt_tokens_processed=min(req.prompt_len, max(
                       req.kv_high_water, req.num_computed_prompt_tokens)))
