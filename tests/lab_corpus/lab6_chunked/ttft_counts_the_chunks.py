# mistake: time to first token counted as the number of chunks the request's prompt took
# expect: where to look: measure
# expect: waiting in pending counts
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
    chunks = [c for rec in trace for c in rec.prefill.chunks if c["request_id"] == request_id]
    worst = max(sum(c["end"] - c["start"] for c in rec.prefill.chunks) for rec in trace)
    return {"max_prompt_tokens_per_tick": worst, "ttft_ticks": len(chunks)}
