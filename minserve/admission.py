"""Admission: how much KV a request must be given to start, and what happens when a
running row would run out (SPEC R1, P6). The policy decides *who* goes next; the
admission mode decides *how much* it takes; the gates (gates.py) check the numbers.

Two modes, one contract (`EngineConfig.admission`, one object per engine):

    contract                     ReserveAdmission ("reserve")   PreemptAdmission ("preempt")
    need(req): admitted when     prompt + max_tokens fits        its prefill tokens + 1 fit next
      it fits (G2)               next to the reservations        to what running rows hold and
                                                                 the token each writes next (*)
    reserve(req): admission      prompt + max_tokens             its prefill tokens
      adds to R1
    per_decode: each decode      0 (reserved at admission)       1 token per row
      step adds to a row's R1
    make_room(s): start of T4    nothing: no row can run out     preempt the policy's victim
                                                                 until the step's tokens fit
    reclaim(s, req): T1, shares  preempt borrowed rows (shares.py) so that a request whose
      (H6), either mode          unit is owed a row fits: the same `preempt`, in both modes

(*) so admitting a request never forces a preemption in the same tick.

Reserving prompt + max_tokens means a running row can never run out of KV, at the price
of admitting fewer rows than memory could hold (most requests stop long before
max_tokens). Preempting admits on what the prompt needs now; when a decode step would not
fit, a running row's KV is released and it goes back to `pending`, to be recomputed
(prompt + the tokens so far) on re-admission (`PreemptAdmission.preempt`).

Where the KV grows is the backend's to say, not a name the scheduler tests:
`Backend.kv_grows_in_pool`. Padded: only the prompt's blocks are pooled; decode KV
lives in the backend's own tensors. Paged: decode keeps writing into the pool, so G3
counts blocks for what G2 counts, net of the blocks running rows will take
(`blocks_taken`), and preemption also watches the free blocks.

T1 asks the mode whom to admit and what holds it (`choose`: the gates' `verdict` on the
head, or on another session's request when the head's session or tenant holds its share,
`share_hold`); explain.py asks the same two questions. When a gate holds a request whose
tenant (or session) is owed a row, T1 asks `reclaim` to take back what others borrowed.

Taking back is preemption with recompute, in both modes, not swap: the row's KV is
dropped and recomputed on re-admission (prompt + its tokens so far), because that needs
no second memory tier and the stream already continues across it (`preempt`). Under
reserve this is the one place a row is preempted: only a borrowed row (beyond its
tenant's share, lent while nobody else wanted it) ever is; a row within its share keeps
reserve's promise that it runs to the end.

A mode holds no state: each method reads (and preempt changes) the scheduler `s` it is
given, so a lab that swaps the scheduler's backend, block manager or gates changes what
admission sees. Preempting goes through the scheduler's own `_release` (the one
subtractor of R1) and `_finish`, as eviction does.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from typing import Any

from . import failures, shares
from .request import FinishReason, Rejection, Request, RequestStatus


class Admission(ABC):
    """The contract (see the module docstring). Subclasses state `name`, `per_decode`,
    `need`, `reserve`, `check_kv`, `blocks_taken`, `check_rows`; `make_room` does
    nothing unless a mode can run out. `verdict`, `share_hold` and `choose` are T1's
    questions, the same for every mode: they ask the numbers the mode states."""

    name = "base"
    per_decode = 0  # tokens each decode step adds to a row's reservation (R1)

    @abstractmethod
    def need(self, req: Request) -> int:
        """Tokens of KV the request needs to be admitted (G2; the tenant share, H5)."""

    @abstractmethod
    def reserve(self, req: Request) -> int:
        """Tokens admission adds to the request's reservation and to R1."""

    @abstractmethod
    def check_kv(self, s, req: Request) -> Rejection | None:
        """G2: the scheduler's `gates.check_kv_budget`, asked this mode's numbers."""

    @abstractmethod
    def blocks_taken(self, s) -> int:
        """Free blocks that running rows will take before this request could (paged)."""

    def check_blocks(self, s, req: Request) -> Rejection | None:
        """G3: the blocks the request needs must be free, net of `blocks_taken`. Where
        decode KV grows into the pool, that is blocks for `need` tokens, and it can never
        fit if prompt + max_tokens is bigger than the pool; elsewhere only the prompt's
        (prefill's) blocks are pooled."""
        bm = s.block_manager
        if s.backend.kv_grows_in_pool:
            tokens, whole, taken = self.need(req), req.kv_need, self.blocks_taken(s)
        else:
            tokens, whole, taken = req.prefill_len, req.prompt_len, 0
        return s.gates.check_block_pool(
            blocks_needed=bm.blocks_needed(req.prefill_token_ids, tokens, salt=req.tenant),
            free_blocks=bm.num_free_blocks() - taken,
            prompt_blocks=bm.num_blocks_for(whole), num_blocks=bm.num_blocks)

    def make_room(self, s) -> list[dict[str, Any]]:
        """Start of T4: make sure this step's new KV fits. Returns the preemptions."""
        return []

    def verdict(self, s, req: Request) -> Rejection | None:
        """T1's verdict on `req`: a hard reject first (it can never fit: refuse it at once,
        never hold it behind a full batch or another gate's soft hold, G4), then the soft
        holds: G2's KV, a batch row, G3's free blocks, asked this mode's numbers."""
        g2 = self.check_kv(s, req)
        g3 = self.check_blocks(s, req) if s.block_manager is not None else None
        for r in (g2, g3):
            if r is not None and r.hard:
                return r
        rows = len(s.prefilling) + len(s.active)
        return g2 or s.gates.batch_slot_hold(rows, s.config.max_batch_size) or g3

    def book(self, s) -> shares.Book | None:
        """Who holds and who wants what now (shares.py), or None when shares are off."""
        if s.config.shares == "off":
            return None
        return shares.Book.count(s.prefilling + s.active, list(s.policy),
                                 s.config.max_batch_size, s.kv_budget_tokens)

    def share_hold(self, s, req: Request, book: shares.Book | None = None) -> Rejection | None:
        """Whether a share holds `req` back while another's request goes first (soft).

        `shares="equal"` (H6): admitting it would take its tenant (or its session inside
        the tenant) past its share of rows or KV now, while a unit under its share waits
        (`shares.holds`; `book` counted once per decision by the caller). The fixed caps,
        when set: `max_tenant_kv_share` (H5): a tenant whose rows reserve that share of
        the G2 budget (unless it holds nothing: a request always fits under its own
        `max_request_kv_share`); `max_rows_per_session`: a session holding that many rows."""
        book = book if book is not None else self.book(s)
        if book is not None:
            hold = shares.holds(book, req, self.need)
            if hold is not None:
                return hold
        running = s.prefilling + s.active
        share = s.config.max_tenant_kv_share
        if req.tenant is not None and share < 1:
            held = sum(r.reserved_tokens for r in running if r.tenant == req.tenant)
            hold = s.gates.tenant_share_hold(held, self.need(req), s.kv_budget_tokens, share)
            if hold is not None:
                return hold
        cap = s.config.max_rows_per_session
        if cap is None:
            return None
        rows = sum(r.session_id == req.session_id for r in running)
        return s.gates.session_cap_hold(req.session_id, rows, cap)

    def choose(self, s, head: Request, skip: Collection[str] = ()
               ) -> tuple[Request, Rejection | None]:
        """Whom T1 admits next and the verdict on it: the policy's `head`, unless it could
        pass but its session or tenant holds its share (`share_hold`); then the first
        waiting request (in the policy's order) of one that does not, if any. Then the
        gates decide; a soft hold stops T1 there (G4), so nobody is admitted past it:
        what bounds a waiting unit's wait (shares.py, "The bound"). Requests in `skip`
        (ids of rows taken back this tick, `reclaim`) are passed over, as if a share held
        them: a row given back waits for the next tick."""
        if head.request_id in skip:
            book, held = self.book(s), Rejection(
                gate="share", reason="taken_back", hard=False,
                message="taken back this tick for a tenant under its share; it may be "
                        "admitted again from the next tick")
        else:
            rejection = self.verdict(s, head)
            if rejection is not None and rejection.hard:
                return head, rejection
            book = self.book(s)
            held = self.share_hold(s, head, book)
            if held is None:
                return head, rejection
        other = next((r for r in s.policy if r.request_id not in skip
                      and self.share_hold(s, r, book) is None), None)
        return (head, held) if other is None else (other, self.verdict(s, other))

    def kv_in_use(self, s, rows_less: int = 0, tokens_less: int = 0) -> int:
        """The KV tokens G2 weighs a request's `need` against (`check_kv`), were `rows_less`
        rows holding `tokens_less` tokens gone: what running rows reserved, plus (preempt)
        the token each writes at the next decode."""
        rows = len(s.prefilling) + len(s.active) - rows_less
        return s.active_kv_reserved - tokens_less + self.per_decode * rows

    def room_without(self, s, req: Request, rows: list[Request]) -> bool:
        """Were `rows` gone, `req` would find a batch row and its KV (G2)."""
        freed = sum(r.reserved_tokens for r in rows)
        return (len(s.prefilling) + len(s.active) - len(rows) < s.config.max_batch_size
                and self.kv_in_use(s, len(rows), freed) + self.need(req) <= s.kv_budget_tokens)

    def reclaim(self, s, req: Request, rejection: Rejection | None) -> list[dict[str, Any]]:
        """T1, shares on (H6): `req` is the request T1 chose and a gate soft-holds it
        (`rejection`: a full batch, G2 or G3). If its tenant (or its session inside the
        tenant) is owed a row, take back rows others borrowed: `shares.to_take_back`,
        newest first, each preempted (`preempt`: recompute), until `req` passes the gates.

        Only the fewest that make room for a batch row and for `req`'s KV (G2), and only if
        some do; nothing when rows that have finished (evicted by this tick's T3, after
        T1: T5) make that room already, so `req` is admitted at the next tick either way.
        Otherwise nothing is taken and `req` waits for rows to end, as before. Returns the
        preemptions (the admit record's `reclaimed`).
        After: R1 holds (`preempt` gives back through `s._release`); no row within its
        unit's share was touched, nor a row that has finished."""
        if (rejection is None or rejection.hard or rejection.gate == "share"
                or s.config.reclaim == "off"):
            return []
        book = self.book(s)
        if book is None:
            return []
        leaving = [r for r in s.prefilling + s.active
                   if r.finish_reason is not None or r.cancel_requested]
        if leaving and self.room_without(s, req, leaving):
            return []  # T3 frees the room this tick: admitted at the next, nothing taken
        victims = [v for v in shares.to_take_back(book, req, self.need)
                   if not any(v is r for r in leaving)]
        k = next((k for k in range(1, len(victims) + 1)  # the fewest, newest first
                  if self.room_without(s, req, leaving + victims[:k])), None)
        out = []
        for v in victims[:k or 0]:
            who = shares.path(v)[0][0]
            out.append({**self.preempt(s, v, f"taken back for {req.request_id}: {who!r} "
                                             "held it beyond its share (H6)"),
                        "for": req.request_id, "from_unit": who})
            s.reclaimed_rows += 1
            if self.verdict(s, req) is None:
                break
        return out

    @staticmethod
    def preempt(s, req: Request, why: str) -> dict[str, Any]:
        """Send a running row back to `pending` (P6, and `reclaim` in either mode). Its
        reservation and blocks go back through `s._release`, the same single subtractor as
        eviction (R1); the policy re-queues it (`on_request_preempted`: FCFS by its old
        key, the fair policy with its counter kept). On re-admission it prefills prompt +
        the tokens it has produced so far (`prefill_token_ids`), then samples its next
        token: the client's stream goes on. Returns what the decode record lists."""
        queue = s.prefilling if any(r is req for r in s.prefilling) else s.active
        held = (req.num_computed_prompt_tokens if queue is s.prefilling
                else req.num_tokens - 1)  # KV it holds: all but the token not yet fed
        bm = s.block_manager
        blocks = len(bm.block_table(req.request_id)) if bm is not None else 0
        if bm is not None and s.backend.kv_grows_in_pool and queue is s.active:
            # its decoded tokens' full blocks become cache entries, so re-admission
            # may find them instead of recomputing (the KV is in the pool)
            bm.mark_computed(req.request_id, req.prompt_token_ids + req.output_token_ids, held)
        released = s._release(req)
        queue.remove(req)
        req.kv_high_water = max(req.kv_high_water, held)
        req.recompute_token_ids = list(req.output_token_ids)
        req.num_computed_prompt_tokens = req.num_cached_tokens = 0
        req.num_preemptions += 1
        s.preemptions += 1
        req.status = RequestStatus.PENDING
        with s.queue_lock:
            req.policy_running = False
            try:
                s.policy.on_request_preempted(req)
            except Exception as e:  # it is in no queue now: end it rather than lose it
                if any(r is req for r in s.policy):
                    s.policy.remove(req)
                failures.note_row_error(s, req, "on_request_preempted", e)
                s._finish(req, FinishReason.ERROR, error=req.error)
        return {"request_id": req.request_id, "from_queue": "prefilling" if queue is
                s.prefilling else "active", "released_tokens": released,
                "released_blocks": blocks, "tokens_so_far": len(req.output_token_ids),
                "why": why}

    @abstractmethod
    def check_rows(self, s) -> None:
        """Assert each running row's reservation is what this mode says (R1 per row)."""


class ReserveAdmission(Admission):
    """Reserve prompt + max_tokens at admission (the default): a running row can never
    run out of KV, so decode adds nothing and nothing is ever preempted."""

    name = "reserve"

    def need(self, req: Request) -> int:
        return req.kv_need  # prompt_len + max_tokens

    def reserve(self, req: Request) -> int:
        return req.kv_need

    def check_kv(self, s, req: Request) -> Rejection | None:
        """Hard: prompt + max_tokens exceeds the whole budget. Soft: it does not fit
        next to what the running rows reserved."""
        return s.gates.check_kv_budget(req.kv_need, s.active_kv_reserved, s.kv_budget_tokens)

    def blocks_taken(self, s) -> int:
        """The blocks running rows were promised and will take as they decode: so decode
        can never run out of blocks mid-flight."""
        bm = s.block_manager
        return sum(bm.num_blocks_for(r.kv_need) - len(bm.block_table(r.request_id))
                   for r in s.prefilling + s.active)

    def check_rows(self, s) -> None:
        assert all(r.reserved_tokens == r.kv_need for r in s.prefilling + s.active), \
            "R1 per row"


class PreemptAdmission(Admission):
    """Admit on what the prefill needs now; the reservation grows by one token per
    decode step (it is the KV the row holds after its next forward); when a step would
    not fit, `make_room` preempts (P6)."""

    name = "preempt"
    per_decode = 1

    def need(self, req: Request) -> int:
        return req.prefill_len + 1  # its prefill tokens and its first decoded token

    def reserve(self, req: Request) -> int:
        return req.prefill_len

    @staticmethod
    def decode_growth(s) -> int:
        """Tokens the next decode adds: one per row that will decode, the active rows and
        those that may be promoted by then."""
        return len(s.active) + len(s.prefilling)

    def check_kv(self, s, req: Request) -> Rejection | None:
        """Hard, as under reserve: prompt + max_tokens (`whole`) exceeds the whole budget,
        so it could not finish even alone. Soft: `need` does not fit next to what running
        rows hold plus the next decode's tokens."""
        return s.gates.check_kv_budget(self.need(req), s.active_kv_reserved + self.decode_growth(s),
                                       s.kv_budget_tokens, whole=req.kv_need)

    @staticmethod
    def next_decode_blocks(s, include_prefilling: bool = True) -> int:
        """Blocks the next decode takes from the pool (paged): one per active row whose next
        token starts a new block (and per prefilling row, which may decode by then, whose
        first decoded token would, unless `include_prefilling` is False)."""
        bm = s.block_manager
        n = sum(bm.num_blocks_for(r.num_tokens) > len(bm.block_table(r.request_id))
                for r in s.active)
        if include_prefilling:
            n += sum(bm.num_blocks_for(r.prefill_len + 1) > bm.num_blocks_for(r.prefill_len)
                     for r in s.prefilling)
        return n

    def blocks_taken(self, s) -> int:
        return self.next_decode_blocks(s)

    def make_room(self, s) -> list[dict[str, Any]]:
        """Before this decode writes one token of KV per active row, make sure that KV
        exists: while the G2 budget (or, where KV grows in the pool, the free blocks)
        cannot take one more token per row, preempt the policy's victim (lowest priority,
        latest arrival) among the running rows. Prefill never needs room: admission gave
        a row all of its prefill KV (G2, G3), so only decode grows.

        After: active_kv_reserved + len(active) <= kv_budget_tokens, and the active rows'
        next tokens fit the free blocks. Always reachable: a request that could not fit
        alone was refused at admission."""
        out = []
        while s.prefilling or s.active:
            over_budget = s.active_kv_reserved + len(s.active) > s.kv_budget_tokens
            over_blocks = (s.backend.kv_grows_in_pool and self.next_decode_blocks(s, False)
                           > s.block_manager.num_free_blocks())
            if not (over_budget or over_blocks):
                break
            why = (f"kv_budget: {s.active_kv_reserved} reserved + {len(s.active)} new tokens "
                   f"> {s.kv_budget_tokens}" if over_budget else
                   f"block_pool: {s.block_manager.num_free_blocks()} free blocks")
            out.append(self.preempt(s, self.victim(s), why))
        return out

    def victim(self, s) -> Request:
        """The running row to preempt: the policy's `choose_victim` (lowest priority, then
        latest arrival); if that hook raises, FCFS's choice, the latest arrival. With
        shares (H6), chosen among the rows of the unit furthest above its KV share,
        counted with what its rows grew since admission (`shares.first_victims`)."""
        running = s.prefilling + s.active
        book = self.book(s)
        if book is not None:
            running = shares.first_victims(book, running)
        with s.queue_lock:
            try:
                return s.policy.choose_victim(running)
            except Exception as e:
                failures.note_hook_error(s, "choose_victim", e)
                return max(running, key=lambda r: r.arrival_seq)

    def check_rows(self, s) -> None:
        """The KV each row holds after its last forward, within the budget."""
        assert all(r.reserved_tokens == r.prefill_len for r in s.prefilling), "R1 row"
        # (a row whose sampling failed after the forward holds its fed token too)
        assert all(r.reserved_tokens == r.num_tokens - 1 or r.finish_reason is
                   FinishReason.ERROR for r in s.active), "R1 row"
        assert s.active_kv_reserved <= s.kv_budget_tokens, "R1: over budget"


MODES = {mode.name: mode for mode in (ReserveAdmission, PreemptAdmission)}
