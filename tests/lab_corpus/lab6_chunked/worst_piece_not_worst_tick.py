# mistake: measure takes the largest single piece instead of the largest tick
# expect: where to look: measure
# expect: the largest sum of (end - start) over a tick's rec.prefill.chunks
def next_chunk(req: Request, chunk_size: int | None) -> tuple[int, int]:
    """This tick's piece (start, end) of req's prompt; chunk_size None: the whole rest."""
    start = req.num_computed_prompt_tokens
    end = req.prompt_len if chunk_size is None else min(req.prompt_len, start + chunk_size)
    return start, end


def measure(trace, request_id: str) -> dict:
    """{"max_prompt_tokens_per_tick": ..., "ttft_ticks": ...} read off the tick records."""
    def seen(rec):
        q = rec.queues
        return (request_id in q["pending"] + q["prefilling"] + q["active"]
                or any(a["request_id"] == request_id for a in rec.admit.admitted))
    arrival = next(rec.tick for rec in trace if seen(rec))
    first = next(rec.tick for rec in trace for c in rec.prefill.chunks
                 if c["request_id"] == request_id and c["first_token"] is not None)
    worst = max(c["end"] - c["start"] for rec in trace for c in rec.prefill.chunks)
    return {"max_prompt_tokens_per_tick": worst, "ttft_ticks": first - arrival + 1}
