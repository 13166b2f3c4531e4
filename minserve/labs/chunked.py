"""Lab 6: chunked prefill (SPEC C1). The student writes the per-tick chunk schedule, which
replaces `Scheduler.next_chunk` in one engine, and a measurement of its trade-off read off
the tick records: the most prompt tokens one tick carries (every streaming user waits a
whole tick between two tokens: the stall) against the long request's time to first token
in ticks (TTFT)."""

from __future__ import annotations

from ..engine import Engine
from ..request import Request
from ..sampling import SamplingParams
from .common import drain, fail, make_req, reference_tokens, student, tiny_engine

WHERE = ("your next_chunk / measure; compare minserve/scheduler.py Scheduler.next_chunk, "
         "advance_prefill_chunk and docs/scheduler.md (chunked prefill)")


def use_chunk_schedule(engine: Engine, next_chunk) -> Engine:
    """This engine's T2 asks `next_chunk(req, chunk_size)` for each row's piece."""
    engine.scheduler.next_chunk = lambda req, size: student(next_chunk, req, size,
                                                            name="next_chunk", where=WHERE)
    return engine


def _row(prompt_len: int, computed: int) -> Request:
    req = make_req(0, prompt=prompt_len)
    req.num_computed_prompt_tokens = computed
    return req


def check_schedule(next_chunk) -> None:
    cases = [((10, 0, None), (0, 10)), ((10, 0, 4), (0, 4)), ((10, 8, 4), (8, 10)),
             ((32, 16, 16), (16, 32)), ((33, 16, 64), (16, 33))]
    for (n, done, size), want in cases:
        got = student(next_chunk, _row(n, done), size, name="next_chunk", where=WHERE)
        if tuple(got) != want:
            fail(f"next_chunk(prompt of {n} tokens, {done} already computed, chunk_size={size}) "
                 f"returned {tuple(got)}, expected {want}: start where the row's KV ends "
                 "(num_computed_prompt_tokens, which includes a cached prefix), take at most "
                 "chunk_size tokens (None: all the rest)", f"next_chunk; {WHERE}")


def run(next_chunk, chunk: int, long_len: int = 96, short=3, max_tokens: int = 8):
    """`short` decoding rows, then one `long_len`-token prompt arriving at tick 2, on an
    engine with chunk size `chunk` (0: monolithic) and the student's schedule."""
    engine = use_chunk_schedule(tiny_engine(max_batch_size=short + 1, prefill_chunk_size=chunk,
                                            enable_prefix_caching=False), next_chunk)
    shorts = [engine.submit([5 + i, 6, 7], SamplingParams(max_tokens=2 * max_tokens))
              for i in range(short)]
    engine.step()
    long = engine.submit(list(range(1, long_len + 1)), SamplingParams(max_tokens=max_tokens))
    drain(engine, WHERE)
    return engine, shorts + [long]


def check_in_engine(next_chunk, chunk: int = 16, long_len: int = 96) -> None:
    """Every tick pushes at most `chunk` prompt tokens per row, the long prompt takes
    ceil(long_len / chunk) ticks, and the tokens equal monolithic prefill's."""
    engine, handles = run(next_chunk, chunk, long_len)
    long_id = handles[-1].request_id
    pieces = [c for rec in engine.trace for c in rec.prefill.chunks if c["request_id"] == long_id]
    if any(c["end"] - c["start"] > chunk for c in pieces) or len(pieces) != -(-long_len // chunk):
        fail(f"the {long_len}-token prompt went through in pieces "
             f"{[(c['start'], c['end']) for c in pieces]}; with chunk_size={chunk} expected "
             f"{-(-long_len // chunk)} pieces of at most {chunk}", f"next_chunk; {WHERE}")
    ref = reference_tokens([([5 + i, 6, 7], 16) for i in range(3)] + [(list(range(1, long_len + 1)), 8)],
                           max_batch_size=4, enable_prefix_caching=False)
    for h, want in zip(handles, ref):
        if h.output.token_ids != want:
            fail(f"{h.request_id}: chunked tokens {h.output.token_ids} differ from monolithic "
                 f"{want}: a chunk skipped or repeated prompt tokens", f"next_chunk; {WHERE}")


def reference_measure(trace, long_id: str) -> dict:
    """The answer key for `measure`."""
    arrival = next(r.tick for r in trace if long_id in r.queues["pending"] + r.queues["prefilling"]
                   + r.queues["active"] or any(a["request_id"] == long_id for a in r.admit.admitted))
    first = next(r.tick for r in trace for c in r.prefill.chunks
                 if c["request_id"] == long_id and c["first_token"] is not None)
    worst = max(sum(c["end"] - c["start"] for c in r.prefill.chunks) for r in trace)
    return {"max_prompt_tokens_per_tick": worst, "ttft_ticks": first - arrival + 1}


def check_measure(next_chunk, measure, chunks=(0, 16, 32)) -> list[dict]:
    """The student's measurement equals the answer key on runs with several chunk sizes.
    Returns one row per chunk size."""
    rows = []
    for chunk in chunks:
        engine, handles = run(next_chunk, chunk)
        long_id = handles[-1].request_id
        got = student(measure, engine.trace, long_id, name="measure", where=WHERE)
        want = reference_measure(engine.trace, long_id)
        if dict(got) != want:
            fail(f"chunk_size={chunk}: measure(trace, {long_id!r}) returned {dict(got)}, expected "
                 f"{want}. max_prompt_tokens_per_tick: the largest sum of (end - start) over a "
                 "tick's rec.prefill.chunks; ttft_ticks: ticks from the one where the request "
                 "first appears (counted) to the one whose chunk has its first_token",
                 f"measure; {WHERE}")
        rows.append({"chunk_size": chunk or "monolithic", **want})
    return rows
