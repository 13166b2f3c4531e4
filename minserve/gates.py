"""Backpressure: the three gates a request passes before it starts (SPEC G).

    submit ──► G1 queue capacity ──► pending ──► G2 active-KV budget ──► G3 block pool ──► prefilling
               (refuse at once)                  (hold, or refuse if it can never fit)

Each gate answers with `None` (pass) or a `Rejection` that names the gate and
carries the numbers that decided it (G6). A *soft* rejection is a hold: the
request stays at the head of `pending`, order and fairness kept, and admit
tries again next tick (G4). A *hard* rejection means it can never pass on this
engine, so the client gets an answer (HTTP 429 + reason) instead of a hang.

Why a reservation (G2) and not just free memory: a request admitted now will
grow by up to `max_tokens` more tokens of KV. Reserving `prompt_len +
max_tokens` up front means an admitted request can always finish; without it,
the engine must preempt: admit on what the prompt needs now, and when memory runs
out, drop a running request's KV and recompute it later. minserve builds both
(`EngineConfig.admission`, "reserve" by default, "preempt"; P6): the gates are
the same functions, asked about a different `need` (admission.py states each mode's).

Pure functions: the scheduler owns the numbers and the counters.
"""

from __future__ import annotations

from .request import Rejection


def check_queue_capacity(pending: int, max_queue_size: int) -> Rejection | None:
    """G1, at submit: a full pending queue refuses at once (never queues unboundedly)."""
    if pending >= max_queue_size:
        return Rejection(
            gate="G1", reason="queue_full", hard=True,
            message=f"the pending queue is full ({pending}/{max_queue_size}); retry later",
            numbers={"pending": pending, "max_queue_size": max_queue_size})
    return None


def check_kv_budget(need: int, reserved: int, budget: int,
                    whole: int | None = None) -> Rejection | None:
    """G2, at admit: reserve `need` tokens of KV out of `budget` (admission="reserve":
    prompt_len + max_tokens; "preempt": what the prompt needs now, `whole` being
    prompt_len + max_tokens, the most it may ever hold).

    whole > budget             -> hard: it could never finish, even alone.
    reserved + need > budget   -> soft: wait until running requests finish.
    """
    whole = need if whole is None else whole
    numbers = {"need": need, "active_kv_reserved": reserved, "kv_budget_tokens": budget}
    if whole > budget:
        if whole != need:  # preempt: say what could never fit, beside what it needs now
            numbers["prompt_plus_max_tokens"] = whole
        return Rejection(gate="G2", reason="kv_budget_exceeded", hard=True, numbers=numbers,
                         message=f"prompt + max_tokens = {whole} tokens exceeds the whole KV "
                                 f"budget of {budget} tokens; shorten the prompt or max_tokens")
    if reserved + need > budget:
        return Rejection(gate="G2", reason="kv_budget", hard=False, numbers=numbers,
                         message=f"{reserved} of {budget} KV tokens are reserved; "
                                 f"this request needs {need} more")
    return None


def check_block_pool(blocks_needed: int, free_blocks: int, prompt_blocks: int,
                     num_blocks: int) -> Rejection | None:
    """G3, at admit: the request's uncached blocks must be free (or evictable) now.

    What a request needs from the pool is its prompt's blocks; with the paged
    backend, whose KV grows into the pool while decoding, prompt + max_tokens
    (the admission mode decides, `Admission.check_blocks`, and passes `free_blocks`
    net of blocks promised to running rows).

    prompt_blocks > num_blocks  -> hard: the request alone is bigger than the pool.
    blocks_needed > free_blocks -> soft: wait for blocks to be released.
    """
    numbers = {"blocks_needed": blocks_needed, "free_blocks": free_blocks,
               "prompt_blocks": prompt_blocks, "num_blocks": num_blocks}
    if prompt_blocks > num_blocks:
        return Rejection(gate="G3", reason="prompt_exceeds_block_pool", hard=True, numbers=numbers,
                         message=f"this request needs {prompt_blocks} KV blocks; the pool has "
                                 f"{num_blocks} in all")
    if blocks_needed > free_blocks:
        return Rejection(gate="G3", reason="block_pool", hard=False, numbers=numbers,
                         message=f"this request needs {blocks_needed} more KV blocks; "
                                 f"{free_blocks} are free")
    return None


def session_cap_hold(session: str, rows: int, cap: int | None) -> Rejection | None:
    """Not a gate either: the head's session already holds `cap` batch rows, so the next
    waiting request of another session goes first (soft; `max_rows_per_session`)."""
    if cap is not None and rows >= cap:
        return Rejection(gate="batch", reason="session_cap", hard=False,
                         # (no name: explain shows this to other sessions too, H5)
                         message=f"its session already holds {rows} batch rows, its "
                                 f"cap; other sessions go first",
                         numbers={"session_rows": rows, "max_rows_per_session": cap})
    return None


def tenant_share_hold(held: int, need: int, budget: int, share: float) -> Rejection | None:
    """Not a gate either: the request's tenant already reserves `held` of the `share` of
    the G2 budget one tenant may hold, so another tenant's request goes first (soft;
    `max_tenant_kv_share`, H5). A tenant holding nothing is never held: a request always
    fits under its own `max_request_kv_share`."""
    limit = int(share * budget)
    if held and held + need > limit:
        return Rejection(gate="G2", reason="tenant_share", hard=False,
                         message=f"its tenant's rows reserve {held} of the {limit} KV "
                                 f"tokens one tenant may hold (max_tenant_kv_share="
                                 f"{share:g}); other tenants go first",
                         numbers={"tenant_reserved": held, "need": need, "tenant_limit": limit})
    return None


def batch_slot_hold(rows: int, max_batch_size: int) -> Rejection | None:
    """Not a gate of its own: every batch row is taken, so the head waits (soft)."""
    if rows >= max_batch_size:
        return Rejection(gate="batch", reason="batch_full", hard=False,
                         message=f"all {max_batch_size} batch rows are busy",
                         numbers={"rows": rows, "max_batch_size": max_batch_size})
    return None
