# mistake: time to first token counted from the first tick the request is held by a gate or admitted, not from when it was queued: a request that waits behind another looks faster than it was
# expect: where to look: measure
# expect: waiting in pending counts
def next_chunk(req: Request, chunk_size: int | None) -> tuple[int, int]:
    """This tick's piece (start, end) of req's prompt; chunk_size None: the whole rest."""
    start = req.num_computed_prompt_tokens
    end = req.prompt_len if chunk_size is None else min(req.prompt_len, start + chunk_size)
    return start, end


def measure(trace, request_id: str) -> dict:
    """{"max_prompt_tokens_per_tick": ..., "ttft_ticks": ...} read off the tick records."""
    def touched(rec):
        held = rec.admit.held and rec.admit.held["request_id"] == request_id
        return held or any(a["request_id"] == request_id for a in rec.admit.admitted)

    start = next(rec.tick for rec in trace if touched(rec))
    first = next(rec.tick for rec in trace for c in rec.prefill.chunks
                 if c["request_id"] == request_id and c["first_token"] is not None)
    worst = max(sum(c["end"] - c["start"] for c in rec.prefill.chunks) for rec in trace)
    return {"max_prompt_tokens_per_tick": worst, "ttft_ticks": first - start + 1}
