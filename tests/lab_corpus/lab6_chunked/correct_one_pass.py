# correct: the schedule with min() on a remaining count; measure in one pass over the records
def next_chunk(req: Request, chunk_size: int | None) -> tuple[int, int]:
    """This tick's piece (start, end) of req's prompt; chunk_size None: the whole rest."""
    done = req.num_computed_prompt_tokens
    left = req.prompt_len - done
    return done, done + (left if chunk_size is None else min(left, chunk_size))


def measure(trace, request_id: str) -> dict:
    """{"max_prompt_tokens_per_tick": ..., "ttft_ticks": ...} read off the tick records."""
    arrived = first = None
    worst = 0
    for rec in trace:
        here = (request_id in rec.queues["pending"] or request_id in rec.queues["prefilling"]
                or request_id in rec.queues["active"]
                or request_id in [a["request_id"] for a in rec.admit.admitted])
        if here and arrived is None:
            arrived = rec.tick
        tick_tokens = 0
        for c in rec.prefill.chunks:
            tick_tokens += c["end"] - c["start"]
            if first is None and c["request_id"] == request_id and c["first_token"] is not None:
                first = rec.tick
        worst = max(worst, tick_tokens)
    return {"max_prompt_tokens_per_tick": worst, "ttft_ticks": first - arrived + 1}
