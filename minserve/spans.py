"""Where a served token's time goes: timestamps per tick and per token, when asked.

Off by default. `MINSERVE_SPANS=FILE minserve serve ...` (or `engine.set_spans(Spans())`
in a notebook) turns it on: the engine gives one `Spans` to its scheduler, to every
request's streaming handle and, through `engine.spans`, to the HTTP server, and each
records `time.perf_counter()` at the points below. Off, each of those points is one
check of an attribute that is None: nothing is recorded, nothing allocated.

    worker thread, one tick (scheduler.py, execute.py)           event loop (server/api.py)
    start | admit | prefill | evict | setup | forward | chunks | sample | post | record | gap
                                                                        └ per token: detokenise, push
                                                                              │
                                                          push ──> got by the SSE stream ──> sent

* a **tick** is cut at phase boundaries (`mark`): T1 admit, T2 prefill (in mixed_batch
  only the plan: its chunks ride in T4's forward), T3 evict, then T4's parts: the setup
  (KV slots, reservations), the model's forward, the prompt chunks that rode in it
  (their first tokens, promotions, prefix-cache hashes), sampling, posting the tokens
  (each token's detokenising and push to its handle inside it), and the tick's record;
  the gap is the worker's loop between two ticks;
* a **token** has four times: its detokenising starts, its push to the handle, the
  SSE stream's generator gets it (on the server's event loop, another thread), and its
  chunk has been written to the socket.

`summary()` turns them into the split of a streamed token's time that `minserve bench
served-token` prints (docs/benchmarks.md, "Where a served token's time goes"). `dump` writes
everything as JSON (the server does at shutdown when MINSERVE_SPANS names a file).
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

ENV = "MINSERVE_SPANS"  # a file: record spans, and write them there when the server stops
PHASES = ("admit", "prefill", "evict", "setup", "forward", "chunks", "sample", "post",
          "record")


class Spans:
    """The timestamps of the ticks and tokens of one engine (see the module docstring).

    `limit` bounds memory: after that many ticks (and 8x as many tokens) it stops
    recording and says so (`dropped`), rather than grow without end on a long run.
    """

    def __init__(self, path: str | Path | None = None, limit: int = 200_000) -> None:
        self.path = None if path is None else Path(path)
        self.limit = limit
        self.ticks: list[dict[str, Any]] = []  # {"start", marks: [(phase, t)], "rows", "chunk_tokens"}
        self.tokens: dict[tuple[str, int], dict[str, float]] = {}  # (request id, index) -> times
        self.dropped = 0
        self._lock = threading.Lock()  # tokens are written by the worker and the event loop
        self._tick: dict[str, Any] | None = None

    # --- the worker thread: one tick ------------------------------------------------
    def tick_started(self) -> None:
        self._tick = {"start": time.perf_counter(), "marks": []}

    def mark(self, phase: str) -> None:
        """The tick's `phase` (one of PHASES) ends now."""
        if self._tick is not None:
            self._tick["marks"].append((phase, time.perf_counter()))

    def tick_ended(self, rows: int, forward_tokens: int) -> None:
        """The tick ran `rows` decode rows in a forward of `forward_tokens` tokens (more than
        `rows` when prompt chunks rode along)."""
        tick, self._tick = self._tick, None
        if tick is None:
            return
        if len(self.ticks) >= self.limit:
            self.dropped += 1
            return
        tick.update(rows=rows, chunk_tokens=max(0, forward_tokens - rows))
        self.ticks.append(tick)

    # --- one token: the worker pushes it, the event loop sends it ----------------------
    def token_pushed(self, request_id: str, index: int, detok: float, pushed: float,
                     done: float) -> None:
        """Token `index` of `request_id`: its detokenising began at `detok`, its event was
        pushed to the handle at `pushed` (StreamEvent.time), the push returned at `done`."""
        self._token(request_id, index, detok=detok, pushed=pushed, done=done)

    def token_sent(self, request_id: str, index: int, got: float, sent: float) -> None:
        """The SSE stream got the event at `got` and had written its chunk at `sent`."""
        self._token(request_id, index, got=got, sent=sent)

    def _token(self, request_id: str, index: int, **times: float) -> None:
        with self._lock:
            entry = self.tokens.get((request_id, index))
            if entry is None:
                if len(self.tokens) >= 8 * self.limit:
                    self.dropped += 1
                    return
                entry = self.tokens[(request_id, index)] = {}
            entry.update(times)

    # --- reading them ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            tokens = [{"request_id": r, "index": i, **t} for (r, i), t in self.tokens.items()]
        return {"ticks": list(self.ticks), "tokens": tokens, "dropped": self.dropped}

    def dump(self, path: str | Path | None = None) -> Path:
        path = Path(path or self.path)
        path.write_text(json.dumps(self.to_dict()))
        return path

    def summary(self) -> dict[str, Any]:
        return summary(self.to_dict())


def from_env(env: dict[str, str] | None = None) -> Spans | None:
    """A `Spans` writing to the file MINSERVE_SPANS names, or None (off) when it is unset."""
    path = (os.environ if env is None else env).get(ENV)
    return Spans(path) if path else None


def tick_phases(tick: dict[str, Any], next_start: float | None) -> dict[str, float]:
    """Seconds per phase of one recorded tick, and the gap to the next tick's start."""
    out, t = {}, tick["start"]
    for phase, at in tick["marks"]:
        out[phase] = out.get(phase, 0.0) + at - t
        t = at
    out["gap"] = 0.0 if next_start is None else max(0.0, next_start - t)
    return out


def phase_at(tick: dict[str, Any], t: float) -> str | None:
    """The phase of `tick` that was running at time `t` (None: after its last mark)."""
    for phase, end in tick["marks"]:
        if t <= end:
            return phase
    return None


def summary(data: dict[str, Any]) -> dict[str, Any]:
    """The split of a streamed token's time, from `Spans.to_dict()` (or a dumped file).

    Each token after a request's first is charged the cycle of the tick that produced it
    (its phases and the gap before the next tick): in a steady stream the time between
    two tokens IS a tick's cycle. The tokens' detokenising and pushes to their
    handles are taken out of the phases they ran in (`post` for decode rows, `chunks` or
    `prefill` for first tokens) and counted apart. Per part, the mean over those tokens, in seconds, so the parts
    add up to the mean time per output token of the run's streams (`cycle_s`). Beside
    it, on the event loop's thread and in parallel with the next tick, the mean seconds
    from a token's push to the SSE stream getting it, and to its chunk's write. Ticks
    with a prompt chunk in their forward are counted too (`chunk_ticks_share`): they
    are the long ones.
    """
    ticks = sorted(data["ticks"], key=lambda t: t["start"])
    starts = [t["start"] for t in ticks]
    cycles = [tick_phases(t, starts[i + 1] if i + 1 < len(ticks) else None)
              for i, t in enumerate(ticks)]
    for c in cycles:
        c.update(detokenise=0.0, push=0.0)
    wait, sse = [], []
    for tok in data["tokens"]:  # each token's detokenise and push, out of the phase it ran in
        if "got" in tok and "pushed" in tok:
            wait.append(tok["got"] - tok["pushed"])
            sse.append(tok["sent"] - tok["got"])
        i = _tick_of(starts, tok["pushed"]) if "pushed" in tok else None
        phase = None if i is None else phase_at(ticks[i], tok["detok"])
        if phase is not None:  # `post` for a decode row's token, `chunks` for a first one
            detok, push = tok["pushed"] - tok["detok"], tok["done"] - tok["pushed"]
            cycles[i].update({"detokenise": cycles[i]["detokenise"] + detok,
                              "push": cycles[i]["push"] + push,
                              phase: cycles[i][phase] - detok - push})
    per_token: dict[str, list[float]] = {}
    rows, chunked = [], 0
    for tok in data["tokens"]:
        if tok["index"] < 1 or "pushed" not in tok:
            continue  # a request's first token: its time is TTFT's, not TPOT's
        i = _tick_of(starts, tok["pushed"])
        if i is None or i + 1 >= len(ticks):
            continue  # the last tick has no gap after it yet
        for part, sec in cycles[i].items():
            per_token.setdefault(part, []).append(sec)
        rows.append(ticks[i]["rows"])
        chunked += ticks[i]["chunk_tokens"] > 0
    n = len(rows)
    mean = {part: sum(v) / n for part, v in per_token.items()} if n else {}
    return {"tokens": n, "per_token_s": mean, "cycle_s": sum(mean.values()),
            "push_to_sse_s": _mean(wait), "sse_write_s": _mean(sse),
            "rows_median": statistics.median(rows) if rows else 0,
            "chunk_ticks_share": chunked / n if n else 0.0, "dropped": data.get("dropped", 0)}


def _tick_of(starts: list[float], t: float) -> int | None:
    """The index of the last tick that started at or before `t` (binary search)."""
    lo, hi = 0, len(starts)
    while lo < hi:
        mid = (lo + hi) // 2
        if starts[mid] <= t:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1 if lo else None


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None
