# mistake: next_chunk is the scheduler's own
# expect: the graded cell was not run
# expect: `from minserve.scheduler import Scheduler`: the engine's own code is not allowed
from minserve.scheduler import Scheduler


def next_chunk(req: Request, chunk_size: int | None) -> tuple[int, int]:
    """This tick's piece (start, end) of req's prompt; chunk_size None: the whole rest."""
    return Scheduler.next_chunk(req, chunk_size)


def measure(trace, request_id: str) -> dict:
    """{"max_prompt_tokens_per_tick": ..., "ttft_ticks": ...} read off the tick records."""
    def seen(rec):
        q = rec.queues
        return (request_id in q["pending"] + q["prefilling"] + q["active"]
                or any(a["request_id"] == request_id for a in rec.admit.admitted))
    arrival = next(rec.tick for rec in trace if seen(rec))
    first = next(rec.tick for rec in trace for c in rec.prefill.chunks
                 if c["request_id"] == request_id and c["first_token"] is not None)
    worst = max(sum(c["end"] - c["start"] for c in rec.prefill.chunks) for rec in trace)
    return {"max_prompt_tokens_per_tick": worst, "ttft_ticks": first - arrival + 1}
