"""The load generator: who sends what, and when (docs/benchmarks.md).

A *workload* is a fixed list of requests, each with a session, a prompt (token
ids), a number of tokens to generate and an arrival time. It is built once from
a seed and then replayed, identically, against every target (minserve, an HTTP
server, the Hugging Face peers), so their figures can be compared.

    sessions ──► arrival process per session ──► merged, first N by time
                 (Poisson / gamma, or "all at t=0", or closed loop)
    each request: prompt length ~ dist, output length ~ dist, prompt ids from a seeded RNG

Arrivals (open loop). Gaps between a session's requests are gamma-distributed
with mean 1/rate and shape `burstiness` (the convention of vLLM's
benchmark_serving): shape 1 is a Poisson process; below 1 requests come in
bursts (coefficient of variation 1/sqrt(shape)); above 1 they are more regular.
Latency is measured from the *scheduled* arrival, not from when the driver got
round to sending it, so a slow client never hides queueing ("coordinated
omission").

Closed loop (`concurrency=C`): no arrival times; the driver keeps C requests in
flight and sends the next one when one finishes.

Lengths: `fixed:N`, `uniform:A:B`, `lognormal:MEDIAN:SIGMA[:LO:HI]`, or `chat`,
a lognormal mix shaped like chat traffic (many short turns, a long tail),
scaled down so a 2-core CPU finishes a run in minutes. No dataset is
downloaded: prompts are random token ids, or random English-like text through
the tokenizer, drawn from `numpy.random.default_rng([seed, index])`, so request
i is the same whatever else is in the workload.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


# ------------------------------------------------------------------ lengths
@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts. Parse one from a string with `LengthDist.parse`."""

    kind: str  # "fixed" | "uniform" | "lognormal"
    a: float  # fixed: N; uniform: low; lognormal: median
    b: float = 0.0  # uniform: high (inclusive); lognormal: sigma of log(length)
    lo: int = 1  # clip (lognormal)
    hi: int = 1 << 20

    # Chat-like presets (ShareGPT's shape -- lognormal, long right tail -- at about
    # a third of its scale, so CPU runs stay short). Means: prompt ~ 145, output ~ 66.
    CHAT_PROMPT = ("lognormal", 96.0, 0.9, 8, 512)
    CHAT_OUTPUT = ("lognormal", 48.0, 0.8, 4, 256)

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise ValueError(f"length kind {self.kind!r}; use fixed, uniform, lognormal or chat")
        if self.a < 1 or (self.kind == "uniform" and self.b < self.a) or self.lo < 1 \
                or self.hi < self.lo:
            raise ValueError(f"bad length distribution {self}")

    @classmethod
    def parse(cls, spec: str | int, role: str = "output") -> LengthDist:
        """'128' or 'fixed:128' | 'uniform:32:256' | 'lognormal:96:0.9[:8:512]' | 'chat'."""
        s = str(spec).strip().lower()
        if s == "chat":
            return cls(*(cls.CHAT_PROMPT if role == "prompt" else cls.CHAT_OUTPUT))
        parts = s.split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", float(int(parts[0])))
            kind, nums = parts[0], [float(x) for x in parts[1:]]
            if kind == "fixed" and len(nums) == 1:
                return cls("fixed", nums[0])
            if kind == "uniform" and len(nums) == 2:
                return cls("uniform", nums[0], nums[1])
            if kind == "lognormal" and len(nums) in (2, 4):
                lo, hi = (int(nums[2]), int(nums[3])) if len(nums) == 4 else (1, 1 << 20)
                return cls("lognormal", nums[0], nums[1], lo, hi)
        except ValueError:
            pass
        raise ValueError(f"length spec {spec!r}: use N, fixed:N, uniform:A:B, "
                         f"lognormal:MEDIAN:SIGMA[:LO:HI] or chat")

    def sample(self, rng: np.random.Generator) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return int(rng.integers(int(self.a), int(self.b) + 1))
        x = rng.lognormal(math.log(self.a), self.b)
        return int(min(self.hi, max(self.lo, round(x))))

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed {int(self.a)}"
        if self.kind == "uniform":
            return f"uniform {int(self.a)}..{int(self.b)}"
        return f"lognormal median {self.a:g} sigma {self.b:g} in [{self.lo}, {self.hi}]"


# ------------------------------------------------------------------ arrivals
def arrival_times(n: int, rate: float, burstiness: float = 1.0,
                  rng: np.random.Generator | None = None) -> list[float]:
    """`n` arrival times (seconds, the first at 0) of a gamma renewal process.

    Gaps ~ Gamma(shape=burstiness, scale=1/(rate*burstiness)): mean gap 1/rate
    whatever the burstiness; burstiness 1 = Poisson. rate = inf: all at 0.
    """
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be > 0")
    rng = rng if rng is not None else np.random.default_rng(0)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0  # start at once: no idle lead-in
    return np.cumsum(gaps).tolist()


def parse_sessions(spec: str | int | None) -> list[tuple[str, float]]:
    """'3' -> three equal sessions s0..s2; 'alice=2,bob=1' -> named, by weight; None -> one."""
    if spec in (None, "", 1, "1"):
        return [("default", 1.0)]
    s = str(spec)
    if s.isdigit():
        return [(f"s{i}", 1.0) for i in range(int(s))]
    out = []
    for part in s.split(","):
        name, _, w = part.partition("=")
        weight = float(w) if w else 1.0
        if not name.strip() or weight <= 0:
            raise ValueError(f"session spec {part!r}: use NAME or NAME=WEIGHT with WEIGHT > 0")
        out.append((name.strip(), weight))
    return out


def weighted_turns(sessions: list[tuple[str, float]], n: int) -> list[str]:
    """Who sends each of `n` requests when there are no arrival times to merge (all at
    t=0, or a closed loop): the sessions take turns in proportion to their weights, spread
    out (smooth weighted round robin), so 'alice=3,bob=1' gives alice 3 of every 4
    requests. Equal weights: strictly in turn, s0, s1, s2, s0, ..."""
    total = sum(w for _, w in sessions)
    current = [0.0] * len(sessions)
    turns = []
    for _ in range(n):
        for k, (_, w) in enumerate(sessions):
            current[k] += w
        k = max(range(len(sessions)), key=current.__getitem__)  # the first on a tie
        current[k] -= total
        turns.append(sessions[k][0])
    return turns


# ------------------------------------------------------------------ prompts
WORDS = ("the a an of to in on for with about after before under over model token batch "
         "request queue cache block stream server client fair policy prompt answer question "
         "river mountain city garden music story letter window morning evening colour number "
         "write explain describe list compare translate summarise imagine build measure "
         "quick slow bright quiet careful simple useful strange ancient modern small large "
         "and but because while when where which that this these those it they we you").split()


def prompt_ids_random(n: int, rng: np.random.Generator, vocab: tuple[int, int]) -> list[int]:
    """n token ids uniform in [vocab[0], vocab[1]) (keep specials below vocab[0] out)."""
    return rng.integers(vocab[0], vocab[1], size=n).tolist()


def prompt_ids_text(n: int, rng: np.random.Generator, tokenizer) -> list[int]:
    """n token ids of English-like text: random words through the tokenizer, cut to n."""
    ids: list[int] = []
    while len(ids) < n:
        words = rng.choice(WORDS, size=max(8, n)).tolist()
        sentence = " ".join(words).capitalize() + ". "
        ids += tokenizer(sentence, add_special_tokens=False)["input_ids"]
    return ids[:n]


# ------------------------------------------------------------------ the workload
@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload, independent of any target."""

    index: int
    session: str
    arrival_s: float | None  # seconds after the run starts; None: closed loop
    prompt_ids: tuple[int, ...]
    max_tokens: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass
class Workload:
    requests: list[BenchRequest]
    concurrency: int | None = None  # closed loop: this many in flight (arrival_s all None)
    settings: dict[str, Any] = field(default_factory=dict)  # how it was made, for the report

    @property
    def open_loop(self) -> bool:
        return self.concurrency is None

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def describe(self) -> str:
        s = self.settings
        when = (f"closed loop, {self.concurrency} in flight" if not self.open_loop else
                "all at t=0" if math.isinf(s.get("rate", math.inf)) else
                f"{s['rate']:g} req/s, burstiness {s.get('burstiness', 1.0):g}")
        return (f"{len(self.requests)} requests ({when}); prompts {s.get('prompt_len')}, "
                f"outputs {s.get('output_len')}; {self.prompt_tokens} prompt + "
                f"{self.output_tokens} output tokens")


def make_workload(num_requests: int, *, rate: float = math.inf, burstiness: float = 1.0,
                  concurrency: int | None = None, prompt_len: str | LengthDist = "chat",
                  output_len: str | LengthDist = "chat", sessions: str | int | None = None,
                  seed: int = 0, tokenizer=None, vocab: tuple[int, int] = (100, 49152),
                  shared_prefix: int = 0, max_model_len: int | None = None) -> Workload:
    """Build a deterministic workload (same arguments -> same requests, bit for bit).

    rate: total requests/s over all sessions (inf: all arrive at t=0), split by
    session weight; each session has its own arrival process. At rate inf and in
    a closed loop the requests are shared out by weight too (`weighted_turns`).
    concurrency: a closed loop instead (rate is then ignored). tokenizer: prompts are text
    through it; None: random ids in `vocab`. shared_prefix: every prompt starts
    with the same this-many tokens (a system prompt; exercises prefix caching).
    max_model_len: clip prompt + output to fit.
    """
    pl = prompt_len if isinstance(prompt_len, LengthDist) else LengthDist.parse(prompt_len, "prompt")
    ol = output_len if isinstance(output_len, LengthDist) else LengthDist.parse(output_len, "output")
    sess = parse_sessions(sessions)
    total_w = sum(w for _, w in sess)

    # Who arrives when: each session its own process; merge; the first N by time.
    if concurrency is not None or math.isinf(rate):  # no times to merge: turns by weight
        at = None if concurrency is not None else 0.0
        order = [(at, name) for name in weighted_turns(sess, num_requests)]
    else:
        merged = []
        for k, (name, w) in enumerate(sess):
            times = arrival_times(num_requests, rate * w / total_w, burstiness,
                                  np.random.default_rng([seed, 1_000_003, k]))
            merged += [(t, k, name) for t in times]
        merged.sort()
        order = [(t, name) for t, _, name in merged[:num_requests]]

    prefix_rng = np.random.default_rng([seed, 7])
    prefix = (prompt_ids_text(shared_prefix, prefix_rng, tokenizer) if tokenizer is not None
              else prompt_ids_random(shared_prefix, prefix_rng, vocab)) if shared_prefix else []
    reqs = []
    for i, (t, name) in enumerate(order):
        rng = np.random.default_rng([seed, i])
        n_in, n_out = max(1, pl.sample(rng)), max(1, ol.sample(rng))
        if max_model_len is not None:  # keep prompt + output inside the context
            n_out = min(n_out, max_model_len // 2)
            n_in = min(n_in, max_model_len - n_out)
        body = max(1, n_in - len(prefix))
        ids = (prompt_ids_text(body, rng, tokenizer) if tokenizer is not None
               else prompt_ids_random(body, rng, vocab))
        reqs.append(BenchRequest(i, name, t, tuple(prefix + ids), n_out))
    settings = {"num_requests": num_requests, "rate": rate, "burstiness": burstiness,
                "concurrency": concurrency, "prompt_len": pl.describe(),
                "output_len": ol.describe(), "sessions": dict(sess), "seed": seed,
                "prompts": "text" if tokenizer is not None else "random ids",
                "shared_prefix": shared_prefix}
    return Workload(reqs, concurrency, settings)

