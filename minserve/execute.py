"""Run the forwards a tick planned, then post what they produced (SPEC T2, T4, C1).

nano-vllm's engine step is `schedule -> run -> postprocess`. In minserve the schedule
is the phases' (scheduler.py decides which rows decode and which prompt piece each
prefilling row pushes: `_plan_prefill`, `decode_step`); this module is the other two:

    run                                                 postprocess
    T2  run_pieces: prefill_together (one forward)      post_pieces -> piece_done: count it,
        or prefill_chunk (one per piece)                    on the final piece K3, the first
    T4  run_decode: decode_step_batched, or                 token and the promotion (C3)
        forward_mixed with T2's planned pieces          sample: every row at once, one copy
        (mixed_batch, Version B: ONE forward)               to the host (D5); post_token: record,
                                                            stream, stop (A1); charge (P3)

A piece is `(req, start, end)`: the row's `prefill_token_ids[start:end]`, where `start`
is where its KV ends. A forward that raises fails every row it carried; a row whose
postprocessing raises fails alone (failures.py). Each forward's token count goes to
`s.forwards` (the tick record's `forwards`).

Functions of the scheduler `s` they are given, as admission.py's are: they read
`s.backend`, `s.policy`, `s.block_manager` and call `s._promote_to_decode` at the time
of the call, so a lab or a test that swaps one of them on a scheduler is heard here.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from . import failures
from .records import DecodeRecord, PrefillRecord
from .request import FinishReason, Request

Piece = tuple[Request, int, int]  # one row's prefill_token_ids[start:end] for this tick


# ================================================================= T2: the prompt pieces
def run_pieces(s, pieces: list[Piece], rec: PrefillRecord) -> None:
    """Push the pieces through the model: in ONE forward when there are several and the
    backend can (`prefill_together`; paged: flattened, padded: left-padded side by
    side), else one forward per piece. Each completed piece goes to `rec.chunks`."""
    together = len(pieces) > 1 and s.backend.supports_batched_prefill
    for group in [pieces] if together else [[p] for p in pieces]:
        try:
            if together:
                logits = s.backend.prefill_together(group)  # per piece: (V,) or None
            else:
                logits = [s.backend.prefill_chunk(*group[0])]  # (V,)
            s.forwards.append(sum(end - start for _, start, end in group))
        except Exception as e:
            for req, _, _ in group:
                failures.fail_row(s, req, "prefill", e, rec.failed)
            continue
        for _, chunk in post_pieces(s, group, logits, rec.failed):
            if chunk["final"]:
                rec.promoted.append(chunk["request_id"])
            rec.chunks.append(chunk)


def defer_to_decode(s, pieces: list[Piece], rec: PrefillRecord) -> None:
    """mixed_batch (Version B): run nothing now; T4's forward carries the pieces
    (`s._planned`). Their chunk records go to `rec` now, marked `in_decode_forward`,
    and get their `first_token` (and `rec` its promotions) when T4 has run."""
    for req, start, end in pieces:
        chunk = {"request_id": req.request_id, "start": start, "end": end,
                 "final": end == req.prefill_len, "first_token": None,
                 "in_decode_forward": True}
        s._planned.append((req, chunk))
        rec.chunks.append(chunk)


def run_remote(s, rec: PrefillRecord) -> None:
    """disaggregated (disagg/connector.py): T2's pieces, computed on the prefill worker
    instead of here. First what it finished: each piece is posted as if computed here
    (`post_pieces`: counted and charged, P3; a final piece promotes the row, its KV spliced
    in at the C3 seam and its first token sampled from the worker's logits); a row the
    worker failed on, or could not compute, fails alone. Then `remote.send`: the next
    pieces, planned as `_plan_prefill` plans them (each row's next chunk, the budget split
    between tenants, then sessions: C5, H6), when the worker has no forward queued.
    `rec.remote`: what was sent, what waits and why, what is on the worker, the transfers."""
    remote = s.remote
    # Nothing to decode, prompts on the worker (or waiting for it to start): wait for an
    # answer (briefly) instead of spinning ticks, whose CPU the worker would lose.
    idle = not s.active and not len(s.policy) and (
        remote.busy() or (bool(s.prefilling) and not remote.ready))
    done, lost = remote.poll(wait_s=0.05 if idle else 0.0)
    by_id = {r.request_id: r for r in s.prefilling}
    for rid, why in lost:
        if rid in by_id:
            failures.fail_row(s, by_id[rid], "the prefill worker", RuntimeError(why), rec.failed)
    done = [d for d in done if by_id.get(d[0].request_id) is d[0]]  # rows still here
    rec.remote = {"sent": [], "pieces": {}, "waiting": {}, "transfers": {}}
    for _, chunk in post_pieces(s, [(req, a, b) for req, a, b, _ in done],
                                [logits for *_, logits in done], rec.failed):
        chunk["on_worker"] = True
        rec.chunks.append(chunk)
        if chunk["final"]:
            rec.promoted.append(chunk["request_id"])
            rec.remote["transfers"][chunk["request_id"]] = remote.transfers.pop(
                chunk["request_id"], None)
    sent, refused = remote.send(list(s.prefilling))
    for req, why in refused:  # the worker is out of restarts for now: these rows fail alone
        failures.fail_row(s, req, "the prefill worker", RuntimeError(why), rec.failed)
    rec.remote.update(sent)
    rec.remote["on_worker"] = [j["request_id"] for j in remote.snapshot()["on_worker"]
                               if not j["abandoned"]]


def post_pieces(s, pieces: list[Piece], logits: list, failed: list) -> list[tuple[int, dict]]:
    """`piece_done` for each piece a forward carried (logits: per piece (V,), or None
    where it was not the prompt's final piece). The final pieces' first tokens are sampled
    together first (`sample`: one call, one copy to the host). A piece whose posting
    raises fails its row alone, noted in `failed`. Returns (index in `pieces`, chunk
    record) of the rest."""
    finals = [i for i, (req, _, end) in enumerate(pieces) if end == req.prefill_len]
    try:
        first = dict(zip(finals, sample(s, [pieces[i][0] for i in finals],
                                        [logits[i] for i in finals])))
    except Exception as e:  # the sampling call itself failed: every row it carried
        first = {i: e for i in finals}
    done = []
    for i, (req, start, end) in enumerate(pieces):
        try:
            done.append((i, piece_done(s, req, start, end, first.get(i))))
        except Exception as e:
            failures.fail_row(s, req, "prefill", e, failed)
    return done


def piece_done(s, req: Request, start: int, end: int, first=None) -> dict[str, Any]:
    """After prompt[start:end] went through the model (its own forward, or the mixed
    one): count it; on the final piece, the first token (`first`, what `sample` gave this
    row) and the promotion."""
    req.num_computed_prompt_tokens = end
    req.timing.prefill_chunks += 1
    s.prompt_tokens_computed += end - start
    # after a preemption: tokens whose KV existed before are computed again
    again = max(0, min(end, req.kv_high_water) - start)
    s.recomputed_tokens += again
    req.num_recomputed_tokens += again
    # P3 charges prompt tokens computed for the first time; output tokens (which a
    # re-prefill after a preemption also carries) were charged when sampled
    new_prompt = max(0, min(end, req.prompt_len) - max(start, req.kv_high_water))
    req.kv_high_water = max(req.kv_high_water, end)
    final = end == req.prefill_len
    chunk = {"request_id": req.request_id, "start": start, "end": end,
             "final": final, "first_token": None}
    if again:
        chunk["recomputed"] = again
    if final:
        # The C3 seam, looked up on the scheduler. First: a disaggregated row's KV is
        # spliced in there, and only KV that is there may be shared (K3) or streamed from.
        s._promote_to_decode(req)
        if s.block_manager is not None:  # K3: its full blocks may be shared from now on
            s.block_manager.mark_computed(req.request_id, req.prefill_token_ids, end)
        chunk["first_token"] = post_token(s, req, first)
    with s.queue_lock:  # P3: the chunk's new prompt tokens (+ the next output token);
        # recomputation is the scheduler's doing, not the session's: never charged
        s.policy.on_tokens_processed(req, new_prompt, 1 if final else 0)
    return chunk


# ================================================================= T4: the decode forward
def run_decode(s, rows: list[Request], planned: list[tuple[Request, dict]],
               rec: DecodeRecord) -> None:
    """Grow each row's KV by the token it is fed, run the forward, sample one token per
    row; post the planned pieces (mixed_batch: their chunk records are T2's, in
    `s._planned_record`). A forward that raises fails every row in it; a row whose
    sampling or charge raises fails alone, and T3 evicts it next tick."""
    if s.backend.kv_grows_in_pool:
        for r in rows:  # room for the token about to be written
            s.block_manager.append_slots(r.request_id, r.num_tokens)
    for r in rows:  # R1: preempt's reservation grows with the KV (reserve's: by 0)
        r.reserved_tokens += s.admission.per_decode
        s.active_kv_reserved += s.admission.per_decode
    feed = [r.output_token_ids[-1] for r in rows]
    pieces = [(r, c["start"], c["end"]) for r, c in planned]
    rec.positions = {r.request_id: r.num_tokens - 1 for r in rows}
    s._mark("setup")
    try:
        if pieces:  # Version B: decode rows and prompt pieces, ONE forward
            logits, piece_logits = s.backend.forward_mixed(rows, feed, pieces)
        else:
            logits, piece_logits = s.backend.decode_step_batched(rows, feed), []  # (B, V)
        s.forwards.append(len(rows) + sum(end - start for _, start, end in pieces))
    except Exception as e:  # one forward for all rows: each of them failed
        for req in rows + [r for r, _ in planned]:
            failures.fail_row(s, req, "decode forward", e, rec.failed)
        return
    s._mark("forward")
    for i, done in post_pieces(s, pieces, piece_logits, rec.failed):
        planned[i][1]["first_token"] = done["first_token"]
        if done["final"]:
            s._planned_record.promoted.append(done["request_id"])
    s._mark("chunks")
    try:
        tokens = sample(s, rows, logits)
    except Exception as e:  # the one sampling call failed: every row it carried
        tokens = [e] * len(rows)
    s._mark("sample")
    for req, tok in zip(rows, tokens):
        try:
            post_token(s, req, tok)
            with s.queue_lock:
                s.policy.on_tokens_processed(req, 0, 1)
        except Exception as e:  # this row's sampling or charge failed: it alone
            req.finish_reason = FinishReason.ERROR
            failures.note_row_error(s, req, "decode", e)
            rec.failed.append({"request_id": req.request_id, "error": req.error})
            continue  # T3 evicts it next tick, like any finished row
        rec.rows.append(req.request_id)
        rec.tokens[req.request_id] = tok
        if req.finish_reason is not None:
            rec.finished[req.request_id] = req.finish_reason.value
    s._mark("post")


def sample(s, reqs: list[Request], logits) -> list:
    """Each row's next token (or why it has none), from logits (B, V) or a list of (V,):
    ONE batched call to the sampler and one copy to the host for the whole forward
    (SPEC D5), each row with its own params and generator (`Sampler.sample`)."""
    if not reqs:
        return []
    if isinstance(logits, (list, tuple)):
        logits = torch.stack(list(logits))  # (B, V)
    return s.sampler.sample(logits, [r.sampling for r in reqs], [r.generator for r in reqs])


def post_token(s, req: Request, tok) -> int:
    """Record and stream the token `sample` gave the row; a reason instead of a token
    (NaN logits, ...) or the sampling call's error raises here, failing the row alone.
    Sets finish_reason when the request is done (A1)."""
    if isinstance(tok, Exception):
        raise tok
    if isinstance(tok, str):
        raise ValueError(tok)
    req.output_token_ids.append(tok)
    s.tokens_generated += 1
    if req.timing.first_token is None:
        req.timing.first_token = time.perf_counter()
    hit_stop_string = False
    if req.handle is not None:
        hit_stop_string = req.handle._on_token(len(req.output_token_ids) - 1, tok)
    reason = FinishReason.STOP if hit_stop_string else req.stop_reason_after(tok)
    if reason is not None:
        req.finish_reason = reason
    return tok

