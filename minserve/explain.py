"""Why is my request not running yet? One structured answer and one sentence (P6, G6).

    engine.explain("req-7")
    {"request_id": "req-7", "state": "pending", "position": 3, "ahead": 3,
     "held_by": {"gate": "G2", "reason": "kv_budget", "numbers": {...}},
     "sentence": "waiting: 3 requests ahead of you; the head is held by G2: 3900 of 4096
                  KV tokens are reserved, it needs 600", ...}

Where a request can be, and what is said about it:

    pending, head        the gates' verdict on it right now (batch full, G2, G3, the
                         session cap), or "admitted at the next tick"
    pending, not head    its position, how many are ahead, and what holds the head
    prefilling           prompt tokens computed so far
    active               tokens so far, its reservation
    any of those         preemptions so far and what re-admission will recompute;
                         under the fair policy its session's counter against the
                         lowest counter among waiting sessions (who goes next)
    with shares (H6)     its tenant's share now and what it holds; a waiting request
                         owed a row that others borrowed: "lent to X, being taken back"
                         (at the next tick's T1); a borrowed row: that it is lent, and
                         taken back when one under its share waits
    finished             its finish reason (kept for the last `Scheduler.RECENT` requests)
    unknown              never seen, or finished long ago

Read-only: the gates are pure functions asked about numbers the scheduler holds;
nothing is admitted, reserved or charged by asking. It takes the tick lock, so the
answer describes the engine between two ticks, never half-way through one.
"""

from __future__ import annotations

from typing import Any

from . import shares
from .request import Request


def explain(scheduler, request_id: str, others_private: bool = False) -> dict[str, Any]:
    """Where `request_id` is and why, as plain data with a `sentence` for people.

    `others_private`: the sentence says of a head that is another request only what any
    client may see of the server's load (rows, KV reserved, free blocks), never that
    request's own numbers (what it needs, its session's rows): how the HTTP server
    answers one tenant about a queue that holds others' requests (H5)."""
    s = scheduler
    with s.lock, s.queue_lock:
        req = s.requests.get(request_id)
        if req is None:
            done = s.recent_finished.get(request_id)
            if done is None:
                return {"request_id": request_id, "state": "unknown",
                        "sentence": "unknown: no such request (or it finished long ago)"}
            return {**done, "sentence": _finished_sentence(done)}
        out: dict[str, Any] = {
            "request_id": request_id, "state": req.status.value, "session": req.session_id,
            "priority": req.priority, "prompt_tokens": req.prompt_len,
            "tokens_so_far": len(req.output_token_ids), "max_tokens": req.max_tokens,
            "reserved_tokens": req.reserved_tokens, "preemptions": req.num_preemptions,
            "admission": s.config.admission}
        fair = _fair_view(s, req)
        if fair is not None:
            out["fair"] = fair
        if any(r is req for r in s.prefilling):
            out.update(queue="prefilling", computed=req.num_computed_prompt_tokens,
                       to_compute=req.prefill_len)
            out["sentence"] = (f"prefilling: {req.num_computed_prompt_tokens} of "
                               f"{req.prefill_len} prompt tokens computed"
                               + _recompute_note(req))
            if s.remote is not None:  # disaggregated: where its prompt is
                out["remote"] = _remote_view(s.remote, req)
                out["sentence"] = out["remote"]["sentence"]
            return _with_share(s, req, out, others_private)
        if any(r is req for r in s.active):
            out["queue"] = "active"
            out["sentence"] = (f"running: {len(req.output_token_ids)} of at most "
                               f"{req.max_tokens} tokens generated; it holds "
                               f"{req.reserved_tokens} tokens of KV reservation"
                               + _preempted_note(req))
            return _with_share(s, req, out, others_private)
        return _with_share(s, req, _pending(s, req, out, others_private), others_private)


def _remote_view(remote, req: Request) -> dict[str, Any]:
    """disaggregated: on the prefill worker (computing, or queued behind others), its KV
    back and about to be spliced in, or not sent yet (and why)."""
    snap = remote.snapshot()
    jobs = snap["on_worker"]
    rid, todo = req.request_id, req.prefill_len - req.num_computed_prompt_tokens
    mine = next((i for i, j in enumerate(jobs) if j["request_id"] == rid), None)
    if mine is not None:
        j = jobs[mine]
        state = ("being computed" if j["started"] else
                 f"queued there behind {sum(1 for x in jobs[:mine])} other prompt(s)")
        return {"where": "prefill worker", "started": j["started"], "sent_s_ago": j["waited_s"],
                "sentence": f"prefilling: your prompt is on the prefill worker ({todo} tokens, "
                            f"{state}, sent {j['waited_s']:.2f} s ago); its KV moves here when done"}
    if rid in snap["arrived"]:
        return {"where": "arrived", "sentence": "prefilling: the prefill worker is done; "
                                                "its KV is spliced in at the next tick"}
    why = snap["broken"] or "it goes to the prefill worker at the next tick"
    return {"where": "decode side", "sentence": f"prefilling: not on the prefill worker yet: {why}"}


def _pending(s, req: Request, out: dict[str, Any], others_private: bool) -> dict[str, Any]:
    order = list(s.policy)  # admission order
    pos = next(i for i, r in enumerate(order) if r is req)
    head = order[0]
    verdict = s.admission.verdict(s, head)
    if verdict is None or not verdict.hard:
        verdict = s.admission.share_hold(s, head) or verdict
    out.update(queue="pending", position=pos, ahead=pos, waiting=len(order),
               rows=len(s.prefilling) + len(s.active), max_batch_size=s.config.max_batch_size,
               kv_reserved=s.active_kv_reserved, kv_budget_tokens=s.kv_budget_tokens)
    if pos > 0 and verdict is not None and verdict.gate == "share":
        chosen, mine = s.admission.choose(s, head)  # shares (H6): it may go before the head
        if chosen is req:
            out["held_by"] = None if mine is None else {"request_id": req.request_id,
                                                         **mine.to_dict()}
            out["sentence"] = (f"next to be admitted, before the {pos} ahead of it, whose "
                               "shares hold them back: " + (
                                   _hold_words(mine) if mine is not None
                                   else "nothing holds it") + _preempted_note(req))
            return out
    if verdict is not None:
        out["held_by"] = {"request_id": head.request_id, **verdict.to_dict()}
    why = "nothing holds it" if verdict is None else (
        _load_words(verdict) if others_private and pos > 0 else _hold_words(verdict))
    if pos == 0:
        sentence = (f"waiting at the head of the queue: {why}" if verdict is not None
                    else "waiting at the head of the queue: nothing holds it; it is "
                         "admitted at the next tick")
    else:
        ahead = f"{pos} request{'s' if pos != 1 else ''} ahead of you"
        sentence = f"waiting: {ahead}; the head is held: {why}" if verdict is not None \
            else f"waiting: {ahead}; the head is admitted at the next tick"
    fair = out.get("fair")
    if fair is not None and pos > 0:
        sentence += (f"; your session's counter is {fair['session_counter']:g}, the lowest "
                     f"waiting is {fair['lowest_waiting_counter']:g}")
    out["sentence"] = sentence + _preempted_note(req)
    return out


def _with_share(s, req: Request, out: dict[str, Any], others_private: bool = False
                ) -> dict[str, Any]:
    """With shares (H6): the request's tenant (session) share now, what it holds, whether
    it borrows and whether its share holds this request back, in `share` and the sentence.
    A waiting request owed a row that a gate holds: who the rows it needs are lent to,
    being taken back (`taking_back`; "another tenant" when `others_private`). A running
    row beyond its tenant's share: that it is lent, and taken back when one is owed it."""
    book = s.admission.book(s)
    if book is None:
        return out
    n = shares.path(req)[0]
    rows, kv = book.share(n)
    pending = req.status.value == "pending"
    held = pending and shares.holds(book, req, s.admission.need) is not None
    who = "tenant" if req.tenant is not None else "session"
    lent = [r for r in book.borrowed(n)]
    out["share"] = {"unit": who, "rows": book.rows[n], "share_rows": round(rows, 2),
                    "kv": book.kv[n], "share_kv": round(kv, 2),
                    "contenders": len(book.siblings.get((), [])),
                    "borrowing": bool(lent), "borrowed_rows": len(lent), "held_back": held}
    note = (f"; your {who}'s share now: {rows:g} of {s.config.max_batch_size} rows and "
            f"{kv:g} of {s.kv_budget_tokens} KV tokens ({out['share']['contenders']} "
            f"{who}s want them); it holds {book.rows[n]} rows and {book.kv[n]} KV tokens")
    if any(r is req for r in lent):
        note += ("; this row is lent to your " + who + " (beyond its share, while nobody "
                 "else wants it): it is taken back (preempted, recomputed later) when one "
                 "under its share waits")
    elif lent:
        note += ": borrowing what nobody else wants now, given back first when someone waits"
    if held:
        note += "; its share holds this request back while one under its share waits"
    gate = (out.get("held_by") or {}).get("gate")
    if pending and not held and gate in ("batch", "G2", "G3") and s.config.reclaim != "off" \
            and s.admission.choose(s, next(iter(s.policy)))[0] is req:  # T1's next choice
        back = shares.to_take_back(book, req, s.admission.need)
        if back:
            lenders = sorted({shares.path(r)[0][0] for r in back})
            names = (f"another {who}" if len(lenders) == 1 else f"{len(lenders)} other {who}s") \
                if others_private else ", ".join(lenders)
            out["taking_back"] = {"from": [] if others_private else lenders, "rows": len(back)}
            note += (f"; the room it needs is lent to {names}, being taken back: at the "
                     "next tick the borrowed rows are preempted, newest first, and it is "
                     "admitted")
    out["sentence"] += note
    return out


def _hold_words(r) -> str:
    """A gate's verdict in words, with its numbers (G6)."""
    n = r.numbers
    if r.reason == "batch_full":
        return f"the batch is full ({n['rows']}/{n['max_batch_size']} rows)"
    if r.reason in ("kv_budget", "kv_budget_exceeded"):
        return (f"G2: {n['active_kv_reserved']} of {n['kv_budget_tokens']} KV tokens are "
                f"reserved, it needs {n['need']}")
    if r.reason in ("block_pool", "prompt_exceeds_block_pool"):
        return f"G3: {n['free_blocks']} free blocks, it needs {n['blocks_needed']}"
    if r.reason == "session_cap":
        return (f"its session already holds {n['session_rows']} rows, the cap "
                f"(max_rows_per_session={n['max_rows_per_session']})")
    return r.message


def _load_words(r) -> str:
    """A verdict on someone else's request, in words that name only the server's load."""
    n = r.numbers
    if r.reason == "batch_full":
        return _hold_words(r)
    if r.reason in ("kv_budget", "kv_budget_exceeded"):
        return f"G2: {n['active_kv_reserved']} of {n['kv_budget_tokens']} KV tokens are reserved"
    if r.reason in ("block_pool", "prompt_exceeds_block_pool"):
        return f"G3: {n['free_blocks']} free blocks"
    if r.reason == "over_share":
        return "its tenant is above its share now, and one under its share waits (H6)"
    return f"{r.gate or 'a share rule'} ({r.reason})"


def _fair_view(s, req: Request) -> dict[str, Any] | None:
    counters = getattr(s.policy, "counters", None)
    if counters is None:
        return None
    unit = getattr(s.policy, "unit", lambda r: r.session_id)  # per tenant, if any (H5)
    waiting = [counters.get(unit(r), 0.0) for r in s.policy if r.priority == req.priority]
    return {"session_counter": counters.get(unit(req), 0.0),
            "lowest_waiting_counter": min(waiting) if waiting else None}


def _preempted_note(req: Request) -> str:
    if not req.num_preemptions:
        return ""
    times = "once" if req.num_preemptions == 1 else f"{req.num_preemptions} times"
    return f" (preempted {times}; re-admission recomputes {req.prefill_len} tokens)" \
        if req.status.value == "pending" else f" (preempted {times} so far)"


def _recompute_note(req: Request) -> str:
    if not req.num_preemptions:
        return ""
    return (f", recomputing after {req.num_preemptions} preemption"
            f"{'s' if req.num_preemptions != 1 else ''}")


def _finished_sentence(done: dict[str, Any]) -> str:
    if done.get("rejection"):
        r = done["rejection"]
        return f"finished: refused by {r['gate']}: {r['message']}"
    extra = f" after {done['preemptions']} preemption(s)" if done["preemptions"] else ""
    return (f"finished ({done['finish_reason']}): {done['tokens_so_far']} tokens"
            f"{extra}")
