"""Serving metrics, from what a client saw (docs/benchmarks.md).

Every target fills one `RequestResult` per request: when it was due, when each
token (or text chunk) reached the client, when it ended and why. Everything
else is derived here, the same way for every target:

    arrival ─── queue + prefill ───► tok0 ─ itl ─► tok1 ─ itl ─► ... tokN-1 ──► finished
    │◄──────────── TTFT ────────────►│◄───── (N-1) x TPOT ──────►│
    │◄──────────────────────────── e2e latency ─────────────────────────────────►│

* TTFT: first token - arrival (arrival = the *scheduled* time, see workload.py).
* ITL (inter-token latency): every gap between consecutive tokens of a request,
  pooled over all requests (so a long request weighs by its token count, as in
  vLLM's benchmark_serving); mean, p50, p90, p99, max.
* TPOT (time per output token): per request, (last token - first token) / (N-1);
  its distribution is over requests.
* Throughput: tokens / run duration, where the run lasts from its start to the
  last request's end (the makespan). Output tokens, and total = prompt + output.
* Jain's fairness index over sessions, J = (sum x)^2 / (n * sum x^2), between
  1/n (one session got everything) and 1 (all equal). Two choices of x:
  `throughput` (each session's output tokens/s divided by its weight; the VTC
  notion, meaningful when sessions stay backlogged) and `latency` (each session's
  mean e2e latency per output token; meaningful when loads differ).
* Refusals by gate: from the final event's `rejection` (SPEC G6), e.g. {"G1": 3}.

Percentiles use linear interpolation between order statistics (numpy's default):
p50 of [1, 2, 3, 4] is 2.5.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


@dataclass
class RequestResult:
    """What one request looked like from the client's side. Times are time.perf_counter()."""

    index: int
    session: str
    prompt_len: int
    max_tokens: int
    arrival: float  # when it was due (scheduled arrival), the zero of its latencies
    sent: float | None = None  # when the driver actually submitted it
    token_times: list[float] = field(default_factory=list)  # each token / text chunk received
    finished: float | None = None
    output_len: int = 0  # tokens generated (may exceed len(token_times) over HTTP)
    finish_reason: str | None = None
    rejection: dict[str, Any] | None = None  # the gate's refusal (G6), if refused
    error: str | None = None

    @property
    def ok(self) -> bool:
        return (self.rejection is None and self.error is None and self.finished is not None
                and bool(self.token_times))

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        n, t = self.output_len, self.token_times
        return (t[-1] - t[0]) / (n - 1) if n > 1 and len(t) > 1 else None

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    def to_dict(self, t0: float = 0.0) -> dict[str, Any]:
        """JSON-friendly, times relative to the run start t0."""
        d = asdict(self)
        for k in ("arrival", "sent", "finished"):
            d[k] = None if d[k] is None else round(d[k] - t0, 6)
        d["token_times"] = [round(t - t0, 6) for t in self.token_times]
        d.update(ttft=self.ttft, tpot=self.tpot, e2e=self.e2e)
        return d


def percentile(values, q: float) -> float | None:
    """q in [0, 100]; linear interpolation; None for no values."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def describe(values) -> dict[str, float | None]:
    """mean, p50, p90, p99, max and n of a list of seconds."""
    v = list(values)
    return {"n": len(v), "mean": float(np.mean(v)) if v else None, "p50": percentile(v, 50),
            "p90": percentile(v, 90), "p99": percentile(v, 99), "max": max(v) if v else None}


def jain_index(xs) -> float | None:
    """Jain's fairness index (Jain, Chiu & Hawe 1984): (sum x)^2 / (n * sum x^2)."""
    xs = [float(x) for x in xs]
    sq = sum(x * x for x in xs)
    return None if not xs or sq == 0 else sum(xs) ** 2 / (len(xs) * sq)


def summarize(results: list[RequestResult], t_start: float, t_end: float | None = None,
              session_weights: dict[str, float] | None = None) -> dict[str, Any]:
    """Aggregate a run's results. t_end defaults to the last request's end."""
    done = [r for r in results if r.ok]
    ends = [r.finished for r in results if r.finished is not None]
    t_end = t_end if t_end is not None else (max(ends) if ends else t_start)
    duration = max(t_end - t_start, 1e-9)
    out_tok = sum(r.output_len for r in done)
    in_tok = sum(r.prompt_len for r in done)
    refusals = Counter(str(r.rejection.get("gate", "?")) for r in results if r.rejection)
    s: dict[str, Any] = {
        "requests": {"total": len(results), "completed": len(done), "refused": sum(refusals.values()),
                     "errors": sum(1 for r in results if r.error is not None and not r.rejection)},
        "refusals_by_gate": dict(sorted(refusals.items())),
        "duration_s": duration, "prompt_tokens": in_tok, "output_tokens": out_tok,
        "throughput": {"requests_per_s": len(done) / duration,
                       "output_tokens_per_s": out_tok / duration,
                       "total_tokens_per_s": (in_tok + out_tok) / duration},
        "ttft": describe(r.ttft for r in done),
        "itl": describe(x for r in done for x in r.itls),
        "tpot": describe(r.tpot for r in done if r.tpot is not None),
        "e2e": describe(r.e2e for r in done),
    }
    # --- per session
    by: dict[str, list[RequestResult]] = defaultdict(list)
    for r in results:
        by[r.session].append(r)
    weights = session_weights or {}
    sessions = {}
    for name, rs in sorted(by.items()):
        ok = [r for r in rs if r.ok]
        tokens = sum(r.output_len for r in ok)
        sessions[name] = {
            "requests": len(rs), "completed": len(ok), "refused": sum(1 for r in rs if r.rejection),
            "output_tokens": tokens, "output_tokens_per_s": tokens / duration,
            "ttft_p50": percentile([r.ttft for r in ok], 50),
            "ttft_p99": percentile([r.ttft for r in ok], 99),
            "e2e_mean": float(np.mean([r.e2e for r in ok])) if ok else None,
            "latency_per_token": (float(np.mean([r.e2e / r.output_len for r in ok]))
                                  if ok else None),
        }
    s["sessions"] = sessions
    served = [v for v in sessions.values() if v["completed"]]
    s["jain"] = {
        "throughput": jain_index(v["output_tokens_per_s"] / weights.get(k, 1.0)
                                 for k, v in sessions.items() if v["completed"]),
        "latency": jain_index(v["latency_per_token"] for v in served),
    } if len(sessions) > 1 else {"throughput": None, "latency": None}
    return s
