"""Lab 6: chunked prefill (SPEC C1). The student writes the per-tick chunk schedule, which
replaces `Scheduler.next_chunk` in one engine, and a measurement of its trade-off read off
the tick records: the most prompt tokens one tick carries (every streaming user waits a
whole tick between two tokens: the stall) against the long request's time to first token
in ticks (TTFT)."""

from __future__ import annotations

from ..engine import Engine
from ..request import Request
from ..sampling import SamplingParams
from ..scheduler import Scheduler
from .allowlist import Cell
from .common import drain, fail, make_req, secret_rng, show, stock_tokens, student, tiny_engine
from .guard import guarded_check

WHERE = ("docs/scheduler.md (chunked prefill, C1), the tick records in minserve/records.py "
         "(docs/inspecting.md) and notebook 06_chunked_prefill.ipynb")


def reference():
    """What a submission may not lean on: the scheduler's own chunk schedule."""
    return [(Scheduler, ("next_chunk",), "Scheduler", False)]


def use_chunk_schedule(engine: Engine, next_chunk) -> Engine:
    """This engine's T2 asks `next_chunk(req, chunk_size)` for each row's piece. A piece
    outside the prompt is refused here, with the input that produced it, before the engine
    would crash on it."""
    def schedule(req: Request, size: int | None) -> tuple[int, int]:
        computed = req.num_computed_prompt_tokens
        got = student(next_chunk, req, size, name="next_chunk", where=WHERE)
        try:
            start, end = got
        except (TypeError, ValueError):
            fail(f"next_chunk({show_row(req)}, chunk_size={size}) returned {got!r}: return a "
                 "(start, end) pair", f"next_chunk; {WHERE}")
        if start != computed or not start < end <= req.prefill_len \
                or (size is not None and end - start > size):
            fail(f"next_chunk({show_row(req)}, chunk_size={size}) returned ({start}, {end}): the "
                 f"piece must start where the row's KV ends ({computed}), end after it and at "
                 f"most at the prompt's end ({req.prefill_len}), and hold at most chunk_size "
                 "tokens", f"next_chunk; {WHERE}")
        return start, end

    engine.scheduler.next_chunk = schedule
    return engine


def show_row(req: Request) -> str:
    return (f"request with a {req.prefill_len}-token prompt, {req.num_computed_prompt_tokens} "
            "already computed")


def _row(prompt_len: int, computed: int) -> Request:
    req = make_req(0, prompt=prompt_len)
    req.num_computed_prompt_tokens = computed
    return req


@guarded_check(20, reference, WHERE)
def check_schedule(next_chunk) -> None:
    cases = [((10, 0, None), (0, 10)), ((10, 0, 4), (0, 4)), ((10, 8, 4), (8, 10)),
             ((32, 16, 16), (16, 32)), ((33, 16, 64), (16, 33))]
    for (n, done, size), want in cases:
        got = student(next_chunk, _row(n, done), size, name="next_chunk", where=WHERE)
        got = tuple(got) if isinstance(got, (tuple, list)) else got
        if got != want:
            fail(f"next_chunk(prompt of {n} tokens, {done} already computed, chunk_size={size}) "
                 f"returned {got!r}, expected {want}: start where the row's KV ends "
                 "(num_computed_prompt_tokens, which includes a cached prefix), take at most "
                 "chunk_size tokens (None: all the rest)", f"next_chunk; {WHERE}")


def run(next_chunk, chunk: int, long_len: int = 96, short=3, max_tokens: int = 8,
        held: int = 0):
    """`short` decoding rows, then one `long_len`-token prompt arriving at tick 2, on an
    engine with chunk size `chunk` (0: monolithic) and the student's schedule. With
    `held` > 0 the batch has no free row when the long prompt arrives: it waits in
    `pending` until the first short row finishes, about `held` ticks later."""
    engine = use_chunk_schedule(tiny_engine(max_batch_size=short + (not held),
                                            prefill_chunk_size=chunk,
                                            enable_prefix_caching=False), next_chunk)
    engine.account = Account(engine)  # the engine's own account of the run (Account)
    shorts = [engine.account.submit([5 + i, 6, 7], SamplingParams(
                  max_tokens=held + 1 if held and i == 0 else 2 * max_tokens + held))
              for i in range(short)]
    drain(engine, WHERE, ticks=1)
    long = engine.account.submit(list(range(1, long_len + 1)),
                                 SamplingParams(max_tokens=max_tokens))
    drain(engine, WHERE)
    return engine, shorts + [long]


@guarded_check(60, reference, WHERE)
def check_in_engine(next_chunk, chunk: int = 16, long_len: int = 96) -> None:
    """Every tick pushes at most `chunk` prompt tokens per row, the long prompt takes
    ceil(long_len / chunk) ticks, and the tokens equal monolithic prefill's. The schedule's
    own cases are checked first (a wrong piece is named there, before any engine runs)."""
    check_schedule(next_chunk)
    engine, handles = run(next_chunk, chunk, long_len)
    long_id = handles[-1].request_id
    pieces = [c for rec in engine.trace for c in rec.prefill.chunks if c["request_id"] == long_id]
    if any(c["end"] - c["start"] > chunk for c in pieces) or len(pieces) != -(-long_len // chunk):
        fail(f"the {long_len}-token prompt went through in pieces "
             f"{[(c['start'], c['end']) for c in pieces]}; with chunk_size={chunk} expected "
             f"{-(-long_len // chunk)} pieces of at most {chunk}", f"next_chunk; {WHERE}")
    ref = stock_tokens([([5 + i, 6, 7], 16) for i in range(3)] + [(list(range(1, long_len + 1)), 8)],
                           max_batch_size=4, enable_prefix_caching=False)
    for h, want in zip(handles, ref):
        if h.output.token_ids != want:
            fail(f"{h.request_id}: chunked tokens {h.output.token_ids} differ from monolithic "
                 f"{want}: a chunk skipped or repeated prompt tokens", f"next_chunk; {WHERE}")


# measure's right answers on `run`'s workload (3 short rows, a 96-token prompt at tick 2),
# read off by hand from the trace: the most prompt tokens in one tick is the chunk (or the
# whole prompt), the long request's first token comes ceil(96 / chunk) ticks after it arrived
PUBLIC_ANSWERS = {0: {"max_prompt_tokens_per_tick": 96, "ttft_ticks": 1},
                  16: {"max_prompt_tokens_per_tick": 16, "ttft_ticks": 6},
                  32: {"max_prompt_tokens_per_tick": 32, "ttft_ticks": 3}}


@guarded_check(60, reference, WHERE)
def check_measure(next_chunk, measure, chunks=(0, 16, 32),
                  answers: dict | str | None = None, long_len: int = 96,
                  held: int = 0) -> list[dict]:
    """The student's measurement equals the right answer on runs with several chunk sizes:
    `answers` maps a chunk size to it, or is "engine" (the engine's own account of each
    run, `Account`: what the hidden test compares with); by default the public answers
    above (a chunk size they lack is measured, not checked). With `held`, the measured request first
    waits in `pending` (see `run`). Returns one row per chunk size."""
    answers = PUBLIC_ANSWERS if answers is None else answers
    check_schedule(next_chunk)
    rows = []
    for chunk in chunks:
        engine, handles = run(next_chunk, chunk, long_len=long_len, held=held)
        long_id = handles[-1].request_id
        got = student(measure, engine.trace, long_id, name="measure", where=WHERE)
        want = engine.account.answer(long_id) if answers == "engine" else answers.get(chunk)
        if want is not None and (not isinstance(got, dict) or dict(got) != want):
            waited = sum(long_id in rec.queues["pending"] for rec in engine.trace)
            story = (f"the {long_len}-token prompt arrived while every batch row was busy and "
                     f"waited {waited} tick(s) in pending before its first chunk; " if held
                     else "")
            fail(f"chunk_size={chunk}: {story}measure(trace, {long_id!r}) returned {got!r}, "
                 f"expected {want}. max_prompt_tokens_per_tick: the largest sum of (end - "
                 "start) over a tick's rec.prefill.chunks; ttft_ticks: ticks from the one "
                 "where the request first appears, in any queue (counted; waiting in pending "
                 "counts), to the one whose chunk has its first_token", f"measure; {WHERE}")
        rows.append({"chunk_size": chunk or "monolithic", **got})
    return rows


# ------------------------------------------------------------------ hidden: against the engine
CONTRACT6 = {
    "next_chunk": "next_chunk(req, chunk_size) is (start, end): start = "
                  "req.num_computed_prompt_tokens (a cached prefix included), end = the "
                  "prompt's end, or start + chunk_size if that comes first (None: the whole "
                  "rest).",
    "max_prompt_tokens_per_tick": "max_prompt_tokens_per_tick is the most prompt tokens one "
                                  "tick pushed through the model: the largest sum of (end - "
                                  "start) over a tick's rec.prefill.chunks.",
    "ttft_ticks": "ttft_ticks counts the tick in which the request first appears in a record "
                  "(queued or admitted: waiting in pending counts) as 1, up to the tick whose "
                  "chunk carries its first token.",
}


def _pair(got):
    from .differential import WrongKind

    try:
        start, end = got
    except (TypeError, ValueError):
        raise WrongKind(f"{show(got)}, not a (start, end) pair") from None
    if type(start) is not int or type(end) is not int:
        raise WrongKind(f"({show(start)}, {show(end)}), not two ints")
    return (start, end)


def _schedule_machine():
    from .differential import Differential, choose

    class Machine(Differential):
        next_chunk: object
        OPS = ((1, "piece"),)

        def op_piece(self, arg):
            n, arg = choose((1, 2, 3, 5, 8, 16, 17, 33, 64), arg)
            done, arg = choose((0, 0, n - 1, n // 2, 1, max(0, n - 2)), arg)
            size, _ = choose((None, None, 1, 2, 3, 4, 8, 16, n, n - done, n - done + 1, 64), arg)
            size = size if size is None else max(1, size)
            req = make_req(0, prompt=n)
            req.num_computed_prompt_tokens = done
            mine = make_req(0, prompt=n)
            mine.num_computed_prompt_tokens = done
            self.call(f"next_chunk({show_row(req)}, chunk_size={size})",
                      lambda: Scheduler.next_chunk(req, size), lambda: self.next_chunk(mine, size),
                      ref_canon=_pair, sentence=CONTRACT6["next_chunk"],
                      where=f"next_chunk; {WHERE}")

    return Machine


class Account:
    """The engine's own account of a run, kept from its requests around each tick (not
    from the records a `measure` reads): the tick each request was submitted before, the
    tick of its first token, and the prompt tokens each tick computed (a cached prefix is
    not computed). It watches `engine.step`; requests go in through `submit`."""

    def __init__(self, engine) -> None:
        self.engine, self._step = engine, engine.step
        engine.step = self.step
        self.reqs: list = []
        self.arrived: dict[str, int] = {}
        self.first: dict[str, int] = {}
        self.worst = 0

    def submit(self, prompt: list[int], sampling):
        req = self.engine.make_request(prompt, sampling)
        self.engine.scheduler.submit(req)
        self.reqs.append(req)
        self.arrived[req.request_id] = self.engine.scheduler.tick_count + 1
        return req.handle

    def step(self):
        before = {r.request_id: (r.status.value, r.num_computed_prompt_tokens) for r in self.reqs}
        rec = self._step()
        pushed = 0
        for r in self.reqs:
            status, computed = before[r.request_id]
            admitted = status == "pending" and r.status.value != "pending"
            pushed += r.num_computed_prompt_tokens - computed - (r.num_cached_tokens if admitted else 0)
            if r.output_token_ids and r.request_id not in self.first:
                self.first[r.request_id] = rec.tick
        self.worst = max(self.worst, pushed)
        return rec

    def answer(self, rid: str) -> dict:
        return {"max_prompt_tokens_per_tick": self.worst,
                "ttft_ticks": self.first[rid] - self.arrived[rid] + 1}


def _measure_machine():
    from .differential import Differential, WrongKind, choose

    def answer_canon(got):
        if not isinstance(got, dict):
            raise WrongKind(f"{show(got)}, not a dict")
        out = {}
        for k in ("max_prompt_tokens_per_tick", "ttft_ticks"):
            v = got.get(k)
            if type(v) is not int:
                raise WrongKind(f"{show(got)}: {k} is not an int")
            out[k] = v
        return out

    class Machine(Differential):
        measure: object
        OPS = ((3, "submit"), (3, "tick"))

        def setup(self, arg) -> None:
            from ..sampling import SamplingParams

            self.SamplingParams = SamplingParams
            batch, arg = choose((1, 1, 2, 2, 3), arg)
            chunk, arg = choose((0, 1, 3, 4, 8, 16), arg)
            cache, _ = choose((False, True), arg)
            self.engine = tiny_engine(max_batch_size=batch, prefill_chunk_size=chunk,
                                      enable_prefix_caching=cache, block_size=4)
            self.account = Account(self.engine)
            self.steps.append(f"engine: max_batch_size={batch}, prefill_chunk_size={chunk}, "
                              f"prefix caching {'on' if cache else 'off'} (block_size 4)")
            self.op_submit(arg >> 8, least=2)  # a first burst: requests that wait behind others

        def op_submit(self, arg, least: int = 1):
            """One to three requests queued between two ticks (so some wait behind others)."""
            burst, arg = choose((1, 2, 3, 3), arg)
            burst = max(burst, least)
            for _ in range(burst):
                n, arg = choose((1, 3, 4, 8, 9, 17, 24), arg)
                shared, arg = choose((False, True), arg)
                out, arg = choose((1, 2, 3, 5), arg)
                prompt = ([40 + t for t in range(n)] if shared
                          else [1 + (len(self.account.reqs) * 7 + t) % 200 for t in range(n)])
                handle = self.account.submit(prompt, self.SamplingParams(max_tokens=out))
                self.steps.append(f"submit {handle.request_id}: a {n}-token prompt"
                                  f"{' (its first tokens shared with others)' if shared else ''}, "
                                  f"max_tokens {out}")

        def op_tick(self, arg):
            k, _ = choose((1, 1, 2, 3), arg)
            for _ in range(k):
                if not self.engine.scheduler.has_work():
                    break
                self.engine.step()
            self.steps.append(f"{k} tick(s): now tick {self.engine.scheduler.tick_count}")
            for req in self.account.reqs:
                rid = req.request_id
                if rid not in self.account.first:
                    continue
                trace = list(self.engine.trace)
                self.steps.append(f"measure(trace, {rid!r})")
                self.call_measure(rid, trace)
                self.steps.pop()

        def call_measure(self, rid, trace):
            text = self.steps.pop()
            want = self.account.answer(rid)
            got = self.call(text, lambda: want, lambda: self.measure(trace, rid),
                            sub_canon=answer_canon, ref_canon=lambda v: v,
                            sentence=f"{CONTRACT6['max_prompt_tokens_per_tick']} "
                                     f"{CONTRACT6['ttft_ticks']}",
                            where=f"measure; {WHERE}")
            self.steps.append(text)
            return got

    return Machine


@guarded_check(60, reference, WHERE)
def check_against_the_engine(next_chunk, measure, hidden) -> None:
    """Hidden: next_chunk beside the scheduler's own on random rows (cached prefixes, a
    last piece shorter than the chunk, chunk_size None); then measure on random runs of
    the real engine (batch 1 to 3, chunk sizes 0 to 16, prefix caching on and off,
    requests submitted between ticks, so that some wait in pending behind others), drawn
    from the instructor's secret, against the engine's own account of each run (when each
    request was submitted, the tick of its first token, the prompt tokens each tick
    computed)."""
    from .differential import run

    run(_schedule_machine(), hidden, "lab6/next_chunk", piece="your next_chunk",
        reference="the scheduler's own next_chunk", where=WHERE,
        bind={"next_chunk": next_chunk}, examples=40, steps=10)
    run(_measure_machine(), hidden, "lab6/measure", piece="your measure",
        reference="the engine's own account of the run", where=WHERE,
        bind={"measure": measure}, examples=24, steps=14, shrink_s=4.0)


# what the graded cell defines and may use (allowlist.py; grading runs it alone)
CELL = Cell(names=("next_chunk", "measure"), provided=lambda: {"Request": Request},
            imports={"minserve.request": frozenset({"Request"})})


def hidden_runs(hidden, n_chunks: int = 2) -> dict:
    """The arguments of the autograder's held-in-pending measurement, drawn from the
    instructor's secret: `n_chunks` chunk sizes (one may be monolithic), the prompt's
    length and how long it waits for a row."""
    rng = secret_rng(hidden.seed, "lab6/held")
    chunks = tuple(rng.sample([0, 8, 12, 16, 24, 40], 2))[:n_chunks]
    return {"chunks": chunks, "long_len": rng.randint(40, 90), "held": rng.randint(2, 5)}


def hidden_engine_run(hidden) -> dict:
    """check_in_engine's arguments drawn from the secret: a chunk size and a prompt length."""
    rng = secret_rng(hidden.seed, "lab6/engine")
    return {"chunk": rng.choice([8, 12, 16, 24]), "long_len": rng.randint(40, 100)}
