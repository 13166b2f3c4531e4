# correct: one pass over the records fills per-request first-seen and first-token ticks; the schedule as min() of two ends
def next_chunk(req: Request, chunk_size: int | None) -> tuple[int, int]:
    """This tick's piece (start, end) of req's prompt; chunk_size None: the whole rest."""
    start = req.num_computed_prompt_tokens
    room = req.prompt_len - start if chunk_size is None else chunk_size
    return start, min(req.prompt_len, start + room)


def measure(trace, request_id: str) -> dict:
    """{"max_prompt_tokens_per_tick": ..., "ttft_ticks": ...} read off the tick records."""
    seen, first_token, worst = None, None, 0
    for rec in trace:
        ids = set(rec.queues["pending"]) | set(rec.queues["prefilling"]) | set(rec.queues["active"])
        ids |= {a["request_id"] for a in rec.admit.admitted}
        if seen is None and request_id in ids:
            seen = rec.tick
        pushed = 0
        for c in rec.prefill.chunks:
            pushed += c["end"] - c["start"]
            if c["request_id"] == request_id and c["first_token"] is not None and first_token is None:
                first_token = rec.tick
        worst = max(worst, pushed)
    return {"max_prompt_tokens_per_tick": worst, "ttft_ticks": first_token - seen + 1}
