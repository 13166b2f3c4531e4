# mistake: time to first token counted from the tick of the request's first prompt chunk: the ticks it waited in pending before any chunk are left out
# expect: where to look: measure
# expect: waiting in pending counts
def next_chunk(req: Request, chunk_size: int | None) -> tuple[int, int]:
    """This tick's piece (start, end) of req's prompt; chunk_size None: the whole rest."""
    start = req.num_computed_prompt_tokens
    end = req.prompt_len if chunk_size is None else min(req.prompt_len, start + chunk_size)
    return start, end


def measure(trace, request_id: str) -> dict:
    """{"max_prompt_tokens_per_tick": ..., "ttft_ticks": ...} read off the tick records."""
    ticks = [rec.tick for rec in trace for c in rec.prefill.chunks if c["request_id"] == request_id]
    first = next(rec.tick for rec in trace for c in rec.prefill.chunks
                 if c["request_id"] == request_id and c["first_token"] is not None)
    worst = 0
    for rec in trace:
        worst = max(worst, sum(c["end"] - c["start"] for c in rec.prefill.chunks))
    return {"max_prompt_tokens_per_tick": worst, "ttft_ticks": first - min(ticks) + 1}
